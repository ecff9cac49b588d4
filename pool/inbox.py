"""What other threads tell the live pool's loop: typed messages on one queue (`LivePool._inbox`).

`LivePool.submit`/`cancel` (the gateway's threads), a restart thread
(`pool.restarts`) and `stop()` put them; the loop thread alone takes them
(`LivePool._drain`), between ticks, so the controller is touched by one thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pool.runner import LiveRequest


@dataclass(frozen=True, slots=True)
class Submit:
    """A request admitted by `LivePool.submit`; the loop stamps its arrival and hands it to the controller."""

    request: LiveRequest


@dataclass(frozen=True, slots=True)
class Cancel:
    """A request its client (or `abort_all`) ended: its KV is freed at the next step boundary."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Restored:
    """A restart thread's outcome for a lost instance: its fresh engine, worker or actor - or the exception
    that ended the restart."""

    instance_id: str
    replacement: Any


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do but look again (`stop()`: the loop sees the pool is stopping)."""


InboxMessage = Submit | Cancel | Restored | Wake
