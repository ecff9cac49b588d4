"""The reconcile loop's core: requests in, Plans out, engine calls carried out, events back.

`Controller` owns the Scheduler (unchanged from the simulator), one
`InstanceRunner` per instance and the table of live requests. It is driven
from outside - by the live loop in `pool.service` with Ray calls and a
monotonic clock, or by the parity harness with a manual clock - in the order
the simulator uses at one instant: arrivals, then completions, then one
`schedule(now)`. It survives a failing call by writing the instance off.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import IO, Any, Protocol

from pool.engines.base import TokenOut
from pool.runner import InstanceRunner, LiveRequest
from scheduler import Cancelled, Clock, Event, InstanceLost, Plan, Request, Scheduler, StepDone, Stop

log = logging.getLogger("modelpool.controller")


class Backend(Protocol):
    """Where engine calls go: `call` returns a handle whose result `Controller.complete` gets later."""

    def call(self, instance_id: str, method: str, args: tuple[Any, ...], meta: dict[str, Any]) -> int: ...


class RequestFailed(RuntimeError):
    """The pool could not serve a request (the reason is the scheduler's or the engine's)."""


class Controller:
    def __init__(self, scheduler: Scheduler, backend: Backend, clock: Clock, instance_ids: Iterable[str], *,
                 plan_log: IO[str] | None = None) -> None:
        self.scheduler = scheduler
        self.backend = backend
        self.clock = clock
        self.plan_log = plan_log
        self.requests: dict[str, LiveRequest] = {}
        self.runners = {iid: InstanceRunner(iid, self._issuer(iid), self.requests, self._deliver) for iid in instance_ids}
        self.lost: set[str] = set()
        self._calls: dict[int, str | None] = {}  # handle -> instance whose runner waits for it (None: nobody)
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
        if live is None or live.finished:
            return
        live.cancelled = True
        self.scheduler.on_event(Cancelled(request_id, reason), self.clock.now())
        if live.kv_home is not None and live.kv_home not in self.lost:  # free its KV at the next call boundary
            self._issue(None, live.kv_home, "release", ([request_id],), {})

    def complete(self, handle: int, result: Any) -> bool:
        """A call finished (`result` may be the exception it raised); True when the scheduler heard of it."""
        instance_id = self._calls.pop(handle, "?")
        if instance_id is None or instance_id == "?" or instance_id in self.lost:
            if isinstance(result, BaseException) and instance_id is None:
                log.warning("fire-and-forget call %s failed: %r", handle, result)
            return False
        if isinstance(result, BaseException):
            log.error("instance %s: call failed, writing the instance off: %r", instance_id, result)
            self.lose(instance_id, f"engine call failed: {result!r}")
            return True
        events = self.runners[instance_id].on_result(handle, result)
        for event in events:
            self._report(event)
        return bool(events)

    def lose(self, instance_id: str, reason: str) -> None:
        """The instance is gone: its requests go back to the queue and resume elsewhere."""
        if instance_id in self.lost:
            return
        self.lost.add(instance_id)
        self.runners[instance_id].reset()
        for live in self.requests.values():
            if live.kv_home == instance_id:
                live.kv_home = None  # resume from prompt + produced tokens
        self._report(InstanceLost(instance_id, reason))

    # ---- the tick ------------------------------------------------------------------
    def tick(self) -> Plan:
        now = self.clock.now()
        plan = self.scheduler.schedule(now)
        if not plan:
            return plan
        self.num_plans += 1
        if self.plan_log is not None:
            self.plan_log.write(plan.to_json() + "\n")
        for request_id, why in plan.failed:
            live = self.requests.pop(request_id, None)
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

    # ---- plumbing ------------------------------------------------------------------
    def _issuer(self, runner_id: str):  # type: ignore[no-untyped-def]
        def issue(instance_id: str, method: str, args: tuple[Any, ...], meta: dict[str, Any]) -> int:
            return self._issue(None if meta.get("fire_and_forget") else runner_id, instance_id, method, args, meta)
        return issue

    def _issue(self, waiting: str | None, instance_id: str, method: str, args: tuple[Any, ...],
               meta: dict[str, Any]) -> int:
        """Send a call to `instance_id`; its result goes to runner `waiting` (None: to nobody)."""
        handle = self.backend.call(instance_id, method, args, meta)
        self._calls[handle] = waiting
        return handle

    def _report(self, event: Event) -> None:
        self.scheduler.on_event(event, self.clock.now())
        if isinstance(event, StepDone):
            for request_id in event.finished_ids:
                self.requests.pop(request_id, None)

    def _deliver(self, live: LiveRequest, out: TokenOut) -> None:
        if live.sink is not None:
            live.sink(out)
