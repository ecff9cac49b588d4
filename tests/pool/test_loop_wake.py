"""An arrival is planned while another engine call runs: `LivePool.submit` wakes the loop's wait for engine
answers (`backend.wake`), which otherwise lasts until that call answers or `poll_s` passes."""

from __future__ import annotations

import time

import pytest

from benchmarks.admit_busy import first_tokens
from pool.backends import WAKE, take_done

STEP_S = 1.5  # each decode step of the sim engine: a long engine call the second request arrives during


@pytest.mark.slow
def test_a_request_arriving_during_a_long_engine_call_is_planned_at_once() -> None:
    # one request 0.2 s into another's decode step of STEP_S on the other instance; the poll timeout longer still
    woken, = first_tokens(True, STEP_S, probes=1, gap_s=(0.2, 0.2), poll_s=10.0)
    assert woken < STEP_S / 3  # its prefill (5 ms of sim time) on the idle instance, not after the step
    unwoken, = first_tokens(False, STEP_S, probes=1, gap_s=(0.2, 0.2), poll_s=10.0)
    assert unwoken > STEP_S / 3  # without the wake it waits for the running call's answer: what the wake removes


def test_take_done_drops_wakes_and_returns_at_one() -> None:
    import queue

    done: queue.SimpleQueue = queue.SimpleQueue()
    started = time.monotonic()
    done.put(WAKE)
    assert take_done(done, 10.0) == [] and time.monotonic() - started < 5  # a wake ends the wait, answers nothing
    done.put((3, "c"))
    done.put(WAKE)
    done.put((1, "a"))
    assert take_done(done, 10.0) == [(1, "a"), (3, "c")]  # answers around a wake, oldest call first
