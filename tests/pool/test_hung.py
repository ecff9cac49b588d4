"""A hung instance - alive, but its engine calls never answer (a stuck kernel or collective) - is written off
after `call_timeout_s`, like a dead one: its requests resume elsewhere (or on its restarted actor) with the
uninterrupted greedy tokens, and an answer that comes too late is ignored."""

from __future__ import annotations

import os
import signal

import pytest

from pool.controller import Controller
from scheduler import ManualClock, RequestStatus
from tests.pool.fault_tools import NOTHING, allocated, homes, outcomes, wait_until
from tests.pool.test_faults import LONG_TOKENS, drive, in_process, long_reference, ray_cluster, ray_pool, submit_all  # noqa: F401
from tests.pool.test_live_pool import reference, tiny  # noqa: F401


class Unanswered:
    """A backend that stops answering `instance_id` after its first `answered` calls: the calls are taken (and
    run), their results never come back - what the controller sees of a hung actor."""

    def __init__(self, backend, instance_id: str, answered: int) -> None:
        self.backend, self.instance_id, self.answered = backend, instance_id, answered
        self.num_calls = 0
        self.hung: set[int] = set()
        self.withheld: list[tuple[int, object]] = []

    def call(self, instance_id, call) -> int:
        handle = self.backend.call(instance_id, call)
        if instance_id == self.instance_id:
            self.num_calls += 1
            if self.num_calls > self.answered:
                self.hung.add(handle)
        return handle

    def poll(self, timeout_s: float):
        out = []
        for handle, result in self.backend.poll(timeout_s):
            (self.withheld if handle in self.hung else out).append((handle, result))
        return out


def test_controller_writes_off_an_instance_whose_call_never_answers(tiny, reference) -> None:  # noqa: F811
    controller, backend, clock, scheduler, sinks = in_process(tiny, None, "request-level")
    hung = Unanswered(backend, "slot0", answered=3)
    controller.backend, controller.call_timeout_s = hung, 0.5
    assert isinstance(clock, ManualClock)
    drive(controller, hung, clock, sinks)
    assert controller.lost == {"slot0"}
    for key, sink in sinks.items():  # every token exactly once, equal to an uninterrupted run
        assert sink.error is None and sink.tokens == reference[key] and not sink.after_end, key
    assert all(r.status is RequestStatus.FINISHED for r in scheduler.requests.values())
    resumed = [r for r in scheduler.requests.values() if "slot0 did not answer" in r.reason]
    assert resumed, "the hung instance held requests that had to resume elsewhere"
    # the hung calls' answers, arriving now, change nothing
    assert hung.withheld and not any(controller.complete(handle, result) for handle, result in hung.withheld)
    assert all(not sink.after_end for sink in sinks.values())


def test_call_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="call_timeout_s must be > 0"):
        Controller(None, None, ManualClock(), [], call_timeout_s=0.0)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_frozen_ray_actor_is_written_off_restarted_and_its_requests_resume(tiny, long_reference,  # noqa: F811
                                                                            ray_cluster) -> None:
    """Real Ray: the process of an actor that holds part-decoded requests is stopped (SIGSTOP: alive, silent).
    After call_timeout_s the instance is written off, the frozen actor killed and a fresh one started; every
    request finishes with its uninterrupted tokens."""
    import ray

    with ray_pool(tiny, 2, call_timeout_s=3.0, max_restarts=1) as pool:
        pids = {iid: ray.get(actor.__ray_call__.remote(lambda actor: os.getpid()))
                for iid, actor in pool._actors.items()}  # asked before: a frozen actor answers nothing
        sinks = submit_all(pool)

        def victim() -> str | None:
            by_instance: dict[str, set[str]] = {}
            for home, model, produced in homes(pool).values():
                if 1 <= produced < LONG_TOKENS - 4:
                    by_instance.setdefault(home, set()).add(model)
            return next((iid for iid, models in sorted(by_instance.items()) if len(models) >= 2), None)

        wait_until(lambda: victim() is not None, 60, "an instance decoding requests of two models")
        frozen = victim()
        assert frozen is not None
        os.kill(pids[frozen], signal.SIGSTOP)
        try:
            result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 120)
            counts = result.counts()
            print(f"\nhung actor: froze {frozen}; outcomes {counts}, restarts {pool.status()['restarts']}")
            assert counts["identical"] == len(sinks), result
            wait_until(lambda: pool.status()["restarts"] == 1 and pool.status()["lost_instances"] == [], 60,
                       f"{frozen} restarted: {pool.status()}")
            wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")
        finally:
            try:  # the restart killed the frozen process; make sure of it
                os.kill(pids[frozen], signal.SIGKILL)
            except ProcessLookupError:
                pass
