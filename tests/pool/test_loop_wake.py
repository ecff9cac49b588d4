"""An arrival is planned while another engine call runs: `LivePool.submit` wakes the loop's wait for engine
answers (`backend.wake`), which otherwise lasts until that call answers or `poll_s` passes."""

from __future__ import annotations

import threading
import time

import pytest

from pool.backends import WAKE, take_done
from pool.engines.base import SamplingParams
from tests.factories import LinearCosts
from tests.pool.sim_gateway import sim_pool

STEP_S = 1.5  # each decode step of the sim engine: a long engine call the second request arrives during


def _first_token_s(pool, request_id: str, model: str) -> float:
    """Seconds from submit to the request's first token."""
    first = threading.Event()
    pool.submit(request_id, model, [1, 2, 3], SamplingParams(max_tokens=1), lambda item: first.set())
    started = time.monotonic()
    assert first.wait(30), f"{request_id}: no token in 30 s"
    return time.monotonic() - started


def _during_a_long_step(woken: bool) -> float:
    """A request's first-token time while another request's decode step (STEP_S) runs on the other instance,
    the loop's poll timeout longer than that step."""
    pool = sim_pool(num_instances=2, costs=LinearCosts(step_s=STEP_S, prefill_per_token_s=1e-5, switch_s=0.0),
                    poll_s=10.0)
    if not woken:
        pool._wake = lambda: None  # type: ignore[method-assign]  # the loop as it was: no wake on submit
    pool.start()
    try:
        streaming = threading.Event()
        pool.submit("long", "alpha", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True),
                    lambda item: streaming.set())
        assert streaming.wait(30)  # its first token is out: its decode steps run now, one call of STEP_S each
        time.sleep(0.2)  # well inside a step
        return _first_token_s(pool, "short", "beta")
    finally:
        pool.stop()


@pytest.mark.slow
def test_a_request_arriving_during_a_long_engine_call_is_planned_at_once() -> None:
    woken = _during_a_long_step(woken=True)
    assert woken < STEP_S / 3  # its prefill (5 ms of sim time) on the idle instance, not after the step
    unwoken = _during_a_long_step(woken=False)
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
