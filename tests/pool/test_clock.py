"""Both clocks satisfy the scheduler's Clock protocol; the manual one never goes back."""

from __future__ import annotations

import pytest

from pool.clock import MonotonicClock
from scheduler import Clock, ManualClock


def test_monotonic_clock_moves_forward_only() -> None:
    clock: Clock = MonotonicClock()
    readings = [clock.now() for _ in range(1000)]
    assert readings == sorted(readings) and readings[0] >= 0.0


def test_manual_clock_moves_when_told() -> None:
    clock: Clock = ManualClock(5.0)
    assert clock.now() == 5.0
    assert isinstance(clock, ManualClock) and clock.advance(1.5) == 6.5
    clock.set(7.0)
    assert clock.now() == 7.0
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)
    with pytest.raises(ValueError, match="back from 7.0"):
        clock.set(6.0)
