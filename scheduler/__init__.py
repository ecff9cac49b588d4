"""modelpool's scheduler: pure policy that decides and never acts.

`Scheduler.submit(request, now)`, `on_event(event, now)` and `schedule(now) ->
Plan` are the whole contract, with read-only views of the state (`view()`,
`request_view(id)`, `kv_room(model)`: frozen copies, scheduler.view) for those
who show or reason about it; the simulator and the live pool drive the same
objects, differing only in their clock and in the executor that carries a Plan
out. This package does no I/O, reads no clock and imports only the standard
library, pydantic and numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from scheduler.clock import Clock, ManualClock
from scheduler.costs import CostModel, InstanceSpec, ModelProfile, make_instances, model_profiles, padded_prefill_tokens
from scheduler import instance
from scheduler.errors import IllegalTransition, RefusedAction
from scheduler.instance import KvPlaces, ModelSlots, resident_after, staging_instances
from scheduler.plan import (Action, Cancelled, Decode, Event, InstanceAdded, InstanceLost, KvMoved, KvRefused, Plan,
                            Prefetch, Prefill, StepDone, Stop, SwapIn, SwapOut, Switch, SwitchDone)
from scheduler.policies import POLICIES
from scheduler.quotas import decode_quotas
from scheduler.request import TERMINAL, Request, RequestStatus, transition
from scheduler.view import InstanceView, RequestView, SchedulerView


class Scheduler(Protocol):
    """What a caller (the simulator, the live pool) may use of a scheduler: these members and nothing else."""

    @property
    def name(self) -> str: ...  # read-only: the policies declare it on the class

    def submit(self, request: Request, now: float) -> None: ...

    def on_event(self, event: Event, now: float) -> None: ...

    def schedule(self, now: float) -> Plan: ...

    def view(self) -> SchedulerView:
        """Instances (role, actions in flight, KV used), queues and each model's TP, as frozen copies."""
        ...

    def request_view(self, request_id: str) -> RequestView | None:
        """One request (status, the instance it is placed on, its KV); None once it is unknown or forgotten."""
        ...

    def kv_room(self, model: str) -> float:
        """The most device KV (bytes) any instance could ever give one request of `model`."""
        ...


def make_scheduler(policy: str, models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec],
                   costs: CostModel, **options: Any) -> Scheduler:
    """Build the named policy (`dedicated`, `request-level`, `spatial`, `token-level`)."""
    try:
        cls = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(models, instances, costs, **options)


__all__ = [
    "Action", "Cancelled", "KvPlaces", "ModelSlots", "staging_instances", "RefusedAction", "instance", "Clock", "CostModel", "Decode", "Event", "IllegalTransition", "InstanceAdded",
    "InstanceLost", "InstanceSpec", "InstanceView", "KvMoved", "KvRefused", "ManualClock", "ModelProfile", "POLICIES", "Plan",
    "Prefetch", "Prefill", "Request", "RequestStatus", "RequestView", "Scheduler", "SchedulerView", "StepDone",
    "Stop", "SwapIn", "SwapOut", "Switch", "SwitchDone", "TERMINAL", "decode_quotas", "make_instances",
    "make_scheduler", "model_profiles", "padded_prefill_tokens", "resident_after", "transition",
]
