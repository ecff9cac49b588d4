"""Restarts: a rebuild that raises is tried again while its instance has restarts left, as one more restart."""

from __future__ import annotations

import queue

from pool.restarts import Restarts


def restarts(outcomes: list, max_restarts: int) -> tuple[Restarts, queue.SimpleQueue, list]:
    """Restarts whose k-th build returns (or raises) outcomes[k]; the deliveries land in the queue."""
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    calls: list[str] = []

    def build(instance_id: str) -> str:
        outcome = outcomes[len(calls)]
        calls.append(instance_id)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return Restarts(build, lambda iid, what: delivered.put((iid, what)), max_restarts, retry_after_s=0.01), \
        delivered, calls


def test_a_failed_rebuild_is_tried_again_and_counts_as_a_restart() -> None:
    lost_node = RuntimeError("the actor died because its node has died")
    r, delivered, calls = restarts([lost_node, "fresh actor"], max_restarts=3)
    r.watch(["slot0"])
    assert delivered.get(timeout=10) == ("slot0", "fresh actor")
    assert calls == ["slot0", "slot0"] and r.num_restarts["slot0"] == 2 and r.num_failed == 1
    r.done("slot0", True)
    assert not r.pending and not r.given_up


def test_rebuilds_stop_at_max_restarts_and_the_last_error_is_delivered() -> None:
    errors = [RuntimeError(f"attempt {k}") for k in range(5)]
    r, delivered, calls = restarts(errors, max_restarts=3)
    r.watch(["slot0"])
    instance_id, what = delivered.get(timeout=10)
    assert instance_id == "slot0" and what is errors[2] and len(calls) == 3 and r.num_restarts["slot0"] == 3
    r.done("slot0", False)
    r.watch(["slot0"])  # given up: no fourth attempt
    assert r.given_up == {"slot0"} and len(calls) == 3 and delivered.empty()


def test_the_restart_budget_refills_over_its_window_with_backoff_between_restarts() -> None:
    """Ray Serve / Kubernetes style: at most max_restarts within any window, each after a growing back-off; an
    instance out of budget comes back once its oldest restart has left the window (a fixed budget for the
    server's life left an engine with none after a long soak)."""
    now = [0.0]
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    r = Restarts(lambda iid: f"engine of {iid}", lambda iid, what: delivered.put((iid, what)), max_restarts=3,
                 window_s=100.0, backoff_s=0.01, max_backoff_s=0.02, clock=lambda: now[0])
    for k in range(3):
        now[0] += 1.0
        r.watch(["slot0"])
        assert delivered.get(timeout=10) == ("slot0", "engine of slot0")
        r.done("slot0", True)
    assert r.waited_s == [0.0, 0.01, 0.02]  # none, then doubling, capped
    now[0] += 1.0
    r.watch(["slot0"])  # a fourth loss within the window: no budget
    assert r.given_up == {"slot0"} and r.budget_left("slot0") == 0 and delivered.empty()
    now[0] = 101.5  # the first restart (at 1 s) has left the window
    r.watch(["slot0"])
    assert delivered.get(timeout=10) == ("slot0", "engine of slot0") and "slot0" not in r.given_up
    assert r.num_restarts["slot0"] == 4


def test_no_retry_once_the_pool_stopped() -> None:
    r, delivered, calls = restarts([RuntimeError("no room"), "never built"], max_restarts=3)
    r.close()
    r.watch(["slot0"])
    instance_id, what = delivered.get(timeout=10)
    assert isinstance(what, RuntimeError) and calls == ["slot0"]


def test_a_retired_worker_process_reports_itself_gone() -> None:
    """The pool's restart waits on retire() and warns when it answers False ("still in a call")."""
    from pool.actor import EngineSpec
    from pool.procs import ProcessBackend, start_workers
    from tests.factories import LinearCosts

    backend = ProcessBackend(start_workers({"w0": EngineSpec("sim", {"costs": LinearCosts(), "time_scale": 0})}, {},
                                           timeout_s=60))
    process = backend.workers["w0"].process
    assert process.is_alive()
    assert backend.retire("w0", timeout_s=10) is True and not process.is_alive()
