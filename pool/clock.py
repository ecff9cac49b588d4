"""The wall clock the live controller passes to the scheduler as `now`."""

from __future__ import annotations

import time


class MonotonicClock:
    """Seconds since this clock was made, from `time.monotonic` (never jumps back)."""

    def __init__(self) -> None:
        self._origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._origin
