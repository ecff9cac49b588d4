"""The discrete-event simulator: the real Scheduler on a virtual clock.

Event order at one instant is fixed: arrivals, then completions (in the order
they were created), then one `schedule(now)`; the heap key is (time, phase,
sequence). The executor turns each Plan action into future completion events
with the cost model; a Decode turn of n steps is one event computed in closed
form, cut short only by a Stop. Same inputs give a byte-identical Plan log.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Protocol

from scheduler import (Action, Decode, Event, InstanceLost, KvMoved, Prefetch, Prefill, Request, Scheduler, StepDone,
                       Stop, SwapIn, SwapOut, Switch, SwitchDone)
from scheduler.costs import CostModel

ARRIVAL, COMPLETION, FAULT = 0, 1, 2


class SimCosts(CostModel, Protocol):
    def decode_turn_s(self, model: str, batch_size: int, context_tokens: int, num_steps: int) -> float: ...


class InvariantViolation(AssertionError):
    """A Plan asked for something physically impossible (a scheduler bug)."""


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, enough for every latency metric."""

    request_id: str
    model: str
    arrival_at: float
    prompt_tokens: int
    output_tokens: int  # the true length from the trace
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    failed: str = ""
    # (time of the segment's first token, tokens in it, seconds between them)
    segments: list[tuple[float, int, float]] = field(default_factory=list)


@dataclass(slots=True)
class _Turn:
    """An in-flight Decode, kept so a Stop can cut it at a step boundary."""

    start_at: float
    step_s: float
    max_steps: int
    ids: tuple[str, ...]
    seq: int


@dataclass(slots=True)
class _Device:
    model: str | None = None
    resident: set[str] = field(default_factory=set)
    prefetch: tuple[str, float] | None = None  # model, ready_at
    free_at: float = 0.0
    kv: dict[str, float] = field(default_factory=dict)  # request -> device KV bytes
    turn: _Turn | None = None
    busy_s: float = 0.0
    num_switches: int = 0
    switch_s: float = 0.0
    kv_moved_bytes: float = 0.0
    pending: set[int] = field(default_factory=set)  # sequence numbers of its in-flight events


class Simulator:
    def __init__(self, scheduler: Scheduler, costs: SimCosts, requests: Iterable[Request], *,
                 kv_bytes_per_token: dict[str, int], kv_capacity: dict[str, float] | None = None,
                 plan_log: IO[str] | None = None, faults: Iterable[tuple[float, str]] = ()) -> None:
        self.scheduler = scheduler
        self.costs = costs
        self._arrivals = iter(requests)
        self._next_arrival: Request | None = next(self._arrivals, None)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_capacity = kv_capacity
        self.plan_log = plan_log
        self.records: dict[str, RequestRecord] = {}
        self.devices: dict[str, _Device] = {}
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._cancelled_seq: set[int] = set()
        self.now = 0.0
        self.num_plans = 0
        self.num_events = 0
        for at, instance_id in faults:
            self._push(at, FAULT, InstanceLost(instance_id, "injected fault"))

    # ---- the loop ------------------------------------------------------------------
    def run(self, until: float = math.inf, progress: Callable[[float], None] | None = None) -> dict[str, RequestRecord]:
        """Advance to `until` (or the end); `progress(now)` is called every few thousand instants."""
        ticks = 0
        while True:
            t = self._next_time()
            if t is None or t > until:
                break
            self.now = t
            ticks += 1
            if progress is not None and not ticks & 4095:
                progress(t)
            while self._next_arrival is not None and self._next_arrival.arrival_at <= t:
                self._arrive(self._next_arrival, t)
                self._next_arrival = next(self._arrivals, None)
            while self._heap and self._heap[0][0] <= t:
                _, _, seq, event = heapq.heappop(self._heap)
                if seq in self._cancelled_seq:
                    self._cancelled_seq.discard(seq)
                    continue
                self._deliver(event, t, seq)  # type: ignore[arg-type]
            plan = self.scheduler.schedule(t)
            if plan:
                self.num_plans += 1
                if self.plan_log is not None:
                    self.plan_log.write(plan.to_json() + "\n")
                for request_id, why in plan.failed:
                    self.records[request_id].failed = why
                for instance_id, actions in plan.actions.items():
                    self._execute(instance_id, actions, t)
        return self.records

    def _next_time(self) -> float | None:
        times = []
        if self._next_arrival is not None:
            times.append(self._next_arrival.arrival_at)
        while self._heap and self._heap[0][2] in self._cancelled_seq:
            self._cancelled_seq.discard(heapq.heappop(self._heap)[2])
        if self._heap:
            times.append(self._heap[0][0])
        return min(times) if times else None

    def _push(self, at: float, phase: int, event: object) -> int:
        self._seq += 1
        heapq.heappush(self._heap, (at, phase, self._seq, event))
        iid = getattr(event, "instance_id", None)
        if phase == COMPLETION and iid in self.devices:
            self.devices[iid].pending.add(self._seq)
        return self._seq

    def _arrive(self, request: Request, now: float) -> None:
        self.records[request.request_id] = RequestRecord(
            request.request_id, request.model, request.arrival_at, request.prompt_tokens, request.max_output_tokens)
        self.scheduler.submit(request, now)

    def _deliver(self, event: Event, now: float, seq: int) -> None:
        self.num_events += 1
        if isinstance(event, InstanceLost):
            dev = self.devices.pop(event.instance_id, None)
            if dev is not None:
                self._cancelled_seq.update(dev.pending)
        elif event.instance_id in self.devices:  # type: ignore[union-attr]
            dev = self.devices[event.instance_id]  # type: ignore[union-attr]
            dev.pending.discard(seq)
            if isinstance(event, StepDone):
                self._book(event, dev, now)
        self.scheduler.on_event(event, now)

    def _book(self, event: StepDone, dev: _Device, now: float) -> None:
        """Tokens become real when their step's completion is delivered."""
        step_s = 0.0
        if event.kind == "decode":
            assert dev.turn is not None
            step_s, dev.turn = dev.turn.step_s, None
        first_at = now - (event.num_steps - 1) * step_s
        for rid in event.request_ids:
            record = self.records[rid]
            record.generated += event.num_steps
            record.segments.append((first_at, event.num_steps, step_s))
            if record.first_token_at is None:
                record.first_token_at = first_at
            if rid in event.finished_ids:
                record.finished_at = now

    def device(self, instance_id: str) -> _Device:
        dev = self.devices.get(instance_id)
        if dev is None:
            dev = self.devices[instance_id] = _Device()
        return dev

    # ---- the executor -----------------------------------------------------------------
    def _execute(self, instance_id: str, actions: tuple[Action, ...], now: float) -> None:
        dev = self.device(instance_id)
        if len(actions) == 1 and isinstance(actions[0], Stop):
            self._stop(instance_id, dev, now)
            return
        t = max(now, dev.free_at)
        start = t
        for action in actions:
            t = self._apply(instance_id, dev, action, t)
        dev.busy_s += t - start
        dev.free_at = t

    def _apply(self, iid: str, dev: _Device, action: Action, t: float) -> float:
        if isinstance(action, Switch):
            took = self._switch_time(dev, action.model, t)
            if action.evict:
                dev.resident = {action.model}
            else:
                dev.resident.add(action.model)
            dev.model = action.model
            dev.num_switches += 1
            dev.switch_s += took
            self._push(t + took, COMPLETION, SwitchDone(iid, action.model))
            return t + took
        if isinstance(action, Prefetch):
            dev.prefetch = (action.model, t + self.costs.switch_s(action.model))
            return t
        if isinstance(action, Prefill):
            return self._prefill(iid, dev, action, t)
        if isinstance(action, Decode):
            return self._decode(iid, dev, action, t)
        if isinstance(action, (SwapOut, SwapIn)):
            took = 0.0
            for rid in action.request_ids:
                record = self.records[rid]
                # a Decode earlier in this same plan adds its tokens before the move happens
                ahead = dev.turn.max_steps if dev.turn is not None and rid in dev.turn.ids else 0
                took += self.costs.kv_move_s(record.model, record.prompt_tokens + record.generated + ahead)
                if isinstance(action, SwapOut):
                    dev.kv_moved_bytes += dev.kv.pop(rid, 0.0)
                else:
                    dev.kv[rid] = self._kv_bytes(record)
                    dev.kv_moved_bytes += dev.kv[rid]
            self._check_kv(iid, dev)
            to = "host" if isinstance(action, SwapOut) else "device"
            self._push(t + took, COMPLETION, KvMoved(iid, action.request_ids, to))  # type: ignore[arg-type]
            return t + took
        raise InvariantViolation(f"{iid}: cannot execute {action!r}")

    def _switch_time(self, dev: _Device, model: str, t: float) -> float:
        prefetched, dev.prefetch = dev.prefetch, None  # any other model in the spare slot is overwritten
        if prefetched is not None and prefetched[0] == model:
            return max(0.0, prefetched[1] - t)
        return self.costs.switch_s(model)

    def _prefill(self, iid: str, dev: _Device, action: Prefill, t: float) -> float:
        records = [self.records[rid] for rid in action.request_ids]
        for record in records:
            if record.model not in dev.resident:
                raise InvariantViolation(f"{iid}: prefill of {record.request_id} ({record.model}) while "
                                         f"{sorted(dev.resident)} resident")
        took = 0.0
        for model in {r.model for r in records}:
            group = [r for r in records if r.model == model]
            took += self.costs.prefill_s(model, sum(r.prompt_tokens + r.generated for r in group), len(group))
        end = t + took
        finished = []
        for record in records:
            if record.generated + 1 >= record.output_tokens:
                finished.append(record.request_id)
            elif not action.kv_to_host:
                dev.kv[record.request_id] = self._kv_bytes(record)
        self._check_kv(iid, dev)
        self._push(end, COMPLETION, StepDone(iid, "prefill", action.request_ids, 1, tuple(finished)))
        return end

    def _decode(self, iid: str, dev: _Device, action: Decode, t: float) -> float:
        records = [self.records[rid] for rid in action.request_ids]
        for record in records:
            if record.model not in dev.resident or record.request_id not in dev.kv:
                raise InvariantViolation(f"{iid}: decode of {record.request_id} ({record.model}) with "
                                         f"{sorted(dev.resident)} resident, KV on device: {record.request_id in dev.kv}")
        steps = min(action.max_steps, min(r.output_tokens - r.generated for r in records))
        took = self._turn_time(records, steps)
        dev.turn = _Turn(t, took / steps, steps, action.request_ids, -1)
        return self._finish_turn(iid, dev, steps)

    def _turn_time(self, records: list[RequestRecord], steps: int) -> float:
        took = 0.0
        for model in {r.model for r in records}:
            group = [r for r in records if r.model == model]
            context = sum(r.prompt_tokens + r.generated for r in group)
            took += self.costs.decode_turn_s(model, len(group), context, steps)
        return took

    def _finish_turn(self, iid: str, dev: _Device, steps: int) -> float:
        turn = dev.turn
        assert turn is not None
        end = turn.start_at + steps * turn.step_s
        finished = []
        for rid in turn.ids:
            record = self.records[rid]
            if record.generated + steps >= record.output_tokens:
                finished.append(rid)
                dev.kv.pop(rid, None)
        turn.seq = self._push(end, COMPLETION, StepDone(iid, "decode", turn.ids, steps, tuple(finished)))
        turn.max_steps = steps
        return end

    def _stop(self, iid: str, dev: _Device, now: float) -> None:
        """Cut the in-flight turn at the first step boundary after `now`."""
        turn = dev.turn
        if turn is None:
            return
        done = min(turn.max_steps, max(0, int((now - turn.start_at) / turn.step_s)) + 1)
        if done >= turn.max_steps:
            return  # it ends at that boundary anyway
        self._cancelled_seq.add(turn.seq)
        dev.pending.discard(turn.seq)
        for rid in turn.ids:  # requests that would have finished keep their KV until they do
            record = self.records[rid]
            if record.generated + turn.max_steps >= record.output_tokens:
                dev.kv[rid] = self._kv_bytes(record)
        dev.busy_s -= (turn.max_steps - done) * turn.step_s
        dev.free_at = self._finish_turn(iid, dev, done)

    # ---- checks ------------------------------------------------------------------
    def _kv_bytes(self, record: RequestRecord) -> float:
        return float(self.kv_bytes_per_token[record.model] * (record.prompt_tokens + record.output_tokens))

    def _check_kv(self, iid: str, dev: _Device) -> None:
        if self.kv_capacity is None:
            return
        used = sum(dev.kv.values())
        if used > self.kv_capacity[iid] * (1 + 1e-9):
            raise InvariantViolation(f"{iid}: {used / 1e9:.3f} GB of KV on a device that holds "
                                     f"{self.kv_capacity[iid] / 1e9:.3f} GB")
