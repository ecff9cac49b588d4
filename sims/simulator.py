"""The discrete-event simulator: the real Scheduler on a virtual clock.

Event order at one instant is fixed: arrivals, then completions (in the order
they were created), then one `schedule(now)`; the heap key is (time, phase,
sequence). The executor turns each Plan action into future completion events
with the cost model; a Decode turn of n steps is one event computed in closed
form, cut short only by a Stop. A Decode with `prefill_chunks` is one
Sarathi-style mixed iteration: the cost model's mixed_iteration_s (per model, the
mixed_step_s of its decode step and its chunks, the weights read once). Same inputs give a byte-identical Plan log.

The loop runs tens of times per request (every decode turn a request joins is
an event), so its per-event work is kept small: a heap entry carries the
device and the records its event books (no id lookups on delivery), the
requests of one event share one segment tuple, nobody finishes in a turn
shorter than its batch's shortest remainder (no per-request check then), and
a lost device's pending events are dropped by its flag.

Copies (switches, prefetches, KV moves) take the cost model's times; when the
cost model shares host links (`SimCosts.host_links`), the executor asks the
links when each copy ends instead (`links`), so overlapping copies slow each
other. Without shared links (the default) nothing else changes. Likewise, where instances share a GPU
(`SimCosts.gpu_shares`), the executor asks it when each prefill, decode turn and mixed iteration ends
(`gpus`), so device work that overlaps on one GPU slows down; a Stop tells it the turn's new end.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO, Final

from scheduler import (Action, Decode, Event, InstanceLost, KvMoved, Plan, Prefetch, Prefill, Request, Scheduler,
                       StepDone, Stop, SwapIn, SwapOut, Switch, SwitchDone)
from scheduler.errors import RefusedAction
from scheduler.instance import ModelSlots, kv_fits, kv_held_bytes, kv_move_s, prefill_s, resident_after
from scheduler.policies.base import PolicyBase
from sims.costmodel import CopyLinks, GpuShares, SimCosts, kv_device_move_s
from sims.errors import InvariantViolation

# heap phases at one instant, in order; arrivals come from the trace before either (Final: C constants when compiled)
COMPLETION: Final = 1
FAULT: Final = 2
# (first token time, tokens, seconds between them). Typed as a variable-length tuple on purpose: compiled, a
# fixed-length one is an unboxed C struct, boxed anew (tuple and floats) into every record's list, while the
# requests of one step should share one tuple.
Segment = tuple[float, ...]
_NEVER: Final = 1 << 62  # the shortest remainder of an empty batch
_INF: Final = math.inf


@dataclass(slots=True, init=False)
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
    # (time of the segment's first token, tokens in it, seconds between them); the
    # requests of one step share the tuple
    segments: list[Segment] = field(default_factory=list)

    def __init__(self, request_id: str, model: str, arrival_at: float, prompt_tokens: int, output_tokens: int,
                 generated: int = 0, first_token_at: float | None = None, finished_at: float | None = None,
                 failed: str = "", segments: list[Segment] | None = None) -> None:
        self.request_id, self.model, self.arrival_at = request_id, model, arrival_at
        self.prompt_tokens, self.output_tokens, self.generated = prompt_tokens, output_tokens, generated
        self.first_token_at, self.finished_at, self.failed = first_token_at, finished_at, failed
        self.segments = [] if segments is None else segments


class _Group:
    """One model's part of a decode batch: how many requests, how many KV context tokens they hold."""

    __slots__ = ("model", "size", "context")

    def __init__(self, model: str) -> None:
        self.model, self.size, self.context = model, 0, 0


@dataclass(slots=True, init=False)
class _Batch:
    """A device's decode batch with its per-model sizes and KV contexts and its shortest remainder,
    reused while the scheduler passes the very same ids tuple again (a continuous batch that did not
    change) and kept current as its tokens are booked, so an unchanged batch costs O(1) to plan."""

    ids: tuple[str, ...]
    records: list[RequestRecord]
    groups: list[_Group]  # per model, in order of first appearance
    left: int  # tokens until its first request finishes

    def __init__(self, ids: tuple[str, ...], records: list[RequestRecord], groups: list[_Group], left: int) -> None:
        self.ids, self.records, self.groups, self.left = ids, records, groups, left


@dataclass(slots=True, init=False)
class _Turn:
    """An in-flight Decode, kept so a Stop can cut it at a step boundary."""

    start_at: float
    step_s: float
    max_steps: int
    ids: tuple[str, ...]
    seq: int
    records: list[RequestRecord]
    batch: _Batch | None = None  # its decoding part, when that is the device's cached batch

    def __init__(self, start_at: float, step_s: float, max_steps: int, ids: tuple[str, ...], seq: int,
                 records: list[RequestRecord], batch: _Batch | None = None) -> None:
        self.start_at, self.step_s, self.max_steps, self.ids, self.seq = start_at, step_s, max_steps, ids, seq
        self.records, self.batch = records, batch


@dataclass(slots=True)
class _Device:
    slots: ModelSlots = field(default_factory=ModelSlots)  # resident models and the spare slot (scheduler.instance)
    free_at: float = 0.0
    kv: dict[str, float] = field(default_factory=dict)  # request -> device KV bytes
    turn: _Turn | None = None
    busy_s: float = 0.0
    num_switches: int = 0  # Switch actions (a change of the model computed with; free where it is held)
    num_model_switches: int = 0  # plans that changed the models it computes with (scheduler.instance.resident_after)
    num_weight_copies: int = 0  # models' weights copied onto it (scheduler.instance.ModelSlots: switch or prefetch)
    copied: set[str] = field(default_factory=set)  # models copied onto it at least once (a live pool's warm-up
    # makes each one's first copy: the copies past those are num_weight_copies - len(copied))
    switch_s: float = 0.0
    switch_s_by_model: dict[str, list[float]] = field(default_factory=dict)  # each switch's wait, by model
    kv_moved_bytes: float = 0.0
    decode_steps: int = 0  # decode iterations delivered (a turn of n steps counts n), and their seconds
    decode_s: float = 0.0
    decode_by_shape: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (model, batch) -> steps, s
    prefill_s: float = 0.0  # prefills (and their kv_to_host moves), as the live engine's prefill calls
    kv_s: float = 0.0  # SwapIn / SwapOut moves, as the live engine's KV calls (export, import, save, restore)
    prompt_left: dict[str, int] = field(default_factory=dict)  # chunked prefill: tokens still to compute
    batch: _Batch | None = None  # the last decode batch; dropped by any other action on the device
    lost: bool = False  # its pending events are dropped
    prefill_move_s: float = 0.0  # the KV move that ends the prefill in flight (kv_to_host)
    # the decode step its last turn left queued on the device (costs.decode_ahead): for these requests, running
    # until ahead_end; a Decode of exactly them next takes it, anything else waits for it
    ahead_ids: tuple[str, ...] | None = None
    ahead_end: float = 0.0
    ahead_discarded: int = 0  # such steps its next work waited for (a live engine's decode_steps_discarded)
    ready_at: float = 0.0  # its next work starts no sooner: the decode steps other instances' calls discarded


class _Entry:
    """A heap entry, ordered by (at, phase, seq), with the device and the records its event books (or None).
    A class rather than a tuple: compiled, heapq's comparisons call a native __lt__ on two floats, where a
    tuple's went through generic element compares (a few hundred instructions each, ~6% of the loop)."""

    __slots__ = ("at", "phase", "seq", "event", "dev", "records")

    def __init__(self, at: float, phase: int, seq: int, event: Event, dev: _Device | None,
                 records: list[RequestRecord] | None) -> None:
        self.at, self.phase, self.seq, self.event, self.dev, self.records = at, phase, seq, event, dev, records

    def __lt__(self, other: _Entry) -> bool:
        if self.at != other.at:
            return self.at < other.at
        if self.phase != other.phase:
            return self.phase < other.phase
        return self.seq < other.seq


class Simulator:
    def __init__(self, scheduler: Scheduler, costs: SimCosts, requests: Iterable[Request], *,
                 kv_bytes_per_token: dict[str, int], kv_capacity: dict[str, float] | None = None,
                 plan_log: IO[str] | None = None, faults: Iterable[tuple[float, str]] = (),
                 links: CopyLinks | None = None, gpus: GpuShares | None = None,
                 staging: Collection[str] = (), weight_capacity: Mapping[str, float] | None = None,
                 weight_bytes: Mapping[str, float] | None = None,
                 weight_regions: Mapping[str, int] | None = None) -> None:
        self.scheduler = scheduler
        # per instance, the bytes its model weights may take (a policy's planned budget, PolicyBase.weight_budget),
        # and each model's: a Switch or Prefetch whose models do not fit is an invariant violation
        self.weight_capacity, self.weight_bytes = weight_capacity, weight_bytes
        # the same object when it is one of our policies: compiled, calls through this typed reference are native
        # (through the Protocol they are generic method calls, with their arguments boxed and parsed)
        self._policy: PolicyBase | None = scheduler if isinstance(scheduler, PolicyBase) else None
        self.costs = costs
        self.links = links  # shared host links (costs.host_links), or None: every copy at its time alone
        self.gpus = gpus  # shared GPUs (costs.gpu_shares), or None: every instance's steps at their time alone
        self.staging = frozenset(staging)  # instances that hand off through device memory (staging_instances)
        # instances whose engines map one weights region per GPU (pool.engines.shared_weights: every model once
        # per device) -> its key: a model one of them copied in is on the device for all of them (no copy of their
        # own; what is left of that copy, if it is still under way); per region, each model's copy's end
        self.weight_regions = dict(weight_regions or {})
        self._region_ready: dict[int, dict[str, float]] = {}
        # a live pool's way in and out (cost model terms; 0 unless a profile measured them): each request reaches
        # the scheduler admit_s after its arrival, each token its client deliver_s after its step, and a request's
        # first and last tokens prompt_token_s per prompt token later still (the gateway parsing the prompt before
        # the live pool has it: a fraction of a millisecond, charged on the client's times rather than on the
        # admission, so the scheduler sees requests in arrival order)
        self.admit_s, self.deliver_s = costs.request_admit_s(), costs.token_deliver_s()
        self.prompt_token_s = costs.request_prompt_token_s()
        self.kv_call_host_s = costs.kv_call_host_s()
        self.decode_ahead = costs.decode_ahead()
        # requests whose KV another instance's SwapIn takes from where a SwapOut left it: that instance, and whether
        # it staged the KV in its device memory (else its host memory), until the SwapIn
        self._kv_home: dict[str, tuple[str, bool]] = {}
        self._arrivals = iter(requests)
        self._next_arrival: Request | None = next(self._arrivals, None)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_capacity = kv_capacity
        self.plan_log = plan_log
        self.reuse_batches = True  # the _Batch cache (a test turns it off to check it changes nothing)
        self.records: dict[str, RequestRecord] = {}
        self.devices: dict[str, _Device] = {}
        self._heap: list[_Entry] = []
        self._heappush = heapq.heappush  # bound once: a module attribute read per push costs a lookup
        self._seq = 0
        self._cancelled_seq: set[int] = set()
        self.now = 0.0
        self.num_plans = 0
        self.num_events = 0
        self.num_decode_steps = 0  # decode iterations delivered (a turn of n steps counts n)
        for at, instance_id in faults:
            self._push(at, FAULT, InstanceLost(instance_id, "injected fault"))

    # ---- the loop ------------------------------------------------------------------
    def run(self, until: float = math.inf, progress: Callable[[float], None] | None = None) -> dict[str, RequestRecord]:
        """Advance to `until` (or the end); `progress(now)` is called every few thousand instants."""
        heap, pop, cancelled, scheduler, policy = self._heap, heapq.heappop, self._cancelled_seq, self.scheduler, \
            self._policy
        arrivals, incoming, admit = self._arrivals, self._next_arrival, self.admit_s
        ticks = 0
        # The loop makes millions of acyclic objects (events, actions, tuples, records); the cyclic collector's
        # passes over the growing records find nothing to free (tested), so they are skipped while it runs.
        collecting = gc.isenabled()
        gc.disable()
        try:
            while True:
                while cancelled and heap and heap[0].seq in cancelled:
                    cancelled.discard(pop(heap).seq)
                t = incoming.arrival_at + admit if incoming is not None else _INF
                if heap:
                    first = heap[0].at
                    if first < t:
                        t = first
                if t == _INF or t > until:
                    break
                self.now = t
                ticks += 1
                if progress is not None and not ticks & 4095:
                    progress(t)
                while incoming is not None and incoming.arrival_at + admit <= t:
                    self._arrive(incoming, t)
                    incoming = next(arrivals, None)
                while heap:
                    at = heap[0].at
                    if at > t:
                        break
                    entry = pop(heap)
                    dev = entry.dev
                    if dev is not None and dev.lost:
                        continue
                    if cancelled and entry.seq in cancelled:
                        cancelled.discard(entry.seq)
                        continue
                    self._deliver(entry.event, t, dev, entry.records)
                plan = policy.schedule(t) if policy is not None else scheduler.schedule(t)
                if plan.actions or plan.failed:
                    self._carry_out(plan, t)
        finally:
            self._next_arrival = incoming
            if collecting:
                gc.enable()
        return self.records

    def _carry_out(self, plan: Plan, now: float) -> None:
        self.num_plans += 1
        if self.plan_log is not None:
            self.plan_log.write(plan.to_json() + "\n")
        for request_id, why in plan.failed:
            self.records[request_id].failed = why
        for instance_id, actions in plan.actions.items():
            self._execute(instance_id, actions, now)

    def _push(self, at: float, phase: int, event: Event, dev: _Device | None = None,
              records: list[RequestRecord] | None = None) -> int:
        self._seq += 1
        self._heappush(self._heap, _Entry(at, phase, self._seq, event, dev, records))
        return self._seq

    def _arrive(self, request: Request, now: float) -> None:
        self.records[request.request_id] = RequestRecord(
            request.request_id, request.model, request.arrival_at, request.prompt_tokens, request.max_output_tokens)
        if self.admit_s:  # the scheduler stamps it when it gets it, as the live pool's does
            request.arrival_at = now
        if self._policy is not None:
            self._policy.submit(request, now)
        else:
            self.scheduler.submit(request, now)

    def _deliver(self, event: Event, now: float, dev: _Device | None, records: list[RequestRecord] | None) -> None:
        self.num_events += 1
        if records is not None:
            self._book(event, dev, records, now)  # type: ignore[arg-type]
        elif dev is None and type(event) is InstanceLost:
            lost = self.devices.pop(event.instance_id, None)
            if lost is not None:
                lost.lost = True
        if self._policy is not None:
            self._policy.on_event(event, now)
        else:
            self.scheduler.on_event(event, now)

    def _book(self, event: StepDone, dev: _Device, records: list[RequestRecord], now: float) -> None:
        """Tokens become real when their step's completion is delivered."""
        num_steps, step_s, batch, token_at = event.num_steps, 0.0, None, now
        if event.kind == "decode":
            turn = dev.turn
            assert turn is not None
            step_s, dev.turn = turn.step_s, None
            self.num_decode_steps += num_steps
            dev.decode_steps += num_steps
            dev.decode_s += num_steps * step_s
            if records:
                shape = dev.decode_by_shape.setdefault((records[0].model, len(records)), [0, 0.0])
                shape[0] += num_steps
                shape[1] += num_steps * step_s
            batch = turn.batch
            # a batch member has had its first token (its prefill, or the chunk that completed it,
            # was booked before): only requests past the batch can be getting theirs
            tail = records[len(batch.records):] if batch is not None else records
            if batch is not None and batch is dev.batch:
                batch.left -= num_steps
                for group in batch.groups:
                    group.context += num_steps * group.size
            else:
                batch = None
        else:
            tail = records
            token_at = now - dev.prefill_move_s  # with kv_to_host the token streamed before the KV move
        first_at = token_at - (num_steps - 1) * step_s
        segment: Segment = (first_at, num_steps, step_s)  # one object, shared by the step's requests
        for record in records:
            record.generated += num_steps
            record.segments.append(segment)
        for record in tail:
            if record.first_token_at is None:
                record.first_token_at = first_at + self.deliver_s + self.prompt_token_s * record.prompt_tokens
        if event.finished_ids:
            for rid in event.finished_ids:
                done = self.records[rid]
                done.finished_at = now + self.deliver_s + self.prompt_token_s * done.prompt_tokens
            if batch is not None:
                self._shrink(batch, event.finished_ids)

    @staticmethod
    def _shrink(batch: _Batch, finished: tuple[str, ...]) -> None:
        """Drop requests that just finished (and were just booked) from a cached batch."""
        ids = batch.ids
        places = [ids.index(rid) for rid in finished if rid in ids]
        if len(places) > 1:
            places.sort(reverse=True)
        if not places:
            return
        records, kept = list(batch.records), list(ids)
        for place in places:
            record = records.pop(place)
            del kept[place]
            for entry in batch.groups:
                if entry.model == record.model:
                    break
            entry.size -= 1
            entry.context -= record.prompt_tokens + record.generated
        batch.records, batch.ids = records, tuple(kept)
        batch.groups = [g for g in batch.groups if g.size]
        batch.left = _fewest_left(records)

    def device(self, instance_id: str) -> _Device:
        dev = self.devices.get(instance_id)
        if dev is None:
            dev = self.devices[instance_id] = _Device()
            if self.weight_capacity is not None and instance_id in self.weight_capacity:
                dev.slots = ModelSlots(self.weight_capacity[instance_id], self.weight_bytes)
        return dev

    # ---- the executor -----------------------------------------------------------------
    def _execute(self, instance_id: str, actions: tuple[Action, ...], now: float) -> None:
        dev = self.devices.get(instance_id) or self.device(instance_id)
        if len(actions) == 1 and type(actions[0]) is Stop:
            self._stop(instance_id, dev, now)
            return
        t = start = max(now, dev.free_at, dev.ready_at)
        before = frozenset(dev.slots.resident)
        dev.num_model_switches += resident_after(before, actions) != before
        for action in actions:
            if dev.ahead_ids is not None:  # every engine call but a decode of exactly those requests discards it
                if not (type(action) is Decode and not action.prefill_chunks and action.request_ids == dev.ahead_ids):
                    t = max(t, dev.ahead_end)  # discarded, but the device runs it first
                    dev.ahead_discarded += 1
                dev.ahead_ids = None
            if isinstance(action, Decode):
                t = self._decode(instance_id, dev, action, t)
                continue
            if isinstance(action, Prefetch):
                t = self._prefetch(instance_id, dev, action, t)
                continue
            dev.batch = None  # weights or KV placement change: the next batch is checked afresh
            if isinstance(action, Switch):
                t = self._switch(instance_id, dev, action, t)
            elif isinstance(action, (SwapOut, SwapIn)):
                t = self._swap(instance_id, dev, action, t)
            elif isinstance(action, Prefill):
                t = self._prefill(instance_id, dev, action, t)
            else:
                raise InvariantViolation(f"{instance_id}: cannot execute {action!r}")
        dev.busy_s += t - start
        dev.free_at = t

    def _switch(self, iid: str, dev: _Device, action: Switch, t: float) -> float:
        """The instance model's switch (scheduler.instance): a resident model costs nothing, the spare what is
        left of its copy, any other a whole copy (on the shared host link, when links are shared)."""
        try:
            copy, took = dev.slots.switch(action.model, t, action.evict, action.keep)
        except RefusedAction as err:
            raise InvariantViolation(f"{iid}: {err}") from None
        region = self._region(iid)
        if copy and region is not None and action.model in region:
            copy, took = False, max(0.0, region[action.model] - t)  # on the device already: another engine's copy
        if copy:
            self._count_copy(dev, action.model)
            took = self.costs.switch_s(action.model)
            if self.links is not None:
                took = self.links.copy_end_at(iid, True, t, took, self.now) - t
            if region is not None:
                region[action.model] = t + took
        dev.num_switches += 1
        dev.switch_s += took
        dev.switch_s_by_model.setdefault(action.model, []).append(took)
        self._push(t + took, COMPLETION, SwitchDone(iid, action.model), dev)
        return t + took

    @staticmethod
    def _count_copy(dev: _Device, model: str) -> None:
        dev.num_weight_copies += 1
        dev.copied.add(model)

    def _prefetch(self, iid: str, dev: _Device, action: Prefetch, t: float) -> float:
        try:
            copying = dev.slots.prefetch(action.model, t, action.keep)  # else resident or cached already
        except RefusedAction as err:
            raise InvariantViolation(f"{iid}: {err}") from None
        if not copying:
            return t
        region = self._region(iid)
        if region is not None and action.model in region:
            dev.slots.set_ready(action.model, max(t, region[action.model]))
            return t
        self._count_copy(dev, action.model)
        ready = self._copy_end(iid, True, t, self.costs.switch_s(action.model))
        dev.slots.set_ready(action.model, ready)
        if region is not None:
            region[action.model] = ready
        return t

    def _region(self, iid: str) -> dict[str, float] | None:
        """The models in `iid`'s shared weights region and when each one's copy ends (None: it has none)."""
        key = self.weight_regions.get(iid)
        return None if key is None else self._region_ready.setdefault(key, {})

    def _swap(self, iid: str, dev: _Device, action: SwapOut | SwapIn, t: float) -> float:
        out, started = type(action) is SwapOut, t
        turn = dev.turn  # a Decode earlier in this same plan adds its tokens before the move happens
        moves: list[tuple[str, int]] = []
        # a staging instance's SwapOut, and the SwapIn of what it staged, copy within the GPU (off the host link):
        # the engine imports those first, then copies the rest in (two moves)
        staged: list[tuple[str, int]] = []
        stages = out and iid in self.staging
        homes: dict[str, bool] = {}  # the other instances this SwapIn takes KV from, and whether any was staged there
        for rid in action.request_ids:
            record = self.records[rid]
            ahead = turn.max_steps if turn is not None and rid in turn.ids else 0
            move = (record.model, record.prompt_tokens + record.generated + ahead)
            if out:
                dev.kv_moved_bytes += dev.kv.pop(rid, 0.0)
                self._kv_home[rid] = (iid, stages)
                on_device = stages
            else:
                dev.kv[rid] = self._kv_bytes(record)
                dev.kv_moved_bytes += dev.kv[rid]
                home, on_device = self._kv_home.pop(rid, (iid, False))
                if home != iid:
                    homes[home] = homes.get(home, False) or on_device
            (staged if on_device else moves).append(move)
        self._check_kv(iid, dev)
        t += kv_device_move_s(self.costs, staged)
        end = self._copy_end(iid, not out, t, kv_move_s(self.costs, moves)) if moves else t  # one move each
        end += self.kv_call_host_s  # the live pool's calls and ticks around the move (host time, no link)
        if self.decode_ahead:
            for home, was_staged in homes.items():  # pool/runner.py: export_kv there first; a release after the
                self._call_between(home, started)  # import where the KV was staged in its device memory
                if was_staged:
                    self._call_between(home, end)
        self._push(end, COMPLETION, KvMoved(iid, action.request_ids, "host" if out else "device"), dev)
        dev.kv_s += end - started
        return end

    def _copy_end(self, iid: str, to_device: bool, t: float, alone_s: float) -> float:
        """When a copy of `alone_s` seconds alone that starts at `t` ends (later, on a shared host link)."""
        if self.links is None:
            return t + alone_s
        return self.links.copy_end_at(iid, to_device, t, alone_s, self.now)

    def _prefill(self, iid: str, dev: _Device, action: Prefill, t: float) -> float:
        records = [self.records[rid] for rid in action.request_ids]
        resident = dev.slots.resident
        for record in records:
            if record.model not in resident:
                raise InvariantViolation(f"{iid}: prefill of {record.request_id} ({record.model}) while "
                                         f"{sorted(resident)} resident")
        prompts = [(r.model, r.prompt_tokens + r.generated) for r in records]
        took = prefill_s(self.costs, prompts)
        finished = []
        moves: list[tuple[str, int]] = []  # kv_to_host: the KV of prompt and first token goes to host memory
        for record in records:  # before the step is done
            if record.generated + 1 >= record.output_tokens:
                finished.append(record.request_id)
            elif action.kv_to_host:
                moves.append((record.model, record.prompt_tokens + record.generated + 1))
            else:
                dev.kv[record.request_id] = self._kv_bytes(record)
        move_s = kv_move_s(self.costs, moves)
        self._check_kv(iid, dev)
        if self.gpus is not None:  # the host's part after the GPU's does not share it
            host_s = sum(self.costs.call_host_s(model, len(group)) for model, group in _by_model(records).items())
            took = (self.gpus.work_end_at(iid, t, took - host_s, self.now, "prefill", [m for m, _ in prompts],
                                          sum(n for _, n in prompts)) - t + host_s)
        if move_s and self.links is not None:
            move_s = self.links.copy_end_at(iid, False, t + took, move_s, self.now) - (t + took)
        move_s += self.kv_call_host_s if moves else 0.0  # the save_kv call after the prefill's, as in _swap
        end = t + took + move_s
        dev.prefill_move_s = move_s
        dev.prefill_s += took + move_s
        self._push(end, COMPLETION, StepDone(iid, "prefill", action.request_ids, 1, tuple(finished)), dev, records)
        return end

    def _decode(self, iid: str, dev: _Device, action: Decode, t: float) -> float:
        if action.prefill_chunks:
            return self._iteration(iid, dev, action, t)
        if not action.request_ids:
            raise InvariantViolation(f"{iid}: a Decode of no requests")
        batch = self._batch(iid, dev, action.request_ids)
        steps = min(action.max_steps, batch.left)
        took = 0.0
        for group in batch.groups:
            took += self.costs.decode_turn_s(group.model, group.size, group.context, steps)
        if self.gpus is not None:
            took = self.gpus.work_end_at(iid, t, took, self.now, "decode", [g.model for g in batch.groups]) - t
        dev.turn = _Turn(t, took / steps, steps, batch.ids, -1, batch.records, batch)
        end = self._finish_turn(iid, dev, steps, steps == batch.left)
        if self.decode_ahead:
            self._queue_ahead(dev, steps, end)
        return end

    def _queue_ahead(self, dev: _Device, steps: int, end: float) -> None:
        """The step an engine that decodes ahead (costs.decode_ahead) queues after the turn's last one (of `steps`,
        ending at `end`), for the requests that go on past it: it runs on the device from the last step's device
        work's end (the host's part of that step after it) for a step's device time; the turn's step time less its
        host part."""
        turn = dev.turn
        assert turn is not None and turn.batch is not None
        going = tuple(r.request_id for r in turn.records if r.generated + steps < r.output_tokens)
        if not going:
            dev.ahead_ids = None
            return
        host = self._step_host_s(turn.batch)
        dev.ahead_ids, dev.ahead_end = going, end - host + max(0.0, turn.step_s - host)

    def _step_host_s(self, batch: _Batch) -> float:
        """The host part of one decode step of `batch`: an engine call per model group, over its rows."""
        return sum(self.costs.call_host_s(group.model, group.size) for group in batch.groups)

    def _call_between(self, iid: str, at: float) -> None:
        """An engine call that another instance's SwapIn makes on `iid` at `at`, between `iid`'s own calls (the
        export of KV that `iid` holds, its release): it discards the decode step `iid`'s engine queued ahead, if
        any, and the device runs that step first. Mid-turn (every step queues the next) the rest of the turn, and
        so `iid`'s next work, comes one step's device time later; after a turn, its queued step is lost even to
        a Decode that continues it."""
        dev = self.devices.get(iid)
        if dev is None:
            return
        turn = dev.turn
        turn_end = turn.start_at + turn.max_steps * turn.step_s if turn is not None else at
        if turn is not None and turn.batch is not None and at < turn_end:
            step_device_s = max(0.0, turn.step_s - self._step_host_s(turn.batch))
            dev.ready_at = max(dev.ready_at, turn_end) + step_device_s
            if dev.ahead_ids is not None:
                dev.ahead_end += step_device_s
            dev.ahead_discarded += 1
        elif dev.ahead_ids is not None:
            dev.ready_at = max(dev.ready_at, dev.ahead_end)
            dev.ahead_ids = None
            dev.ahead_discarded += 1

    def _batch(self, iid: str, dev: _Device, ids: tuple[str, ...]) -> _Batch:
        """The device's batch for `ids`: its cached one when `ids` is that batch (or that batch plus
        requests that joined at its end) and its last turn is booked; else a new one. Requests new to
        the batch are checked: their model resident and their KV on the device."""
        batch = dev.batch
        if batch is not None and dev.turn is None and self.reuse_batches:
            if ids is batch.ids or ids == batch.ids:
                return batch
            known = len(batch.ids)
            if len(ids) > known and ids[:known] == batch.ids:
                joined = self._checked(iid, dev, ids[known:])
                batch.ids, batch.records = ids, batch.records + joined
                _add_groups(batch.groups, joined)
                batch.left = min(batch.left, _fewest_left(joined))
                return batch
        records = self._checked(iid, dev, ids)
        groups: list[_Group] = []
        _add_groups(groups, records)
        batch = _Batch(ids, records, groups, _fewest_left(records))
        if dev.turn is None:
            dev.batch = batch
        return batch

    def _checked(self, iid: str, dev: _Device, ids: tuple[str, ...]) -> list[RequestRecord]:
        """The records of `ids`, after checking each one's model is resident and its KV on the device."""
        table, kv, resident = self.records, dev.kv, dev.slots.resident
        records = []
        for rid in ids:
            record = table[rid]
            if rid not in kv or record.model not in resident:
                raise InvariantViolation(f"{iid}: decode of {rid} ({record.model}) with {sorted(resident)} "
                                         f"resident, KV on device: {rid in kv}")
            records.append(record)
        return records

    def _iteration(self, iid: str, dev: _Device, action: Decode, t: float) -> float:
        """One mixed iteration: a token for each decoding request, a prompt chunk for each prefilling one."""
        if action.max_steps != 1:
            raise InvariantViolation(f"{iid}: a Decode with prefill chunks runs 1 step, not {action.max_steps}")
        batch = self._batch(iid, dev, action.request_ids)
        records = batch.records
        completed: list[RequestRecord] = []
        chunks: dict[str, list[int]] = {}  # model -> [tokens, prompts]
        for rid, tokens in action.prefill_chunks:
            record = self.records[rid]
            if record.model not in dev.slots.resident:
                raise InvariantViolation(f"{iid}: prefill chunk of {rid} ({record.model}) while "
                                         f"{sorted(dev.slots.resident)} resident")
            left = dev.prompt_left.get(rid)
            if left is None:  # its first chunk: the KV of the whole request is placed now
                left = record.prompt_tokens + record.generated
                dev.kv[rid] = self._kv_bytes(record)
            left -= tokens
            if tokens < 1 or left < 0:
                raise InvariantViolation(f"{iid}: prefill chunk of {tokens} tokens for {rid} with "
                                         f"{left + tokens} prompt tokens left")
            if left:
                dev.prompt_left[rid] = left
            else:
                dev.prompt_left.pop(rid, None)
                completed.append(record)  # its prompt is done: its first token comes with the iteration
            totals = chunks.setdefault(record.model, [0, 0])
            totals[0] += tokens
            totals[1] += 1
        self._check_kv(iid, dev)
        decoding = {g.model: [g.size, g.context] for g in batch.groups}  # [batch size, context], the batch's order
        took = self.costs.mixed_iteration_s(decoding, chunks)  # a model's chunks share its decode step's weight read
        if self.gpus is not None:  # one iteration: all of it device work, its prefill chunks beside a peer's decode
            took = self.gpus.work_end_at(iid, t, took, self.now, "prefill", [*decoding, *chunks],
                                         sum(tokens for tokens, _ in chunks.values())) - t
        may_finish = batch.left <= 1
        if completed:
            records = records + completed
            ids = batch.ids + tuple(r.request_id for r in completed)
            may_finish = may_finish or any(r.output_tokens - r.generated <= 1 for r in completed)
        dev.turn = _Turn(t, took, 1, batch.ids if not completed else ids, -1, records, batch)
        return self._finish_turn(iid, dev, 1, may_finish)

    def _finish_turn(self, iid: str, dev: _Device, steps: int, may_finish: bool) -> float:
        """Push the turn's StepDone; `may_finish` is False when every request has more than `steps` tokens to go."""
        turn = dev.turn
        assert turn is not None
        end = turn.start_at + steps * turn.step_s
        finished: tuple[str, ...] = ()
        if may_finish:
            finished = tuple(r.request_id for r in turn.records if r.generated + steps >= r.output_tokens)
            for rid in finished:
                dev.kv.pop(rid, None)
        turn.seq = self._push(end, COMPLETION, StepDone(iid, "decode", turn.ids, steps, finished), dev, turn.records)
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
        for record in turn.records:  # requests that would have finished keep their KV until they do
            if record.generated + turn.max_steps >= record.output_tokens:
                dev.kv[record.request_id] = self._kv_bytes(record)
        dev.busy_s -= (turn.max_steps - done) * turn.step_s
        dev.free_at = self._finish_turn(iid, dev, done, False)
        if self.decode_ahead and turn.batch is not None:
            self._queue_ahead(dev, done, dev.free_at)
        if self.gpus is not None:
            self.gpus.cut(iid, dev.free_at)

    # ---- checks ------------------------------------------------------------------
    def _kv_bytes(self, record: RequestRecord) -> float:
        return kv_held_bytes(self.kv_bytes_per_token[record.model], record.prompt_tokens, record.output_tokens)

    def _check_kv(self, iid: str, dev: _Device) -> None:
        if self.kv_capacity is None:
            return
        used = sum(dev.kv.values())
        if not kv_fits(used, self.kv_capacity[iid]):
            raise InvariantViolation(f"{iid}: {used / 1e9:.3f} GB of KV on a device that holds "
                                     f"{self.kv_capacity[iid] / 1e9:.3f} GB")


def _add_groups(groups: list[_Group], records: list[RequestRecord]) -> None:
    """Count `records` into per-model groups, new models appended in order of first appearance. (Plain
    loops: batches are a few requests, and the compiled build reads the fields directly.)"""
    for record in records:
        for entry in groups:
            if entry.model == record.model:
                break
        else:
            entry = _Group(record.model)
            groups.append(entry)
        entry.size += 1
        entry.context += record.prompt_tokens + record.generated


def _fewest_left(records: list[RequestRecord]) -> int:
    """The fewest tokens any of `records` has still to produce (_NEVER for none)."""
    left = _NEVER
    for record in records:
        left = min(left, record.output_tokens - record.generated)
    return left


def _by_model(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """The records grouped by model, models in order of first appearance (one group, usually)."""
    if not records:
        return {}
    first = records[0].model
    for record in records:
        if record.model != first:
            break
    else:
        return {first: records}
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(record.model, []).append(record)
    return groups
