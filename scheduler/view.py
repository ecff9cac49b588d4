"""What the scheduler lets its callers see of its state: frozen values, built on request.

The live pool shows the scheduler's state (`/pool/status`) and reasons about it when an
instance dies (which requests were placed where, which models any surviving instance can
still prefill); it does so through these views only, never through a policy's own tables,
so any object that honours the `Scheduler` Protocol can run a pool. Each view is a copy:
changing it changes nothing in the scheduler, and the scheduler changing later does not
change a view already taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduler.costs import Role
from scheduler.plan import Action
from scheduler.request import RequestStatus


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance as the scheduler counts it."""

    instance_id: str
    role: Role
    tp: int
    active_model: str | None  # the model whose weights are current (planned: a Switch in flight counts)
    prefetched_model: str | None  # the model copied (or being copied) into the spare weight slot
    inflight: tuple[Action, ...]  # actions planned and not yet reported done, oldest first
    lost: bool
    kv_used_bytes: float  # device KV reserved, counting what is already promised to planned actions
    kv_capacity_bytes: float
    num_requests_on_device: int  # requests whose KV is (or will be) on the device

    @property
    def busy(self) -> bool:
        return bool(self.inflight)


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request as the scheduler sees it."""

    request_id: str
    model: str
    status: RequestStatus
    instance_id: str | None  # where its KV lives or will live; None while it waits to be placed
    kv_reserved_bytes: float  # device KV the scheduler counts for it


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """The whole scheduler at one moment: instances, queues, and each model's TP degree."""

    policy: str
    instances: Mapping[str, InstanceView]  # by instance id, in the order the scheduler was given them
    queued: Mapping[str, int]  # per model: requests waiting to be placed on an instance
    model_tp: Mapping[str, int]  # per model: the tensor-parallel degree of the instances that serve it
