"""The live controller on a manual clock, with engines replaced by a fake timed like the simulator.

`ManualBackend` obeys the engine protocol's calls and enforces what an engine enforces, through the
instance model the simulator's executor and the engines use (`scheduler.instance`): a prefill or decode
step only of resident models, a decode step only of requests whose KV is on that instance's device, KV
moves and exports only of requests the instance holds, imports only of loaded models. A call it refuses
raises nothing here: its result is the `EngineError`, as a real backend's would be (the controller
writes the instance off), and the refusal is kept in `refused`. It produces placeholder tokens, holds KV
nowhere, and times each call with the same cost model and the same instance model as the simulator, so
a Plan log that differs from the simulator's can only come from the controller/runner path - or from a
Plan an engine would refuse.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import Any

from pool import calls
from pool.calls import EngineCall
from pool.controller import Controller
from pool.engines.base import (EngineError, EngineStats, GenRequest, OutOfKvMemory, SamplingParams, TokenOut,
                               check_admissible, check_new, check_unique)
from pool.runner import LiveRequest
from scheduler import ManualClock, Request
from scheduler.errors import NoKvRoom, RefusedAction
from scheduler.instance import KvPlaces, ModelSlots, decode_turn_s, kv_held_bytes, kv_move_s, prefill_s


class FakeInstance:
    """One instance's engine state: its model slots and where its requests' KV is (at most `kv_bytes` of it
    on the device, when given: the KV the engine reports). With `model_memory_bytes` and `model_bytes` the
    resident models (and the spare) must fit that memory, the rule a real engine's model region enforces
    (`scheduler.instance.ModelSlots`): a co-location past it is refused."""

    def __init__(self, models: Sequence[str] | None, kv_bytes: float | None = None,
                 model_memory_bytes: float | None = None, model_bytes: dict[str, float] | None = None) -> None:
        self.models = None if models is None else set(models)  # loaded models; None: any
        self.slots = ModelSlots(model_memory_bytes, model_bytes)
        self.kv = KvPlaces(kv_bytes)
        self.turn: tuple[float, float] = (0.0, 0.0)  # the decode turn's start and step seconds
        self.num_weight_copies = 0

    def require_loaded(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise RefusedAction(f"model {model!r} is not loaded; loaded: {sorted(self.models)}")


class ManualBackend:
    def __init__(self, clock: ManualClock, costs: Any, models: Sequence[str] | None = None,
                 kv_bytes: dict[str, float] | None = None, kv_bytes_per_token: dict[str, int] | None = None,
                 model_memory_bytes: dict[str, float] | None = None, model_bytes: dict[str, float] | None = None) -> None:
        """`kv_bytes`: each instance's device KV (None: unbounded); a request holds `kv_bytes_per_token` of
        its model for its whole context (prompt + max_tokens), as the simulator counts it.
        `model_memory_bytes`: each instance's memory for model weights, the models' sizes `model_bytes`
        (None: unbounded; `model_memory` gives what an InstanceSpec leaves them)."""
        self.clock = clock
        self.costs = costs
        self.model_names = models
        self.kv_bytes = kv_bytes or {}
        self.model_memory_bytes = model_memory_bytes or {}
        self.model_bytes = model_bytes
        self.kv_bytes_per_token = kv_bytes_per_token or {}
        self.instances: dict[str, FakeInstance] = {}
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0
        self.produced: dict[str, int] = {}  # request -> tokens produced so far
        self.limit: dict[str, int] = {}  # request -> max_tokens (the trace's output length)
        self.model: dict[str, str] = {}
        self.context: dict[str, int] = {}  # prompt tokens
        self.num_calls = 0
        self.refused: list[str] = []  # "instance method: why" of every call refused

    def call(self, instance_id: str, call: EngineCall) -> int:
        self._seq += 1
        self.num_calls += 1
        now = self.clock.now()
        inst = self.instances.get(instance_id) or self.instances.setdefault(
            instance_id, FakeInstance(self.model_names, self.kv_bytes.get(instance_id),
                                      self.model_memory_bytes.get(instance_id), self.model_bytes))
        try:
            at, result = self._run(inst, now, call)
        except RefusedAction as err:  # KV that does not fit: the engine's out-of-KV answer, as a real one's
            self.refused.append(f"{instance_id} {call.name}: {err}")
            error = OutOfKvMemory if isinstance(err, NoKvRoom) else EngineError
            at, result = now, error(f"{instance_id} {call.name}: {err}")
        except EngineError as err:  # the checks every engine makes (pool.engines.base)
            self.refused.append(f"{instance_id} {call.name}: {err}")
            at, result = now, err
        heapq.heappush(self._heap, (at, self._seq, result))
        return self._seq

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def pop(self) -> tuple[int, Any]:
        _, handle, result = heapq.heappop(self._heap)
        return handle, result

    # ---- the engine calls, checked and timed by the instance model ---------------------
    def _run(self, inst: FakeInstance, now: float, call: EngineCall) -> tuple[float, Any]:
        """When the call ends and its result."""
        match call:
            case calls.Activate(model, evict, keep):
                return self._activate(inst, now, model, evict, keep)
            case calls.Prefetch(model, keep):
                return self._prefetch(inst, now, model, keep)
            case calls.Prefill(requests):
                return self._prefill(inst, now, list(requests))
            case calls.DecodeStep(ids, turn_step, max_steps):
                return self._decode_step(inst, now, list(ids), turn_step, max_steps)
            case calls.SaveKv(ids):
                return self._save_kv(inst, now, list(ids))
            case calls.RestoreKv(ids):
                return self._restore_kv(inst, now, list(ids))
            case calls.ExportKv(ids):
                return self._export_kv(inst, now, list(ids))
            case calls.ImportKv(exports):
                return self._import_kv(inst, now, list(exports))
            case calls.Release(ids):
                return self._release(inst, now, list(ids))
        raise EngineError(f"the fake does not take {call!r}")

    def _activate(self, inst: FakeInstance, now: float, model: str, evict: bool = True,
                  keep: tuple[str, ...] | None = None) -> tuple[float, float]:
        inst.require_loaded(model)
        copy, took = inst.slots.switch(model, now, evict, keep)
        if copy:
            took = self.costs.switch_s(model)
            inst.num_weight_copies += 1
        return now + took, took

    def _prefetch(self, inst: FakeInstance, now: float, model: str,
                  keep: tuple[str, ...] | None = None) -> tuple[float, None]:
        inst.require_loaded(model)
        if inst.slots.prefetch(model, now + self.costs.switch_s(model), keep):
            inst.num_weight_copies += 1
        return now, None

    def _prefill(self, inst: FakeInstance, now: float, requests: list[GenRequest]) -> tuple[float, list[TokenOut]]:
        check_new("prefill", [r.request_id for r in requests], inst.kv.on_device)
        for req in requests:
            inst.require_loaded(req.model)
            inst.slots.require_resident(req.model, f"prefill of {req.request_id}")
            check_admissible(req)
        for req in requests:
            inst.kv.place(req.request_id, self._kv_need(req.model, len(req.prompt_token_ids), req.sampling.max_tokens))
            self.model[req.request_id] = req.model
            self.context[req.request_id] = len(req.prompt_token_ids)
            self.produced[req.request_id] = len(req.output_token_ids)
            self.limit[req.request_id] = req.sampling.max_tokens
        took = prefill_s(self.costs, [(r.model, len(r.prompt_token_ids) + len(r.output_token_ids)) for r in requests])
        return now + took, self._tokens(inst, [r.request_id for r in requests])

    def _decode_step(self, inst: FakeInstance, now: float, ids: list[str], turn_step: int,
                     max_steps: int) -> tuple[float, list[TokenOut]]:
        check_unique("decode_step", ids)
        for rid in ids:
            inst.kv.require_on_device(rid, "decode")
            inst.slots.require_resident(self.model[rid], f"decode of {rid}")
        if turn_step == 1:
            steps = min(max_steps, min(self.limit[r] - self.produced[r] for r in ids))
            took = decode_turn_s(self.costs, [(self.model[r], self._ctx(r)) for r in ids], steps)
            inst.turn = (now, took / steps)
        start, step_s = inst.turn
        return start + turn_step * step_s, self._tokens(inst, ids)

    def _save_kv(self, inst: FakeInstance, now: float, ids: list[str]) -> tuple[float, None]:
        inst.kv.move(ids, to_device=False)
        return now + self._move(ids), None

    def _restore_kv(self, inst: FakeInstance, now: float, ids: list[str]) -> tuple[float, None]:
        inst.kv.move(ids, to_device=True)
        return now + self._move(ids), None

    def _export_kv(self, inst: FakeInstance, now: float, ids: list[str]) -> tuple[float, list[str]]:
        check_unique("export_kv", ids)
        on_device = [rid for rid in ids if inst.kv.require(rid)]  # read off the device: a move to the host
        inst.kv.release(ids)
        return now + (self._move(on_device) if on_device else 0.0), list(ids)

    def _import_kv(self, inst: FakeInstance, now: float, exports: list[str]) -> tuple[float, None]:
        check_new("import_kv", exports, inst.kv.on_device)
        for rid in exports:
            inst.require_loaded(self.model[rid])
        for rid in exports:
            inst.kv.admit_to_host(rid, self._kv_need(self.model[rid], self.context[rid], self.limit[rid]))
        return now, None

    def _release(self, inst: FakeInstance, now: float, ids: list[str]) -> tuple[float, None]:
        inst.kv.release(ids)
        return now, None

    def _kv_need(self, model: str, prompt_tokens: int, max_tokens: int) -> float:
        return kv_held_bytes(self.kv_bytes_per_token.get(model, 0), prompt_tokens, max_tokens)

    def _ctx(self, rid: str) -> int:
        return self.context[rid] + self.produced[rid]

    def _move(self, ids: list[str]) -> float:
        return kv_move_s(self.costs, [(self.model[rid], self._ctx(rid)) for rid in ids])

    def _tokens(self, inst: FakeInstance, ids: list[str]) -> list[TokenOut]:
        out = []
        for rid in ids:
            self.produced[rid] += 1
            done = self.produced[rid] >= self.limit[rid]
            if done:  # a finished request leaves the engine, as it does a real one
                inst.kv.release([rid])
            out.append(TokenOut(rid, 1, "x", done, "length" if done else None))
        return out


def model_memory(instances: Sequence[Any]) -> dict[str, float]:
    """Each InstanceSpec's memory for model weights, as the live pool's engines hold it: what its device
    memory leaves beside the KV its engine reports (all of it where the KV takes what the weights leave)."""
    return {i.instance_id: i.memory_bytes - (i.kv_bytes or 0.0) for i in instances}


class FakeEngine:
    """One instance of a `ManualBackend` behind the Engine protocol's calls, each answered at once (a refusal
    raises its EngineError): what the engine conformance suite drives. `sibling()` is another instance of
    the same backend (requests move between them with export_kv / import_kv)."""

    def __init__(self, costs: Any, backend: ManualBackend | None = None, instance_id: str = "fake0") -> None:
        self.backend = backend or ManualBackend(ManualClock(), costs, models=[])
        self.instance_id = instance_id
        self.state = self.backend.instances.setdefault(instance_id, FakeInstance([]))

    def sibling(self, instance_id: str) -> FakeEngine:
        return FakeEngine(self.backend.costs, self.backend, instance_id)

    timings = None

    def _do(self, call: EngineCall) -> Any:
        self.backend.call(self.instance_id, call)
        _, result = self.backend.pop()
        if isinstance(result, BaseException):
            raise result
        return result

    def load(self, model: str, path: Any = None) -> None:
        assert self.state.models is not None
        self.state.models.add(model)

    def models(self) -> list[str]:
        return sorted(self.state.models or ())

    def activate(self, model: str, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        return self._do(calls.Activate(model, evict, keep))

    def prefetch(self, model: str, keep: tuple[str, ...] | None = None) -> None:
        self._do(calls.Prefetch(model, keep))

    def deactivate(self, model: str) -> None:
        self.state.slots.deactivate(model)

    def prefill(self, requests: Sequence[GenRequest]) -> list[TokenOut]:
        return self._do(calls.Prefill(tuple(requests)))

    def decode_step(self, request_ids: Sequence[str]) -> list[TokenOut]:
        return self._do(calls.DecodeStep(tuple(request_ids), turn_step=1, max_steps=1))

    def save_kv(self, request_ids: Sequence[str]) -> None:
        self._do(calls.SaveKv(tuple(request_ids)))

    def restore_kv(self, request_ids: Sequence[str]) -> None:
        self._do(calls.RestoreKv(tuple(request_ids)))

    def release(self, request_ids: Sequence[str]) -> None:
        self._do(calls.Release(tuple(request_ids)))

    def export_kv(self, request_ids: Sequence[str]) -> list[str]:
        return self._do(calls.ExportKv(tuple(request_ids)))

    def import_kv(self, exports: Sequence[str]) -> None:
        self._do(calls.ImportKv(tuple(exports)))

    def warm_up(self, max_tokens: int | None = None) -> int:
        return 0

    def close(self) -> None:
        """Nothing to free."""

    def stats(self) -> EngineStats:
        slots, kv = self.state.slots, self.state.kv
        return EngineStats(device="fake", loaded_models=tuple(self.models()), active_model=slots.active,
                           prefetched_model=slots.spare, resident_models=tuple(sorted(slots.resident)),
                           num_requests=len(kv.on_device), num_weight_copies=self.state.num_weight_copies,
                           extra={"on_device": sum(kv.on_device.values())})


def run_pool(scheduler: Any, costs: Any, instance_ids: list[str], trace: list[Request], plan_log: Any,
             backend: ManualBackend | None = None) -> Controller:
    """Drive the controller like the simulator: at each instant arrivals, then completions, then one tick."""
    clock = backend.clock if backend is not None else ManualClock()
    backend = backend or ManualBackend(clock, costs)
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
