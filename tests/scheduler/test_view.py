"""The Scheduler Protocol's read-only view: what it shows after each step, and that it is a frozen copy."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import InstanceView, RequestStatus, RequestView, StepDone, SwitchDone, make_scheduler
from tests.factories import GB, LinearCosts, make_instances, make_models, make_request


def test_the_view_follows_a_request_from_queue_to_device_to_done() -> None:
    models = make_models(2, weight_gb=14.0, kv_per_token=1000)
    sched = make_scheduler("request-level", models, make_instances(1, memory_gb=80.0), LinearCosts())
    sched.submit(make_request("a", "m0", 0.0, prompt_tokens=100, max_output_tokens=20), 0.0)
    before = sched.view()
    assert before.policy == "request-level" and before.queued == {"m0": 1, "m1": 0}
    assert before.model_tp == {"m0": 1, "m1": 1}
    assert before.instances["i0"] == InstanceView("i0", "mixed", 1, None, None, (), False, 0.0, 66 * GB, 0)
    assert sched.request_view("a") == RequestView("a", "m0", RequestStatus.QUEUED, None, 0.0)

    plan = sched.schedule(0.0)
    after = sched.view()
    inst = after.instances["i0"]
    assert inst.inflight == plan.actions["i0"] and inst.busy  # the Switch and the Prefill, in flight
    assert inst.active_model == "m0" and inst.kv_used_bytes == 120 * 1000 and inst.num_requests_on_device == 1
    assert after.queued["m0"] == 0
    assert sched.request_view("a") == RequestView("a", "m0", RequestStatus.PREFILLING, "i0", 120 * 1000)
    assert before.instances["i0"].inflight == () and before.queued["m0"] == 1  # a view taken earlier stays

    sched.on_event(SwitchDone("i0", "m0"), 0.5)
    sched.on_event(StepDone("i0", "prefill", ("a",), 20, ("a",)), 0.6)
    done = sched.view().instances["i0"]
    assert not done.busy and done.kv_used_bytes == 0.0 and done.num_requests_on_device == 0
    assert sched.request_view("a").status is RequestStatus.FINISHED  # type: ignore[union-attr]
    assert sched.request_view("nobody") is None


def test_views_are_frozen_copies() -> None:
    sched = make_scheduler("token-level", make_models(1), make_instances(2, roles=["prefill", "decode"]),
                           LinearCosts())
    view = sched.view()
    assert [i.role for i in view.instances.values()] == ["prefill", "decode"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.instances["i0"].lost = True  # type: ignore[misc]
    view.queued["m0"] = 5  # type: ignore[index]  # a copy: the scheduler's queues are untouched
    assert sched.view().queued == {"m0": 0}
