"""What every policy shares: the request table, instance state, KV accounting
and the bookkeeping of events against the actions that caused them.

KV accounting is *planned*: a Prefill or SwapIn reserves device KV when it is
planned, a SwapOut releases it when planned (it runs before anything planned
after it on the same instance), finishing or moving KV to host after a
prefill releases it when reported. So `kv_used_bytes <= kv_capacity_bytes`
holds at every moment, counting what is already promised.

A policy may set `self.skip_quiet_schedules = True` when its `_plan` reads
nothing but state (not `now`) and plans no busy instance: then `schedule()`
skips planning when the last plan was empty and nothing that could enable an
action has happened since - the only news was a KvMoved or SwitchDone of an
instance that still has planned work queued behind it (the middle of a
SwapOut, Switch, SwapIn, Decode sequence), which changes only that busy
instance - so the skipped call would have been empty too. A policy whose
`_after_event` turns such an event into news for others sets `_dirty` itself. (After a non-empty
plan the next call always runs: a policy may plan again from the same state,
e.g. stop a second holder while the first is still stopping.)

Continuous batching can run Sarathi-style (`chunked_prefill_tokens`): every
iteration decodes all running requests and spends the rest of the token
budget on prompt chunks (the started prompts first, then queued requests
FCFS), as one `Decode` with `prefill_chunks`; a long prompt takes several
iterations. Policies that plan through `continuous_step` as-is opt in with
`supports_chunked_prefill = True`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import ClassVar, Final

from scheduler.costs import CostModel, InstanceSpec, ModelProfile, kv_capacity, kv_need_tokens
from scheduler.plan import (Action, Cancelled, Decode, Event, InstanceAdded, InstanceLost, KvMoved, KvRefused, Plan,
                            Prefill, Stop, StepDone, SwapIn, SwapOut, Switch, SwitchDone)
from scheduler.request import (CANCELLED, FAILED, FINISHED, PREFILLING, QUEUED, RUNNING, SWAPPED, TERMINAL, Request,
                               RequestStatus, transition)
from scheduler.policies.kv_tiers import tiers_admit
from scheduler.view import InstanceView, RequestView, SchedulerView

S = RequestStatus
_EVENTFUL: Final = frozenset({Switch, Prefill, Decode, SwapOut, SwapIn})  # actions the executor answers with an event
_QUIET: Final = (KvMoved, SwitchDone)  # events that cannot enable an action while their instance stays busy
_FCFS = attrgetter("arrival_at", "request_id")
_REQUEST_ID = attrgetter("request_id")


@dataclass(slots=True, eq=False)
class InstanceState:
    spec: InstanceSpec
    kv_capacity_bytes: float
    instance_id: str = field(init=False)  # spec.instance_id, read on every decision
    active: str | None = None  # model whose weights are current
    resident: set[str] = field(default_factory=set)  # all models with weights on the device
    prefetched: str | None = None
    inflight: list[Action] = field(default_factory=list)  # eventful actions not yet reported, oldest first (a few)
    idle: bool = True  # nothing in flight and not lost (kept by inflight_changed)
    decoding: bool = False  # the last action in flight is a Decode (kept by inflight_changed)
    kv_used_bytes: float = 0.0
    on_device: set[str] = field(default_factory=set)  # requests whose KV is (or will be) on the device
    stopping: bool = False
    lost: bool = False
    last_used_at: float = float("-inf")
    # chunked prefill: PREFILLING requests with prompt tokens not yet planned, in admission order
    prefilling: dict[str, int] = field(default_factory=dict)
    # `running_on`'s answer until a request on the instance changes status or KV placement
    running_cache: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self.instance_id = self.spec.instance_id

    def inflight_changed(self) -> None:
        """Refresh `idle` and `decoding` (plain fields: policies read them on every decision)."""
        self.idle = not self.inflight and not self.lost
        self.decoding = bool(self.inflight) and isinstance(self.inflight[-1], Decode)

    @property
    def kv_free_bytes(self) -> float:
        return self.kv_capacity_bytes - self.kv_used_bytes


class PolicyBase:
    """Shared machinery; subclasses implement `_plan(now)` (and a few hooks)."""

    name: ClassVar[str] = "base"
    supports_chunked_prefill: ClassVar[bool] = False

    def __init__(self, models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec], costs: CostModel, *,
                 max_batch_size: int = 256, max_prefill_tokens: int = 8192,
                 chunked_prefill_tokens: int | None = None, keep_ended: bool = True) -> None:
        if chunked_prefill_tokens is not None:
            if not self.supports_chunked_prefill:
                raise ValueError(f"policy {self.name!r} does not support chunked prefill")
            if chunked_prefill_tokens <= max_batch_size:
                raise ValueError(f"chunked_prefill_tokens ({chunked_prefill_tokens}) must exceed max_batch_size "
                                 f"({max_batch_size}) so that every iteration has room for prompt tokens")
        self.models = dict(models)
        self.costs = costs
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_tokens = chunked_prefill_tokens
        self.skip_quiet_schedules = False  # see the module docstring
        self._dirty = True  # something happened since the last _plan that may enable an action
        self._touched: set[str] = set()  # instances whose state changed since the last _plan (see touch)
        self._queued_news = True  # a request joined a queue since the last _plan
        self.requests: dict[str, Request] = {}
        # keep_ended=False (a long-running pool): a request that ended leaves `requests` at the start of the next
        # schedule() call, so memory holds live requests only; a later event naming it is ignored for it
        self.keep_ended = keep_ended
        self._ended: list[str] = []
        self.queues: dict[str, deque[str]] = {name: deque() for name in self.models}  # QUEUED, not yet placed
        # models whose queue may hold requests: every model a request was queued for since its queue was last
        # seen empty (a policy that drains queues prunes it; scanning all queues per arrival costs a fleet's size)
        self.queued_models: dict[str, None] = {}
        self.instances: dict[str, InstanceState] = {}
        self._failed: list[tuple[str, str]] = []
        self._kv_rooms: dict[str, float] = {}  # kv_room's answers
        for spec in instances:
            self.instances[spec.instance_id] = InstanceState(spec, self._kv_capacity(spec))
        self._touched.update(self.instances)

    # ---- the contract ------------------------------------------------------------
    def submit(self, request: Request, now: float) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} submitted twice")
        self.requests[request.request_id] = request
        self._dirty = True
        why = self._refuse(request)
        if why:
            self.fail(request, why)
            return
        request.kv_reserved_bytes = 0.0
        self.queues[request.model].append(request.request_id)
        self.queued_models[request.model] = None
        self._queued_news = True

    def on_event(self, event: Event, now: float) -> None:
        kind = type(event)
        if isinstance(event, Cancelled) or isinstance(event, InstanceLost) or isinstance(event, InstanceAdded) \
                or isinstance(event, KvRefused):
            self._dirty = self._queued_news = True
            self._touched.update(self.instances)
            if isinstance(event, Cancelled):
                self._cancel(event, now)
            elif isinstance(event, InstanceLost):
                self._lose(self.instances[event.instance_id], event.reason or "instance lost", now)
            elif isinstance(event, KvRefused):  # as a loss and a restart at once: its requests re-queue, it stays
                self._lose(self.instances[event.instance_id], event.reason or "KV refused", now)
                self._add_instance(event.instance_id)
            else:
                self._add_instance(event.instance_id)
            return
        inst = self.instances[event.instance_id]
        if inst.lost:
            return  # a late report from an instance already written off
        action = inst.inflight.pop(0)
        inst.inflight_changed()
        self._touched.add(inst.instance_id)
        if kind is StepDone:
            if not isinstance(action, (Prefill, Decode)):
                raise RuntimeError(f"{inst.instance_id}: StepDone answers {type(action).__name__}")
            inst.last_used_at = now
            self._step_done(inst, event, action, now)  # type: ignore[arg-type]
            if isinstance(action, Decode):
                inst.stopping = False
        elif isinstance(event, SwitchDone):
            inst.active = event.model
            if inst.prefetched == event.model:
                inst.prefetched = None
        elif isinstance(event, KvMoved):
            inst.running_cache = None
            for rid in event.request_ids:
                req = self.requests.get(rid)
                if req is None or req.done:
                    continue
                if event.to == "host" and req.status is RUNNING:
                    transition(req, SWAPPED)
                elif event.to == "device" and req.status is SWAPPED:
                    transition(req, RUNNING)
        self._after_event(inst, event, now)
        if not (inst.inflight and kind in _QUIET and self.skip_quiet_schedules):
            self._dirty = True

    def schedule(self, now: float) -> Plan:
        if self._ended:
            if not self.keep_ended:
                for rid in self._ended:
                    self.requests.pop(rid, None)
            self._ended.clear()
        if not self._dirty and not self._failed and self.skip_quiet_schedules:
            return Plan(at=now)
        actions = self._plan(now)
        self._dirty = False
        plan_actions: dict[str, tuple[Action, ...]] = {}
        for iid, acts in actions.items():
            if not acts:
                continue
            self._dirty = True  # a call that planned something may plan more with nothing new
            inst = self.instances[iid]
            for act in acts:
                kind = type(act)
                if kind in _EVENTFUL:
                    inst.inflight.append(act)
                elif kind is Stop:
                    inst.stopping = True
            inst.inflight_changed()
            plan_actions[iid] = tuple(acts)
        failed, self._failed = tuple(self._failed), []
        return Plan(at=now, actions=plan_actions, failed=failed)

    # ---- the read-only view (scheduler.view) -------------------------------------------
    def view(self) -> SchedulerView:
        instances = {iid: InstanceView(iid, inst.spec.role, inst.spec.tp, inst.active, inst.prefetched,
                                       tuple(inst.inflight), inst.lost, inst.kv_used_bytes, inst.kv_capacity_bytes,
                                       len(inst.on_device))
                     for iid, inst in self.instances.items()}
        return SchedulerView(self.name, instances, {model: len(queue) for model, queue in self.queues.items()},
                             {name: model.tp for name, model in self.models.items()})

    def request_view(self, request_id: str) -> RequestView | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        return RequestView(req.request_id, req.model, req.status, req.instance_id, req.kv_reserved_bytes)

    # ---- hooks for subclasses ----------------------------------------------------------
    def _plan(self, now: float) -> dict[str, list[Action]]:
        raise NotImplementedError

    def _kv_capacity(self, spec: InstanceSpec) -> float:
        """Device KV bytes left on an instance once its model weights are in."""
        biggest = max((m.weight_bytes for m in self.models.values() if m.tp == spec.tp), default=0.0)
        return kv_capacity(spec, biggest)

    def _after_event(self, inst: InstanceState, event: Event, now: float) -> None:
        """Called after the shared handling of an instance's event."""

    def _forget(self, request: Request) -> None:
        """Drop a request that ended or was re-queued from policy-specific structures."""

    def _add_instance(self, instance_id: str) -> None:
        inst = self.instances[instance_id]
        inst.lost, inst.inflight, inst.active, inst.prefetched = False, [], None, None
        inst.inflight_changed()
        inst.resident.clear()
        inst.on_device.clear()
        inst.prefilling.clear()
        inst.running_cache = None
        inst.kv_used_bytes, inst.stopping = 0.0, False

    # ---- shared pieces -------------------------------------------------------------
    def kv_need_bytes(self, request: Request) -> float:
        model = self.models[request.model]
        return model.kv_bytes_per_token * kv_need_tokens(model, request.prompt_tokens + request.max_output_tokens)

    def _refuse(self, request: Request) -> str:
        model = self.models.get(request.model)
        if model is None:
            return f"unknown model {request.model!r}"
        if request.prompt_tokens < 1 or request.max_output_tokens < 1:
            return f"prompt_tokens ({request.prompt_tokens}) and max_output_tokens ({request.max_output_tokens}) must be >= 1"
        if request.prompt_tokens + request.max_output_tokens > model.max_context:
            return (f"prompt ({request.prompt_tokens}) + max output ({request.max_output_tokens}) tokens exceed "
                    f"{request.model}'s context of {model.max_context}")
        if self.kv_need_bytes(request) > self.kv_room(request.model):
            return f"request needs {self.kv_need_bytes(request) / 1e9:.2f} GB of KV; no instance of {request.model} has that much"
        return ""

    def kv_room(self, model: str) -> float:
        """The most device KV any instance could ever give one request of `model` (the instances are fixed at
        construction, so it is computed once per model)."""
        room = self._kv_rooms.get(model)
        if room is None:
            tp = self.models[model].tp
            room = self._kv_rooms[model] = max(
                (i.kv_capacity_bytes for i in self.instances.values() if i.spec.tp == tp), default=0.0)
        return room

    def fail(self, request: Request, why: str) -> None:
        self.release(request)
        transition(request, FAILED, why)
        self._ended.append(request.request_id)
        self._forget(request)
        self._failed.append((request.request_id, why))

    def reserve(self, inst: InstanceState, request: Request) -> None:
        need = self.kv_need_bytes(request)
        self._touched.add(inst.instance_id)
        inst.kv_used_bytes += need
        inst.on_device.add(request.request_id)
        if request.status is RUNNING:
            inst.running_cache = None
        request.kv_reserved_bytes = need
        request.instance_id = inst.instance_id

    def note_news(self) -> None:
        """Something happened that may enable an action though it came with a quiet event (see the module
        docstring): the next schedule() plans."""
        self._dirty = True

    def touch(self, instance_id: str | None) -> None:
        """Note that an instance's state changed. Every change goes through an event of the instance, a
        request placed on or leaving it, or a reservation or release of its KV: a policy that plans only
        touched instances (token-level) sees every instance whose plan could differ from an empty one."""
        if instance_id is not None:
            self._touched.add(instance_id)

    def release(self, request: Request) -> None:
        """Give back the device KV a request holds (if any)."""
        self.touch(request.instance_id)
        if request.kv_reserved_bytes and request.instance_id is not None:
            inst = self.instances[request.instance_id]
            inst.kv_used_bytes -= request.kv_reserved_bytes
            inst.on_device.discard(request.request_id)
            if request.status is RUNNING and inst.running_cache is not None:
                self._running_left(inst, request.request_id)
            if inst.prefilling:
                inst.prefilling.pop(request.request_id, None)
            if not inst.on_device:
                inst.kv_used_bytes = 0.0  # no drift from float sums
        request.kv_reserved_bytes = 0.0

    def _step_done(self, inst: InstanceState, event: StepDone, action: Prefill | Decode, now: float) -> None:
        finished = event.finished_ids
        to_host = isinstance(action, Prefill) and action.kv_to_host
        steps, requests = event.num_steps, self.requests
        for rid in event.request_ids:
            req = requests.get(rid)
            if req is None:
                continue  # ended and forgotten (keep_ended=False)
            status = req.status
            if req.done:
                continue
            req.num_output_tokens += steps
            if (finished and rid in finished) or req.num_output_tokens >= req.max_output_tokens:
                self.release(req)
                transition(req, FINISHED)
                self._ended.append(rid)
                self._forget(req)
            elif status is PREFILLING:
                if to_host:
                    self.release(req)
                    transition(req, SWAPPED)
                else:
                    transition(req, RUNNING)
                    if inst.running_cache is not None:
                        self._running_joined(inst, req)

    def _cancel(self, event: Cancelled, now: float) -> None:
        req = self.requests.get(event.request_id)
        if req is None or req.done:
            return
        if req.status is QUEUED:
            self._drop_from_queue(req)
        self.release(req)
        transition(req, CANCELLED, event.reason)
        self._ended.append(req.request_id)
        self._forget(req)

    def _drop_from_queue(self, req: Request) -> None:
        try:
            self.queues[req.model].remove(req.request_id)
        except ValueError:
            pass  # placed with an instance already; the policy's _forget drops it there

    def _lose(self, inst: InstanceState, why: str, now: float) -> None:
        inst.lost = True
        inst.inflight.clear()
        inst.inflight_changed()
        inst.active, inst.prefetched, inst.stopping = None, None, False
        inst.resident.clear()
        victims = [r for r in self.requests.values() if r.instance_id == inst.instance_id and not r.done]
        for req in sorted(victims, key=lambda r: r.arrival_at, reverse=True):
            self.release(req)
            self._forget(req)
            req.instance_id = None
            if req.status is not QUEUED:
                transition(req, QUEUED, why)
            self.queues[req.model].appendleft(req.request_id)  # oldest ends up first
            self.queued_models[req.model] = None
            self._queued_news = True
        inst.on_device.clear()
        inst.prefilling.clear()
        inst.running_cache = None
        inst.kv_used_bytes = 0.0

    def live(self, ids: Iterable[str]) -> list[str]:
        requests = self.requests
        return [rid for rid in ids if rid in requests and requests[rid].status not in TERMINAL]

    def take_prefill_batch(self, inst: InstanceState, queue: deque[str], running: int = 0) -> list[Request]:
        """Pop queued requests FCFS that fit the instance's KV, the batch cap and the token budget."""
        batch: list[Request] = []
        tokens = 0
        while queue and running + len(batch) < self.max_batch_size:
            req = self.requests[queue[0]]
            need_tokens = req.context_tokens
            if batch and tokens + need_tokens > self.max_prefill_tokens:
                break
            need = self.kv_need_bytes(req)
            if need > inst.kv_free_bytes or not tiers_admit(self, inst, need):
                break
            queue.popleft()
            self.reserve(inst, req)
            transition(req, PREFILLING)
            tokens += need_tokens
            batch.append(req)
        return batch

    def decode_steps(self, ids: tuple[str, ...]) -> int:
        """Steps until the first request of a batch reaches its token limit."""
        if not ids:
            raise ValueError("decode_steps of an empty batch")
        requests, fewest = self.requests, 1 << 62
        for rid in ids:
            left = requests[rid].remaining_tokens
            if left < fewest:
                fewest = left
        return max(1, fewest)

    def running_on(self, inst: InstanceState) -> tuple[str, ...]:
        """RUNNING requests with KV on `inst`, oldest first (ties by id).

        Cached on the instance: every status change of a request happens here in the
        base class, which keeps the cache of the instance concerned: a prefill that
        completes inserts its request, a release removes it, a KvMoved or a lost instance
        drops the cache.
        """
        if inst.running_cache is None:
            ordered = [req for req in map(self.requests.__getitem__, inst.on_device) if req.status is RUNNING]
            ordered.sort(key=_FCFS)
            inst.running_cache = tuple(map(_REQUEST_ID, ordered))
        return inst.running_cache

    def _running_joined(self, inst: InstanceState, req: Request) -> None:
        cache = inst.running_cache
        assert cache is not None
        at = bisect_right(cache, (req.arrival_at, req.request_id), key=self._fcfs_key)
        inst.running_cache = (*cache[:at], req.request_id, *cache[at:])

    def _running_left(self, inst: InstanceState, request_id: str) -> None:
        cache = inst.running_cache
        assert cache is not None
        try:
            at = cache.index(request_id)
        except ValueError:
            inst.running_cache = None
            return
        inst.running_cache = cache[:at] + cache[at + 1:]

    def _fcfs_key(self, request_id: str) -> tuple[float, str]:
        return self.requests[request_id].arrival_at, request_id

    # ---- continuous batching on one instance (dedicated, request-level, spatial) -----
    def continuous_step(self, inst: InstanceState, models: Sequence[str]) -> list[Action]:
        """vLLM-style iteration: admit queued prompts that fit (prefill first), else decode all running."""
        if self.chunked_prefill_tokens is not None:
            return self.chunked_step(inst, models)
        running = self.running_on(inst)
        actions: list[Action] = []
        admitted = 0
        for model in (models if len(models) == 1 else sorted(models, key=self.head_arrival)):
            batch = self.take_prefill_batch(inst, self.queues[model], len(running) + admitted)
            if batch:
                admitted += len(batch)
                actions.append(Prefill(tuple(r.request_id for r in batch), reason=f"admit {len(batch)} queued {model}"))
        if actions or not running:
            return actions
        return [Decode(tuple(running), self.decode_steps(running), reason=f"continue batch of {len(running)}")]

    def chunked_step(self, inst: InstanceState, models: Sequence[str]) -> list[Action]:
        """Sarathi iteration: decode every running request; spend the rest of the token budget on
        prompt chunks, the started prompts first, then queued requests FCFS while KV and the batch cap allow."""
        assert self.chunked_prefill_tokens is not None
        running = self.running_on(inst)
        budget = self.chunked_prefill_tokens - len(running)
        members, pending = len(running) + len(inst.prefilling), sum(inst.prefilling.values())
        for model in (models if len(models) == 1 else sorted(models, key=self.head_arrival)):
            queue = self.queues[model]
            while queue and pending < budget and members < self.max_batch_size:
                req = self.requests[queue[0]]
                if self.kv_need_bytes(req) > inst.kv_free_bytes:
                    break
                queue.popleft()
                self.reserve(inst, req)
                transition(req, PREFILLING)
                inst.prefilling[req.request_id] = req.context_tokens
                members, pending = members + 1, pending + req.context_tokens
        chunks: list[tuple[str, int]] = []
        for rid, left in inst.prefilling.items():
            if budget <= 0:
                break
            take = min(left, budget)
            chunks.append((rid, take))
            budget -= take
        for rid, take in chunks:
            left = inst.prefilling[rid] - take
            if left:
                inst.prefilling[rid] = left
            else:
                del inst.prefilling[rid]  # its last chunk is planned: it runs from the next iteration
        if chunks:
            tokens = sum(take for _, take in chunks)
            return [Decode(tuple(running), 1, prefill_chunks=tuple(chunks),
                           reason=f"iteration: decode {len(running)}, {tokens} prompt tokens of {len(chunks)}")]
        if running:
            return [Decode(tuple(running), self.decode_steps(running), reason=f"continue batch of {len(running)}")]
        return []

    def waiting_models(self) -> list[str]:
        """Models with queued requests (from `queued_models`, which every queued request's model is in); the
        models whose queue has emptied are dropped from it."""
        queues = self.queues
        waiting = [m for m in self.queued_models if queues[m]]
        if len(waiting) < len(self.queued_models):
            self.queued_models = {m: None for m in waiting}
        return waiting

    def head_arrival(self, model: str) -> tuple[float, str]:
        queue = self.queues[model]
        return (self.requests[queue[0]].arrival_at, model) if queue else (float("inf"), model)

    def stop_to_admit(self, model: str, candidates: Iterable[InstanceState]) -> InstanceState | None:
        """A decoding instance to interrupt so that `model`'s head request can be admitted."""
        queue = self.queues[model]
        if not queue:
            return None
        need = self.kv_need_bytes(self.requests[queue[0]])
        for inst in candidates:
            if (inst.decoding and not inst.stopping and need <= inst.kv_free_bytes
                    and len(inst.on_device) < self.max_batch_size
                    and not inst.inflight[-1].prefill_chunks):  # type: ignore[union-attr]  # a 1-step iteration
                return inst
        return None
