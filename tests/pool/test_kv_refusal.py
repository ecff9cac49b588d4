"""An engine that finds no room for KV refuses (`OutOfKvMemory`); the pool keeps the instance and sends its
requests back to the queue, and they finish with the tokens of an uninterrupted run - never an instance loss."""

from __future__ import annotations

import pytest

from pool.backends import InProcessBackend
from pool.controller import Controller
from pool.errors import RequestFailed
from pool.engines.base import OutOfKvMemory, SamplingParams
from pool.engines.sim_engine import SimEngine
from pool.runner import LiveRequest
from scheduler import InstanceSpec, ManualClock, ModelProfile, RequestStatus, make_scheduler
from tests.factories import LinearCosts
from tests.pool.test_faults import drive, in_process
from tests.pool.test_live_pool import Collector, reference, tiny  # noqa: F401


@pytest.mark.parametrize("policy, roles, method, refuse_at", [
    ("request-level", None, "decode_step", 4),  # mid-turn: tokens out already, KV on the device
    ("request-level", None, "prefill", 2),
    ("token-level", ["prefill", "decode"], "import_kv", 1),  # the decoder's host memory has no room for a hand-off
    ("token-level", ["prefill", "decode"], "restore_kv", 1),  # the decoder's device has no room for a swap-in
])
def test_a_refusal_requeues_the_instances_requests_and_keeps_it(tiny, reference, policy, roles, method,  # noqa: F811
                                                                refuse_at) -> None:
    target = "slot1" if method in ("restore_kv", "import_kv") else "slot0"
    options = {"fixed_turn_steps": 3} if policy == "token-level" else {}
    refusal = OutOfKvMemory("need 3 KV blocks; 1 free (a test's refusal)")
    controller, backend, clock, scheduler, sinks = in_process(
        tiny, {"fail_at": refuse_at, "method": method, "error": refusal}, policy, roles, flaky_slot=target, **options)
    engines = backend.engines
    drive(controller, backend, clock, sinks)
    assert engines[target].calls >= refuse_at, "the refusal happened"
    assert controller.num_kv_refusals == 1 and not controller.lost
    requeued = [r for r in scheduler.requests.values() if "a test's refusal" in r.reason]
    assert requeued, "the refused instance's requests went back to the queue"
    for key, sink in sinks.items():  # every token exactly once, equal to an uninterrupted run
        assert sink.error is None and sink.tokens == reference[key] and not sink.after_end, key
    assert all(r.status is RequestStatus.FINISHED for r in scheduler.requests.values())
    for engine in engines.values():  # nothing left behind in any engine
        stats = engine.stats()
        assert stats.num_requests == 0 and stats.kv_device_used_bytes == 0 and stats.kv_host_used_bytes == 0


def test_kv_the_engine_never_has_ends_the_requests_cleanly_not_the_instance() -> None:
    """A scheduler told more KV than the engine holds (the bug `plan_kv` removes) meets a refusal every time it
    admits too much: the requests end with RequestFailed after `max_refusals_per_request`, the instance stays."""
    profiles = {"m": ModelProfile("m", 1, 1e6, 1000, 4096, 10.0, 0.1)}
    engine = SimEngine(LinearCosts(), kv_bytes=30_000, time_scale=0, kv_bytes_per_token={"m": 1000})
    engine.load("m")
    backend, clock = InProcessBackend({"i0": engine}), ManualClock()
    scheduler = make_scheduler("request-level", profiles, [InstanceSpec("i0", 1, 1e9, kv_bytes=300_000.0)],
                               LinearCosts())
    controller = Controller(scheduler, backend, clock, ["i0"], max_refusals_per_request=3)
    sinks = {}
    for k in range(4):  # 20 tokens each; the engine holds one request (30 tokens), the scheduler thinks 15
        sinks[k] = Collector()
        controller.submit(LiveRequest(f"r{k}", "m", [1] * 10, SamplingParams(max_tokens=10, ignore_eos=True),
                                      clock.now(), sink=sinks[k]))
    drive(controller, backend, clock, sinks)
    assert not controller.lost and controller.num_kv_refusals >= 3
    failed = [k for k, s in sinks.items() if s.error is not None]
    assert failed and all(isinstance(sinks[k].error, RequestFailed) and "refused 3 times" in str(sinks[k].error)
                          for k in failed)
    assert all(not s.after_end for s in sinks.values())
    assert engine.stats().num_requests == 0
