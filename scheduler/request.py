"""A request's life: one status enum and the one function allowed to change it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from scheduler.errors import IllegalTransition


class RequestStatus(enum.Enum):
    QUEUED = "queued"  # waiting for (re-)prefill
    PREFILLING = "prefilling"  # inside an in-flight Prefill
    RUNNING = "running"  # KV on a device; decodable there
    SWAPPED = "swapped"  # KV in host memory, between decode turns
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    # Members are singletons compared by identity; hash them the same way (C speed, not Enum's
    # Python-level hash of the name): statuses are looked up in sets on every decision.
    __hash__ = object.__hash__


S = RequestStatus
# The members as module constants, for hot loops: `RequestStatus.RUNNING` goes through
# EnumType.__getattr__'s slow attribute hook (~0.1 us), a module global does not; Final, the
# compiled build reads them from C statics instead of the module's dict.
QUEUED: Final = S.QUEUED
PREFILLING: Final = S.PREFILLING
RUNNING: Final = S.RUNNING
SWAPPED: Final = S.SWAPPED
FINISHED: Final = S.FINISHED
CANCELLED: Final = S.CANCELLED
FAILED: Final = S.FAILED
TERMINAL: Final[frozenset[RequestStatus]] = frozenset({S.FINISHED, S.CANCELLED, S.FAILED})
_ENDS = {S.CANCELLED, S.FAILED}

ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    S.QUEUED: frozenset({S.PREFILLING} | _ENDS),
    # Prefill leaves KV on the device (RUNNING) or moves it to host (SWAPPED);
    # a one-token request finishes there; a lost instance sends it back.
    S.PREFILLING: frozenset({S.RUNNING, S.SWAPPED, S.FINISHED, S.QUEUED} | _ENDS),
    S.RUNNING: frozenset({S.SWAPPED, S.FINISHED, S.QUEUED} | _ENDS),
    S.SWAPPED: frozenset({S.RUNNING, S.QUEUED} | _ENDS),
    S.FINISHED: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset(),
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler sees it (token counts, no text)."""

    request_id: str
    model: str
    arrival_at: float
    prompt_tokens: int
    max_output_tokens: int
    status: RequestStatus = RequestStatus.QUEUED
    num_output_tokens: int = 0
    instance_id: str | None = None  # where its KV lives or will live
    kv_reserved_bytes: float = 0.0  # device KV the scheduler counted for it
    reason: str = ""  # why it ended, for FAILED/CANCELLED

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.num_output_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.max_output_tokens - self.num_output_tokens

    @property
    def done(self) -> bool:
        status = self.status  # TERMINAL by identity: read on every decision
        return status is FINISHED or status is CANCELLED or status is FAILED


def transition(request: Request, to: RequestStatus, reason: str = "") -> None:
    """Move `request` to `to`, checking the edge against ALLOWED."""
    if to not in ALLOWED[request.status]:
        raise IllegalTransition(f"request {request.request_id}: {request.status.value} -> {to.value} is not allowed")
    request.status = to
    if reason:
        request.reason = reason
