"""The reconcile loop's core: requests in, Plans out, engine calls carried out, events back.

`Controller` owns the Scheduler (unchanged from the simulator), one
`InstanceRunner` per instance and the table of live requests. It is driven
from outside - by the live loop in `pool.service` with Ray calls and a
monotonic clock, or by the parity harness with a manual clock - in the order
the simulator uses at one instant: arrivals, then completions, then one
`schedule(now)`. It survives a failing call by writing the instance off:
its requests go back to the scheduler's queue and resume elsewhere from
prompt plus generated tokens, or on the same instance once `restore()` says
a fresh engine is up there; `fail_stranded()` ends, with a clean error, the
requests no instance is left to serve. An instance that does not answer a
call within `call_timeout_s` (alive but hung: a stuck kernel or collective)
is written off the same way.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any, Protocol

from pool import calls
from pool.calls import EngineCall
from pool.engines.base import TokenOut
from pool.errors import CallTimedOut, InstanceDied, OutOfKvMemory, RequestFailed
from pool.runner import InstanceRunner, Issue, LiveRequest
from scheduler import (Cancelled, Clock, Event, InstanceAdded, InstanceLost, KvRefused, Plan, Request, Scheduler,
                       StepDone, Stop)

log = logging.getLogger("modelpool.controller")


class Backend(Protocol):
    """Where engine calls go: `call` returns a handle whose result `Controller.complete` gets later."""

    def call(self, instance_id: str, call: EngineCall) -> int: ...


@dataclass(frozen=True, slots=True)
class _Call:
    """An engine call in flight: the runner waiting for it (None: nobody), the instance it runs on, and
    both instances' generations when it was issued (a restart makes the results of older calls stale)."""

    waiting: str | None
    target: str
    waiting_generation: int
    target_generation: int
    method: str  # the call's name (not the call: an import's KV would stay in memory while it is in flight)
    request_ids: tuple[str, ...]  # the requests the call carries (suspects when it fails)
    issued_at: float


class Controller:
    def __init__(self, scheduler: Scheduler, backend: Backend, clock: Clock, instance_ids: Iterable[str], *,
                 plan_log: IO[str] | None = None, max_losses_per_request: int = 2,
                 max_refusals_per_request: int = 8, call_timeout_s: float | None = None) -> None:
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0 (or None: no limit), got {call_timeout_s}")
        self.scheduler = scheduler
        self.backend = backend
        self.clock = clock
        self.plan_log = plan_log
        self.requests: dict[str, LiveRequest] = {}
        instance_ids = list(instance_ids)
        roles = {iid: inst.role for iid, inst in scheduler.view().instances.items()}
        # a prefill instance hands its requests over: its SwapOut exports and the controller carries the KV
        self.runners = {iid: InstanceRunner(iid, self._issuer(iid), self.requests, self._deliver,
                                            hands_off=roles.get(iid) == "prefill") for iid in instance_ids}
        self.lost: set[str] = set()
        self.generation = {iid: 0 for iid in self.runners}  # bumped by each restore()
        # a request in this many failed calls ends instead of resuming: it may be what kills the instances (a
        # request that crashes every engine it reaches would otherwise take the whole pool down, restarts and all)
        self.max_losses_per_request = max_losses_per_request
        self._losses: Counter[str] = Counter()  # request id -> failed calls that carried it, at one output step
        self._loss_step: dict[str, int] = {}  # request id -> its produced tokens when such a call last failed
        # a request in this many refused calls ends: KV the scheduler plans and the engine refuses again and again
        self.max_refusals_per_request = max_refusals_per_request
        self._refusals: Counter[str] = Counter()  # request id -> refused calls that carried it
        self.num_kv_refusals = 0
        self._calls: dict[int, _Call] = {}
        # a call unanswered this long (queued behind the instance's earlier calls included) means a hung instance
        self.call_timeout_s = call_timeout_s
        self.num_plans = 0

    # ---- inputs --------------------------------------------------------------------
    def submit(self, live: LiveRequest) -> None:
        if live.request_id in self.requests:
            raise ValueError(f"request id {live.request_id!r} is already in the pool")
        self.requests[live.request_id] = live
        produced = len(live.output_token_ids)
        request = Request(live.request_id, live.model, live.arrival_at, len(live.prompt_token_ids) + produced,
                          max(1, live.sampling.max_tokens - produced))
        self.scheduler.submit(request, self.clock.now())

    def cancel(self, request_id: str, reason: str = "cancelled by client") -> None:
        live = self.requests.pop(request_id, None)
        self._losses.pop(request_id, None)
        self._loss_step.pop(request_id, None)
        self._refusals.pop(request_id, None)
        if live is None or live.finished:
            return
        live.cancelled = True
        self.scheduler.on_event(Cancelled(request_id, reason), self.clock.now())
        if live.kv_export is not None and not live.kv_staged:  # out of every engine: dropping it frees it
            live.kv_export = None
        elif live.kv_home is not None and live.kv_home not in self.lost:  # free its KV (or the KV it staged for a
            live.kv_export = None  # hand-off) at the next call boundary
            self._issue(None, live.kv_home, calls.Release((request_id,)))

    def complete(self, handle: int, result: Any) -> bool:
        """A call finished (`result` may be the exception it raised); True when the scheduler heard of it.

        A failed call writes off the instance it ran on (not the runner waiting
        for it: a SwapIn waits for `export_kv` on the request's old instance);
        a waiting runner elsewhere goes on without that instance's KV.
        """
        call = self._calls.pop(handle, None)
        if call is None:
            return False
        fresh_target = call.target_generation == self.generation[call.target] and call.target not in self.lost
        heard = False
        if isinstance(result, OutOfKvMemory) and fresh_target and call.waiting == call.target:
            self.refuse(call.target, f"{call.method}: {result}", call.request_ids)
            return True
        if isinstance(result, BaseException):
            if call.waiting is None and not isinstance(result, InstanceDied):
                log.warning("fire-and-forget call %s to %s failed: %r", handle, call.target, result)
                return False
            if fresh_target:
                log.error("instance %s: call failed, writing the instance off: %r", call.target, result)
                self.lose(call.target, f"engine call failed: {result!r}", call.request_ids)
                heard = True
            if call.waiting is None or call.waiting == call.target:
                return heard
            result = []  # export_kv from a lost instance: nothing to import, its requests are failed or re-queued
        if call.waiting is None or call.waiting in self.lost \
                or call.waiting_generation != self.generation[call.waiting]:
            return heard
        events = self.runners[call.waiting].on_result(handle, result)
        for event in events:
            self._report(event)
        return heard or bool(events)

    def busy_instances(self) -> set[str]:
        """Instances with an engine call in flight (the pool's heartbeat judges only the others)."""
        return {call.target for call in self._calls.values()}

    def write_off_hung(self, instance_id: str, reason: str) -> None:
        """The instance's engine stopped answering (a missed heartbeat): lost at once, the requests of the call
        it is running (its oldest in flight: calls to one instance run in order) the suspects, as when a call
        times out; a late answer is ignored."""
        running = min(((handle, call) for handle, call in self._calls.items() if call.target == instance_id),
                      default=None, key=lambda pair: pair[0])
        self.lose(instance_id, reason, running[1].request_ids if running is not None else ())

    def lose(self, instance_id: str, reason: str, suspects: Iterable[str] = ()) -> None:
        """The instance is gone: its requests go back to the queue and resume elsewhere.

        A request the scheduler already placed on another instance whose KV
        still sat here (a hand-off in transit) cannot be re-queued through the
        scheduler's contract; it ends with a clean `RequestFailed`, as does a
        suspect (carried by the call that failed) for the
        `max_losses_per_request`-th time. A request handed over already (its KV
        exported, carried by the controller) goes on where it was placed,
        unless that KV was staged in this instance's device memory (a hand-off
        on one GPU): then it went with the instance. A request handed over to
        this instance and not imported yet resumes from its prompt (the
        scheduler re-queues it): the KV it carries is dropped, and freed at
        its exporter when staged there.
        """
        if instance_id in self.lost:
            return
        self.lost.add(instance_id)
        for home, rid in self.runners[instance_id].staged_in_flight():  # its exporters may free what it was copying
            if home is not None and home not in self.lost:
                self._issue(None, home, calls.Release((rid,)))
        self.runners[instance_id].reset()
        ended = {rid: f"it was in the failing call of {count} instances that were lost at the same step, the last "
                      f"{instance_id} ({reason})"
                 for rid, count in self._strike(self._losses, self._likely_causes(suspects),
                                                self.max_losses_per_request)}
        for live in self.requests.values():
            placed = self.scheduler.request_view(live.request_id)
            if live.kv_home != instance_id:
                if live.kv_export is not None and placed is not None and placed.instance_id == instance_id:
                    self._drop_export(live)  # handed to the lost instance, not imported: it resumes from prompt
                continue
            elsewhere = placed is not None and placed.instance_id not in (None, instance_id)
            if elsewhere and live.kv_export is not None and not live.kv_staged:
                continue  # handed over: its KV is not here any more (staged KV was in this instance's memory)
            live.kv_home = live.kv_export = None  # resume from prompt + produced tokens, as the scheduler will
            if elsewhere:
                ended[live.request_id] = f"its KV was on instance {instance_id}, which was lost ({reason})"
        self._report(InstanceLost(instance_id, reason))
        for request_id, why in ended.items():
            self.fail(request_id, why)

    def _likely_causes(self, suspects: Iterable[str]) -> list[str]:
        """The suspects of a failed call, each one's count of such calls restarted unless it failed at the output
        step it failed at last time: a request that crashes an engine does so where it stands, while one that
        was only batched with it twice, having moved on in between, is a victim (it was failed as the cause)."""
        out = []
        for rid in suspects:
            live = self.requests.get(rid)
            if live is None:
                continue
            step = len(live.output_token_ids)
            if self._loss_step.get(rid) != step:
                self._loss_step[rid] = step
                self._losses.pop(rid, None)
            out.append(rid)
        return out

    def _drop_export(self, live: LiveRequest) -> None:
        """Forget the KV a request carries; KV staged in its exporter's device memory is freed there."""
        if live.kv_staged and live.kv_home is not None and live.kv_home not in self.lost:
            self._issue(None, live.kv_home, calls.Release((live.request_id,)))
        live.kv_export = None

    def refuse(self, instance_id: str, reason: str, refused: Iterable[str] = ()) -> None:
        """The instance's engine found no room for KV a call needed (`OutOfKvMemory`: it changed nothing).

        Not a loss: the instance and its engine stay. What the runner had
        left to do there is dropped; every request the scheduler placed there
        goes back to the queue (`KvRefused`) and resumes from prompt plus
        produced tokens, its KV freed wherever it was. A request whose KV sits
        here on its way to another instance keeps it. A request in the
        refused call for the `max_refusals_per_request`-th time ends with
        `RequestFailed` (the scheduler keeps planning what the engine cannot hold).
        """
        log.warning("instance %s: KV refused, its requests go back to the queue: %s", instance_id, reason)
        self.num_kv_refusals += 1
        self.runners[instance_id].reset()
        ended = {rid: f"its KV was refused {count} times, the last by {instance_id} ({reason})"
                 for rid, count in self._strike(self._refusals, refused, self.max_refusals_per_request)}
        freed: dict[str, list[str]] = {}
        for live in self.requests.values():
            placed = _placed_on(self.scheduler, live.request_id)
            if placed == instance_id or (placed is None and live.kv_home == instance_id):
                if live.kv_home is not None and live.kv_home not in self.lost and (live.kv_export is None
                                                                                   or live.kv_staged):
                    freed.setdefault(live.kv_home, []).append(live.request_id)
                live.kv_home = live.kv_export = None
        for home, ids in sorted(freed.items()):  # before anything planned next: calls to one engine run in order
            self._issue(None, home, calls.Release(tuple(ids)))
        self._report(KvRefused(instance_id, reason))
        for request_id, why in ended.items():
            self.fail(request_id, why)

    def _strike(self, counter: Counter[str], request_ids: Iterable[str], limit: int) -> list[tuple[str, int]]:
        """Count one more strike (a failed or refused call) against each request still here; those at `limit`
        now, with their count."""
        out = []
        for rid in request_ids:
            if rid in self.requests:
                counter[rid] += 1
                if counter[rid] >= limit:
                    out.append((rid, counter[rid]))
        return out

    def restore(self, instance_id: str) -> None:
        """A fresh engine runs on a lost instance again: the scheduler hears `InstanceAdded`."""
        if instance_id not in self.lost:
            return
        self.lost.discard(instance_id)
        self.generation[instance_id] += 1
        self.runners[instance_id].reset()
        self._report(InstanceAdded(instance_id))

    def fail(self, request_id: str, why: str) -> None:
        """End a request with `RequestFailed(why)`: the scheduler drops it, its KV is freed."""
        live = self.requests.get(request_id)
        if live is None:
            return
        self.cancel(request_id, why)
        if live.sink is not None and not live.finished:
            live.sink(RequestFailed(why))

    def fail_stranded(self, coming_back: Iterable[str] = ()) -> list[str]:
        """Fail every request waiting to be placed that no instance left can prefill (none of its TP that is
        not a decode-only instance); lost instances in `coming_back` count as left."""
        if not self.lost:
            return []
        view, back = self.scheduler.view(), set(coming_back)
        can_prefill = {inst.tp for iid, inst in view.instances.items()
                       if iid in self.runners and (iid not in self.lost or iid in back) and inst.role != "decode"}
        stranded = [rid for rid, live in self.requests.items()
                    if _placed_on(self.scheduler, rid) is None and view.model_tp[live.model] not in can_prefill]
        for request_id in stranded:
            model = self.requests[request_id].model
            self.fail(request_id, f"every instance that serves {model!r} was lost")
        return stranded

    def close(self, reason: str) -> None:
        """The pool stops: every request is cancelled in the scheduler (its KV freed there); no engine calls."""
        for request_id in list(self.requests):
            live = self.requests.pop(request_id)
            live.cancelled = True
            self.scheduler.on_event(Cancelled(request_id, reason), self.clock.now())
        self._calls.clear()
        self._losses.clear()
        self._loss_step.clear()
        self._refusals.clear()

    # ---- the tick ------------------------------------------------------------------
    def tick(self) -> Plan:
        now = self.clock.now()
        if self.call_timeout_s is not None:
            self._time_out_calls(now)
        plan = self.scheduler.schedule(now)
        if not plan:
            return plan
        self.num_plans += 1
        if self.plan_log is not None:
            self.plan_log.write(plan.to_json() + "\n")
        for request_id, why in plan.failed:
            live = self.requests.pop(request_id, None)
            self._losses.pop(request_id, None)
            self._loss_step.pop(request_id, None)
            self._refusals.pop(request_id, None)
            if live is not None and live.sink is not None:
                live.sink(RequestFailed(why))
        for instance_id, actions in plan.actions.items():
            runner = self.runners[instance_id]
            if len(actions) == 1 and isinstance(actions[0], Stop):
                runner.stop()
                continue
            for event in runner.start(actions):
                self._report(event)
        return plan

    def _time_out_calls(self, now: float) -> None:
        """End the calls unanswered past `call_timeout_s` as failed: each writes its instance off (a runner
        waiting elsewhere, e.g. for `export_kv`, goes on without that KV); a late answer is ignored."""
        assert self.call_timeout_s is not None
        late = [(handle, call) for handle, call in self._calls.items() if now - call.issued_at > self.call_timeout_s]
        for handle, call in late:
            if handle in self._calls:
                self.complete(handle, CallTimedOut(f"{call.target} did not answer {call.method} within "
                                                   f"{self.call_timeout_s:g} s"))

    # ---- plumbing ------------------------------------------------------------------
    def _issuer(self, runner_id: str) -> Issue:
        def issue(instance_id: str, call: EngineCall, waits: bool) -> int:
            return self._issue(runner_id if waits else None, instance_id, call)
        return issue

    def _issue(self, waiting: str | None, instance_id: str, call: EngineCall) -> int:
        """Send a call to `instance_id`; its result goes to runner `waiting` (None: to nobody)."""
        handle = self.backend.call(instance_id, call)
        self._calls[handle] = _Call(waiting, instance_id, self.generation.get(waiting, 0) if waiting else 0,
                                    self.generation[instance_id], call.name, call.request_ids, self.clock.now())
        return handle

    def _report(self, event: Event) -> None:
        self.scheduler.on_event(event, self.clock.now())
        if isinstance(event, StepDone):
            for request_id in event.finished_ids:
                self.requests.pop(request_id, None)
                self._losses.pop(request_id, None)
                self._loss_step.pop(request_id, None)
                self._refusals.pop(request_id, None)

    def _deliver(self, live: LiveRequest, out: TokenOut) -> None:
        if live.sink is not None:
            live.sink(out)


def _placed_on(scheduler: Scheduler, request_id: str) -> str | None:
    """The instance the scheduler placed a request on (None: not placed, or not known to it)."""
    request = scheduler.request_view(request_id)
    return None if request is None else request.instance_id

