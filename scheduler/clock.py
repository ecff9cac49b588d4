"""Time as a parameter: the Clock protocol and a manual clock for tests and parity.

The scheduler never reads a clock; its callers do and pass `now`. The wall
clock (`pool.clock.MonotonicClock`) lives in the live pool because reading
time is I/O as far as this package is concerned.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock's time line."""
        ...


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds} s")
        self._now += seconds
        return self._now

    def set(self, at: float) -> None:
        if at < self._now:
            raise ValueError(f"cannot move a clock back from {self._now} to {at}")
        self._now = at
