"""A failing engine call writes its instance off; its requests resume elsewhere with the same tokens."""

from __future__ import annotations

from pathlib import Path

from pool.actor import make_engine
from pool.backends import InProcessBackend
from pool.controller import Controller
from pool.engines.base import SamplingParams
from pool.runner import LiveRequest
from pool.service import served_model, slot_instances
from scheduler import ManualClock, RequestStatus, make_scheduler
from tests.factories import LinearCosts
from tests.pool.test_live_pool import ENGINE, KV_BYTES, MODELS, NEW_TOKENS, PROMPTS, Collector, reference, tiny  # noqa: F401


class Flaky:
    """An engine that raises on its `fail_at`-th decode step, as a crashed device would."""

    def __init__(self, engine, fail_at: int) -> None:
        self.engine, self.fail_at, self.steps = engine, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def decode_step(self, ids):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("device fell off the bus")
        return self.engine.decode_step(ids)


def drive(controller: Controller, backend: InProcessBackend, clock: ManualClock, sinks, limit: int = 20000) -> None:
    for _ in range(limit):
        if all(s.done.is_set() for s in sinks.values()):
            return
        clock.advance(0.001)
        for handle, result in backend.poll(0.0):
            controller.complete(handle, result)
        controller.tick()
    raise AssertionError(f"requests did not finish: {[k for k, s in sinks.items() if not s.done.is_set()]}")


def test_instance_lost_mid_decode_requests_resume_elsewhere(tiny, reference) -> None:  # noqa: F811
    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    engines = {}
    for iid in ("slot0", "slot1"):
        engine = make_engine(ENGINE)
        for m in models:
            engine.load(m.name, m.path)
        engines[iid] = engine
    engines["slot0"] = Flaky(engines["slot0"], fail_at=4)
    backend = InProcessBackend(engines)
    clock = ManualClock()
    scheduler = make_scheduler("request-level", {m.name: m.profile for m in models}, slot_instances(2, models, KV_BYTES),
                               LinearCosts())
    controller = Controller(scheduler, backend, clock, ["slot0", "slot1"])
    sinks = {}
    for name in MODELS:
        for k, prompt in enumerate(PROMPTS):
            sinks[(name, k)] = Collector()
            controller.submit(LiveRequest(f"{name}-{k}", name, list(prompt),
                                          SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), clock.now(),
                                          sink=sinks[(name, k)]))
    controller.tick()
    drive(controller, backend, clock, sinks)
    assert controller.lost == {"slot0"}
    assert all(r.status is RequestStatus.FINISHED for r in scheduler.requests.values())
    for key, sink in sinks.items():  # every token exactly once, equal to an uninterrupted run
        assert sink.error is None and sink.tokens == reference[key], key
    resumed = [r for r in scheduler.requests.values() if r.reason == "engine call failed: RuntimeError('device fell off the bus')"]
    assert resumed, "the lost instance held requests that had to resume elsewhere"
