"""A hung instance - alive, but its engine calls never answer (a stuck kernel or collective) - is written off
after `call_timeout_s`, like a dead one: its requests resume elsewhere (or on its restarted actor) with the
uninterrupted greedy tokens, and an answer that comes too late is ignored.

On the processes backend an engine process beats from a thread of its own (`pool.procs`): one that stops
(SIGSTOP) in the middle of decoding is written off within `heartbeat_timeout_s` (5 s), with `call_timeout_s` at
its 300 s default, and killed at once; one whose call is slow while the process lives is left alone."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pool.actor import EngineSpec
from pool.config import PoolConfig
from pool.controller import Controller
from pool.engines.base import SamplingParams
from pool.service import LivePool, slot_instances
from scheduler import ManualClock, RequestStatus
from tests.pool.fault_tools import NOTHING, Sink, allocated, homes, outcomes, wait_until
from tests.pool.test_faults import LONG_TOKENS, drive, in_process, long_reference, ray_cluster, ray_pool, submit_all  # noqa: F401
from tests.pool.test_health import alive
from tests.pool.test_processes import local_pool
from tests.pool.test_live_pool import reference, tiny  # noqa: F401
from tests.factories import LinearCosts
from tests.pool.sim_gateway import sim_models


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
    Its beats stop (`pool.actor.beat_to_gcs`): within seconds, with call_timeout_s at its 300 s default, the
    instance is written off, the frozen actor killed and a fresh one started; every request finishes with its
    uninterrupted tokens."""
    import ray

    with ray_pool(tiny, 2, max_restarts=1) as pool:
        assert pool.config.call_timeout_s == 300.0 and pool.config.heartbeat_timeout_s == 5.0
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
        stopped_at = time.monotonic()
        try:
            wait_until(lambda: pool.restarts.num_restarts[frozen] >= 1, 30, f"{frozen} written off")
            found = time.monotonic() - stopped_at
            result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 120)
            counts = result.counts()
            print(f"\nhung actor: froze {frozen}, written off after {found:.1f} s; outcomes {counts}, "
                  f"restarts {pool.status()['restarts']}")
            assert found < 15, f"written off after {found:.1f} s: the heartbeat, not the call timeout"
            assert counts["identical"] == len(sinks), result
            wait_until(lambda: pool.status()["restarts"] == 1 and pool.status()["lost_instances"] == [], 60,
                       f"{frozen} restarted: {pool.status()}")
            wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")
        finally:
            try:  # the restart killed the frozen process; make sure of it
                os.kill(pids[frozen], signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_heartbeat_interval_must_be_below_its_deadline() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        PoolConfig(heartbeat_timeout_s=1.0, heartbeat_interval_s=1.0)
    PoolConfig(heartbeat_timeout_s=None, heartbeat_interval_s=10.0)  # no deadline: any interval


def test_a_stopped_engine_process_mid_decode_is_written_off_within_seconds(tiny, long_reference) -> None:  # noqa: F811
    """Processes backend, the defaults (heartbeat 5 s, call timeout 300 s): the process of an instance decoding
    requests of two models is stopped (SIGSTOP: alive, silent, in the middle of its calls). Its missed beats
    write it off within seconds, its requests resume on the other instance (or on its replacement) with the
    tokens of an uninterrupted run, and the stopped process is killed at once, not after a grace."""
    with local_pool(tiny, "processes", 2, max_restarts=1) as pool:
        assert pool.config.call_timeout_s == 300.0 and pool.config.heartbeat_timeout_s == 5.0
        pids = {iid: worker.process.pid for iid, worker in pool._backend.workers.items()}
        sinks = submit_all(pool)

        def victim() -> str | None:
            by_instance: dict[str, set[str]] = {}
            for home, model, produced in homes(pool).values():
                if 1 <= produced < LONG_TOKENS - 16:
                    by_instance.setdefault(home, set()).add(model)
            return next((iid for iid, models in sorted(by_instance.items()) if len(models) >= 2), None)

        wait_until(lambda: victim() is not None, 120, "an instance decoding requests of two models")
        frozen = victim()
        assert frozen is not None
        os.kill(pids[frozen], signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_until(lambda: pool.restarts.num_restarts[frozen] >= 1, 30, f"{frozen} written off")
            found = time.monotonic() - stopped_at
            wait_until(lambda: not alive(pids[frozen]), 15, f"the stopped process of {frozen} killed")
            killed = time.monotonic() - stopped_at
            result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 180)
            counts = result.counts()
            print(f"\nstopped mid-decode: {frozen} written off after {found:.1f} s (heartbeat 5 s, call timeout "
                  f"300 s), its process killed {killed - found:.1f} s later; outcomes {counts}")
            assert found < 15, f"written off after {found:.1f} s: the heartbeat, not the call timeout"
            assert pool.num_missed_heartbeats >= 1
            assert counts["identical"] == len(sinks), result
            wait_until(lambda: pool.status()["restarts"] == 1 and pool.status()["lost_instances"] == [], 120,
                       f"{frozen} restarted: {pool.status()}")
            wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")
        finally:
            if alive(pids[frozen]):
                os.kill(pids[frozen], signal.SIGKILL)


def test_a_slow_call_in_a_live_engine_process_is_not_written_off() -> None:
    """Processes backend, sim engines whose decode step sleeps 3 s - three times the 1 s heartbeat deadline:
    the calls are slow, the processes alive (beating), and nothing is written off; the request finishes."""
    costs = LinearCosts(step_s=3.0, prefill_per_token_s=1e-5, switch_s=0.01)
    models = sim_models(["alpha"])
    instances = slot_instances(2, models, 64 << 20)
    spec = EngineSpec("sim", {"costs": costs, "kv_bytes": int(instances[0].memory_bytes),
                              "kv_bytes_per_token": {m.name: m.profile.kv_bytes_per_token for m in models}})
    config = PoolConfig(engine=spec, backend="processes", stats_interval_s=0.2, heartbeat_timeout_s=1.0,
                        heartbeat_interval_s=0.25)
    with LivePool(models, instances, "token-level", costs, config) as pool:
        sink = Sink()
        started = time.monotonic()
        pool.submit("slow", "alpha", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), sink)
        assert sink.done.wait(120), "the slow request did not finish"
        took = time.monotonic() - started
        print(f"\nslow calls: 3 tokens in {took:.1f} s (decode steps of 3 s, heartbeat deadline 1 s); "
              f"missed heartbeats {pool.num_missed_heartbeats}")
        assert sink.error is None and len(sink.tokens) == 3
        assert took >= 6.0, "two decode steps of 3 s each: each call outlived the heartbeat deadline"
        assert pool.num_missed_heartbeats == 0 and pool.status()["restarts"] == 0
        assert pool.status()["lost_instances"] == []


def test_a_missed_heartbeat_counts_against_the_running_calls_requests(tiny) -> None:  # noqa: F811
    """`write_off_hung` (a missed heartbeat) loses the instance at once with the requests of its oldest call in
    flight (the one it is running) as the suspects, as a timed-out call would."""
    controller, backend, clock, scheduler, sinks = in_process(tiny, None, "request-level")
    hung = Unanswered(backend, "slot0", answered=0)
    controller.backend = hung
    for _ in range(20):
        clock.advance(0.001)
        for handle, result in hung.poll(0.0):
            controller.complete(handle, result)
        controller.tick()
        running = sorted((h, c) for h, c in controller._calls.items() if c.target == "slot0" and c.request_ids)
        if running:
            break
    assert running, "a call carrying requests in flight on slot0"
    first = min((h, c) for h, c in controller._calls.items() if c.target == "slot0")[1]
    assert first.request_ids, f"slot0 runs a call that carries requests: {first}"
    controller.write_off_hung("slot0", "no heartbeat (test)")
    assert controller.lost == {"slot0"}
    assert set(controller._losses) == set(first.request_ids)
