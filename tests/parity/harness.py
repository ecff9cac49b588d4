"""The live controller on a manual clock, with engines replaced by a fake timed like the simulator.

`ManualBackend` obeys the engine protocol's calls (it produces placeholder
tokens and holds KV nowhere) and times each call with the same cost model and
the same arithmetic as `sims.simulator`'s executor, so a Plan log that differs
from the simulator's can only come from the controller/runner path.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

from pool.controller import Controller
from pool.engines.base import GenRequest, SamplingParams, TokenOut
from pool.runner import LiveRequest
from scheduler import ManualClock, Request


class ManualBackend:
    def __init__(self, clock: ManualClock, costs: Any) -> None:
        self.clock = clock
        self.costs = costs
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0
        self.produced: dict[str, int] = {}  # request -> tokens produced so far
        self.limit: dict[str, int] = {}  # request -> max_tokens (the trace's output length)
        self.model: dict[str, str] = {}
        self.context: dict[str, int] = {}  # prompt tokens
        self.prefetch: dict[str, tuple[str, float]] = {}  # instance -> model in the spare slot, ready at
        self.active: dict[str, str] = {}
        self.turn: dict[str, tuple[float, float]] = {}  # instance -> (turn start, step seconds)
        self.num_calls = 0

    def call(self, instance_id: str, method: str, args: tuple[Any, ...], meta: dict[str, Any]) -> int:
        self._seq += 1
        self.num_calls += 1
        now = self.clock.now()
        at, result = getattr(self, "_" + method)(instance_id, now, *args, **meta)
        heapq.heappush(self._heap, (at, self._seq, result))
        return self._seq

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def pop(self) -> tuple[int, Any]:
        _, handle, result = heapq.heappop(self._heap)
        return handle, result

    # ---- the engine calls, timed like the simulator's executor -------------------------
    def _activate(self, iid: str, now: float, model: str, **_: Any) -> tuple[float, float]:
        ready = self.prefetch.pop(iid, None)
        took = max(0.0, ready[1] - now) if ready and ready[0] == model else self.costs.switch_s(model)
        old = self.active.get(iid)
        if old is not None and old != model:
            self.prefetch[iid] = (old, now)  # two slots: the model switched away from stays, ready
        self.active[iid] = model
        return now + took, took

    def _prefetch(self, iid: str, now: float, model: str, **_: Any) -> tuple[float, None]:
        if self.prefetch.get(iid, ("", 0.0))[0] != model:
            self.prefetch[iid] = (model, now + self.costs.switch_s(model))
        return now, None

    def _prefill(self, iid: str, now: float, requests: list[GenRequest], **_: Any) -> tuple[float, list[TokenOut]]:
        for req in requests:
            self.model[req.request_id] = req.model
            self.context[req.request_id] = len(req.prompt_token_ids)
            self.produced[req.request_id] = len(req.output_token_ids)
            self.limit[req.request_id] = req.sampling.max_tokens
        took = 0.0
        for model in {r.model for r in requests}:
            group = [r for r in requests if r.model == model]
            took += self.costs.prefill_s(model, sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in group),
                                         len(group))
        return now + took, self._tokens([r.request_id for r in requests])

    def _decode_step(self, iid: str, now: float, ids: list[str], turn_step: int, max_steps: int,
                     **_: Any) -> tuple[float, list[TokenOut]]:
        if turn_step == 1:
            steps = min(max_steps, min(self.limit[r] - self.produced[r] for r in ids))
            took = 0.0
            for model in {self.model[r] for r in ids}:
                group = [r for r in ids if self.model[r] == model]
                took += self.costs.decode_turn_s(model, len(group), sum(self._ctx(r) for r in group), steps)
            self.turn[iid] = (now, took / steps)
        start, step_s = self.turn[iid]
        return start + turn_step * step_s, self._tokens(ids)

    def _save_kv(self, iid: str, now: float, ids: list[str], **_: Any) -> tuple[float, None]:
        return now + self._move(ids), None

    def _restore_kv(self, iid: str, now: float, ids: list[str], **_: Any) -> tuple[float, None]:
        return now + self._move(ids), None

    def _export_kv(self, iid: str, now: float, ids: list[str], **_: Any) -> tuple[float, list[str]]:
        return now, list(ids)

    def _import_kv(self, iid: str, now: float, exports: list[str], **_: Any) -> tuple[float, None]:
        return now, None

    def _release(self, iid: str, now: float, ids: list[str], **_: Any) -> tuple[float, None]:
        return now, None

    def _ctx(self, rid: str) -> int:
        return self.context[rid] + self.produced[rid]

    def _move(self, ids: list[str]) -> float:
        took = 0.0
        for rid in ids:
            took += self.costs.kv_move_s(self.model[rid], self._ctx(rid))
        return took + self.costs.kv_move_overhead_s(self.model[ids[0]]) if ids else took

    def _tokens(self, ids: list[str]) -> list[TokenOut]:
        out = []
        for rid in ids:
            self.produced[rid] += 1
            done = self.produced[rid] >= self.limit[rid]
            out.append(TokenOut(rid, 1, "x", done, "length" if done else None))
        return out


def run_pool(scheduler: Any, costs: Any, instance_ids: list[str], trace: list[Request], plan_log: Any) -> Controller:
    """Drive the controller like the simulator: at each instant arrivals, then completions, then one tick."""
    clock = ManualClock()
    backend = ManualBackend(clock, costs)
    controller = Controller(scheduler, backend, clock, instance_ids, plan_log=plan_log)
    arrivals = deque(sorted(trace, key=lambda r: r.arrival_at))
    while arrivals or backend.next_time() < float("inf"):
        t = min(arrivals[0].arrival_at if arrivals else float("inf"), backend.next_time())
        clock.set(t)
        changed = False
        while arrivals and arrivals[0].arrival_at <= t:
            req = arrivals.popleft()
            sampling = SamplingParams(max_tokens=req.max_output_tokens, ignore_eos=True)
            controller.submit(LiveRequest(req.request_id, req.model, [1] * req.prompt_tokens, sampling, req.arrival_at))
            changed = True
        while backend.next_time() <= t:
            handle, result = backend.pop()
            changed |= controller.complete(handle, result)
        if changed:
            controller.tick()
    return controller
