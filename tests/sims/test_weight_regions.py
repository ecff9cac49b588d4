"""Instances of one GPU whose engines map one weights region (`modelpool serve`'s torch engines when every model
fits once: pool.engines.shared_weights): a model one of them copied in is on the device for the others."""

from __future__ import annotations

import io
import json

import pytest

from scheduler import Request
from sims.simulator import Simulator
from tests.factories import LinearCosts, make_instances, make_models, make_scheduler

SWITCH = 0.5  # LinearCosts' weight copy


def _run(regions: dict[str, int] | None) -> tuple[Simulator, list[dict]]:
    models = make_models(3, weight_gb=2.0)
    instances = make_instances(2, roles=["prefill", "decode"])
    costs = LinearCosts()
    sched = make_scheduler("token-level", models, instances, costs)
    requests = [Request(f"r{k}", f"m{k % 3}", 3.0 * k, 300, 40) for k in range(6)]  # one at a time, each handed off
    log = io.StringIO()
    sim = Simulator(sched, costs, requests, kv_bytes_per_token={n: m.kv_bytes_per_token for n, m in models.items()},
                    plan_log=log, weight_capacity=getattr(sched, "weight_budgets", None),
                    weight_bytes={n: m.weight_bytes for n, m in models.items()}, weight_regions=regions)
    sim.run()
    return sim, [json.loads(line) for line in log.getvalue().splitlines()]


def _switches(plans: list[dict], instance: str) -> list[str]:
    return [a["model"] for p in plans for a in p["actions"].get(instance, []) if a["op"] == "Switch"]


def test_a_model_the_prefill_instance_copied_in_costs_the_decode_instance_nothing() -> None:
    apart, apart_plans = _run(None)
    shared, shared_plans = _run({"i0": 0, "i1": 0})
    assert _switches(apart_plans, "i1") == _switches(shared_plans, "i1") == ["m0", "m1", "m2", "m0", "m1", "m2"]
    # apart: each instance copies each model in once (the decode instance's slots hold two: m0 again too)
    assert apart.devices["i0"].num_weight_copies >= 3 and apart.devices["i1"].num_weight_copies >= 3
    assert shared.devices["i0"].num_weight_copies == apart.devices["i0"].num_weight_copies
    assert shared.devices["i1"].num_weight_copies == 0  # every model it switched to was in the region already
    assert shared.devices["i1"].switch_s == 0.0 < apart.devices["i1"].switch_s
    for rid, record in shared.records.items():  # its requests end sooner by what the copies took
        assert record.first_token_at == pytest.approx(apart.records[rid].first_token_at)
        assert record.finished_at <= apart.records[rid].finished_at
    assert sum(apart.records[r].finished_at - shared.records[r].finished_at for r in shared.records) == pytest.approx(
        apart.devices["i1"].switch_s, rel=0.01)


def test_a_copy_still_under_way_is_waited_for_not_made_again() -> None:
    from scheduler.plan import Prefetch, Switch

    sim, _ = _run({"i0": 0, "i1": 0, "i2": 1})
    sim._region_ready.clear()
    for dev in sim.devices.values():
        dev.slots.resident, dev.slots.cached, dev.slots.active = set(), {}, None
    copies = {iid: sim.device(iid).num_weight_copies for iid in ("i0", "i1", "i2")}
    assert sim._switch("i0", sim.device("i0"), Switch("m0", "t"), 10.0) == pytest.approx(10.0 + SWITCH)  # a copy
    assert sim._switch("i1", sim.device("i1"), Switch("m0", "t"), 10.2) == pytest.approx(10.0 + SWITCH)  # its rest
    assert sim._switch("i2", sim.device("i2"), Switch("m0", "t"), 10.2) == pytest.approx(10.2 + SWITCH)  # other GPU
    sim._prefetch("i1", sim.device("i1"), Prefetch("m1", "t"), 11.0)  # a prefetch copies it into the region
    assert sim._switch("i0", sim.device("i0"), Switch("m1", "t"), 11.1) == pytest.approx(11.0 + SWITCH)
    assert {iid: sim.device(iid).num_weight_copies - n for iid, n in copies.items()} == {"i0": 1, "i1": 1, "i2": 1}
