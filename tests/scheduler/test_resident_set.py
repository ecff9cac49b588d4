"""token-level's memory plan and resident set (scheduler.policies.token_weights) and the operator controls
(pin, preload, idle TTL, priority) it honours - checked on the Plans it makes and on simulator runs, whose
executor refuses held weights over the planned budget and compute on a model that is not resident."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpool.config import FleetFileError, load_fleet
from scheduler import InstanceSpec, Prefetch, StepDone, Switch, SwitchDone, make_scheduler
from scheduler.fleet import GB
from scheduler.policies.token_weights import ResidentSet, decode_kv_load_bytes, plan_memory
from tests.factories import LinearCosts, make_instances, make_models, make_request, make_workload, run_sim


def _loaded(models: dict, prompt: float = 400.0, output: float = 200.0) -> dict:
    return {n: dataclasses.replace(m, mean_prompt_tokens=prompt, mean_output_tokens=output) for n, m in models.items()}


def test_the_kv_weights_split_is_planned_from_the_load() -> None:
    models = list(_loaded(make_models(3, weight_gb=4.0, rates=[2.0, 1.0, 1.0])).values())
    # Little's law at the TPOT SLO pace: 4 req/s x 200 tokens x 0.1 s = 80 requests over 2 decode instances
    count = 40.0
    expected = (count + 3 * math.sqrt(count)) * 57344 * 600
    assert decode_kv_load_bytes(models, num_decode=2) == pytest.approx(expected)
    decode = plan_memory(InstanceSpec("d", 1, 80 * GB, "decode"), models, 2, 8192)
    floor = 57344 * 32768  # the longest request a model allows
    assert decode.kv_bytes >= max(expected, floor) and decode.kv_bytes + decode.weight_bytes == pytest.approx(80 * GB)
    assert decode.weight_bytes == pytest.approx(12 * GB)  # every model fits: the bytes no model uses go to KV
    prefill = plan_memory(InstanceSpec("p", 1, 80 * GB, "prefill"), models, 2, 8192)
    assert prefill.kv_bytes == pytest.approx(80 * GB - 12 * GB)
    # a big class: KV is what the load needs (at least the floor), weights the models that fit in the rest
    big = list(_loaded(make_models(4, weight_gb=30.0, rates=[1.0] * 4)).values())
    plan = plan_memory(InstanceSpec("d", 1, 80 * GB, "decode"), big, 2, 8192)
    assert plan.weight_bytes == pytest.approx(60 * GB) and plan.kv_bytes == pytest.approx(20 * GB)
    # no load figures: the engines' two slots of the largest model
    bare = plan_memory(InstanceSpec("d", 1, 80 * GB, "decode"), list(make_models(2, weight_gb=30.0).values()), 1, 8192)
    assert bare.weight_bytes == pytest.approx(60 * GB) and "two slots" in bare.why
    # an engine that reports its KV region keeps it; the weights get what it reports, or the rest
    live = plan_memory(InstanceSpec("d", 1, 80 * GB, "decode", kv_bytes=50 * GB), big, 2, 8192)
    assert (live.kv_bytes, live.weight_bytes) == (50 * GB, 30 * GB)


def test_eviction_keeps_what_is_worth_most_and_never_what_is_needed_soon() -> None:
    sizes = {"a": 4.0, "b": 4.0, "c": 4.0, "d": 4.0}
    worth = {"a": 1.0, "b": 5.0, "c": 3.0, "d": 9.0}.__getitem__
    held = ResidentSet(12.0, sizes, pinned=("a",))
    for t, m in enumerate("abc"):
        held.add(m, t, (), worth)
    assert held.would_evict("d", (), worth) == ["c"]  # "a" is pinned, "b" is worth more than "c"
    assert held.would_evict("d", ("c",), worth) == ["b"]  # "c" is needed soon
    assert held.add("d", 9, (), worth) == ("a", "b") and held.used_bytes() <= 12.0
    assert held.add("c", 10, (), worth, expired=("b",)) == ("a", "d")  # idle past its TTL: freed though room is left


def test_a_switch_back_to_a_resident_model_is_free_and_small_models_all_stay() -> None:
    models = _loaded(make_models(4, weight_gb=3.0, rates=[0.5] * 4))
    log = io.StringIO()
    sim, sched = run_sim("token-level", models, make_instances(2, roles=("prefill", "decode")),
                         make_workload(120, list(models), rate=2.0, seed=5), plan_log=log)
    assert all(r.finished_at is not None for r in sim.records.values())
    switches = [a for line in log.getvalue().splitlines() for acts in json.loads(line)["actions"].values()
                for a in acts if a["op"] == "Switch"]
    assert len(switches) > 8  # the models take turns (or join a joint decode turn) ...
    for dev in sim.devices.values():  # ... but each is copied in once per instance: later switches wait for no copy
        for waits in dev.switch_s_by_model.values():
            assert all(wait < 0.5 for wait in waits[1:]), dev.switch_s_by_model
    assert all(sim.devices[i].slots.held_bytes() <= sched.weight_budgets[i] * (1 + 1e-9) for i in sim.devices)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.floats(1.0, 30.0), min_size=2, max_size=6), st.integers(0, 10_000),
       st.sampled_from([("prefill", "decode"), ("prefill", "decode", "decode"), ("mixed", "mixed")]))
def test_several_resident_models_never_overflow_memory_and_every_request_ends_once(sizes, seed, roles) -> None:
    """The simulator refuses held weights over an instance's planned budget, KV over its planned KV and compute on
    a model that is not resident (InvariantViolation); the plan adds up to the instance's memory."""
    models = {f"m{k}": dataclasses.replace(m, weight_bytes=gb * GB)
              for k, (m, gb) in enumerate(zip(make_models(len(sizes), rates=[1.0] * len(sizes)).values(), sizes))}
    models = _loaded(models, 300.0, 60.0)
    sim, sched = run_sim("token-level", models, make_instances(len(roles), roles=roles),
                         make_workload(60, list(models), rate=3.0, seed=seed, max_prompt=1500, max_output=80))
    for iid, plan in sched.memory_plans.items():
        assert plan.kv_bytes + plan.weight_bytes == pytest.approx(80 * GB)
        assert sim.devices[iid].slots.held_bytes() <= plan.weight_bytes * (1 + 1e-9) if iid in sim.devices else True
    ended = [r for r in sim.records.values() if r.finished_at is not None or r.failed]
    assert len(ended) == len(sim.records) == 60
    assert all(r.generated == r.output_tokens for r in sim.records.values() if not r.failed)


def _controls(**fields) -> dict:
    models = _loaded(make_models(4, weight_gb=10.0, rates=[1.0, 1.0, 0.2, 0.2]))
    return {n: dataclasses.replace(m, **fields.get(n, {})) for n, m in models.items()}


def test_a_pinned_model_is_copied_in_at_start_and_never_leaves() -> None:
    models = _controls(m3={"pinned": True})
    log = io.StringIO()
    run_sim("token-level", models, make_instances(2, roles=("prefill", "decode"), memory_gb=50.0),
            make_workload(150, ["m0", "m1", "m2"], rate=3.0, seed=2), plan_log=log)
    plans = [json.loads(line)["actions"] for line in log.getvalue().splitlines()]
    assert {iid: acts[0]["model"] for iid, acts in plans[0].items()} == {"i0": "m3", "i1": "m3"}
    weight_changes = [a for p in plans for acts in p.values() for a in acts if a["op"] in ("Switch", "Prefetch")]
    assert len(weight_changes) > 10 and all(a["model"] == "m3" or "m3" in a["keep"] for a in weight_changes)


def test_pinned_models_that_crowd_out_the_others_are_refused() -> None:
    models = _controls(m0={"pinned": True}, m1={"pinned": True}, m2={"pinned": True})
    with pytest.raises(ValueError, match=r"pinned models \['m0', 'm1', 'm2'\].*pin fewer"):
        make_scheduler("token-level", models, make_instances(2, roles=("prefill", "decode"), memory_gb=35.0),
                       LinearCosts())


def test_preloaded_models_are_copied_in_at_start_where_they_fit() -> None:
    models = _controls(m2={"preload": True}, m3={"preload": True})
    sched = make_scheduler("token-level", models, make_instances(2, roles=("prefill", "decode"), memory_gb=80.0),
                           LinearCosts())
    plan = sched.schedule(0.0)
    assert {iid: [(type(a), a.model) for a in acts] for iid, acts in plan.actions.items()} == {
        iid: [(Prefetch, "m2"), (Prefetch, "m3")] for iid in ("i0", "i1")}


def test_a_model_idle_past_its_ttl_is_freed_at_the_next_weight_change() -> None:
    models = _controls(m0={"idle_ttl_s": 5.0})
    sched = make_scheduler("token-level", models, make_instances(2, roles=("prefill", "decode")), LinearCosts(),
                           first_tokens=1)

    def prefill_on_i0(rid: str, model: str, at: float) -> Switch:
        sched.submit(make_request(rid, model, at), at)
        change = sched.schedule(at).actions["i0"][0]
        sched.on_event(SwitchDone("i0", model), at + 0.1)
        sched.on_event(StepDone("i0", "prefill", (rid,), 1), at + 0.2)
        return change

    prefill_on_i0("a", "m0", 0.0)
    assert prefill_on_i0("b", "m1", 3.0).keep == ("m0",)  # m0 idle 3 s: kept beside m1
    change = prefill_on_i0("c", "m2", 9.0)  # m0 idle 9 s > 5 s: freed
    assert change.model == "m2" and change.keep == ("m1",) and "m0" not in sched.weights["i0"]


def test_a_high_priority_request_is_dispatched_ahead_of_an_earlier_normal_one() -> None:
    models = _controls(m1={"priority": 1})
    sched = make_scheduler("token-level", models, make_instances(2, roles=("prefill", "decode")), LinearCosts())
    sched.submit(make_request("early", "m0", 0.0), 0.0)
    sched.submit(make_request("urgent", "m1", 1.0), 1.0)  # within half m1's TTFT SLO (10 s) of the other
    sched.submit(make_request("late", "m2", 7.0), 7.0)  # past it: normal order
    plan = sched.schedule(7.0)
    prefill = [a for a in plan.actions["i0"] if type(a).__name__ == "Prefill"][0]
    assert prefill.request_ids == ("urgent",)
    assert [rid for g in sched.prefill.groups["i0"] for rid in g.ids] == ["early", "late"]


def test_the_fleet_file_carries_the_controls_and_rejects_a_pinned_model_with_a_ttl(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("models:\n  - {name: a, arch: qwen2.5-7b, pin: true}\n"
                    "  - {name: b, arch: qwen2.5-7b, preload: true, idle_ttl_s: 300, priority: high}\n")
    from scheduler import model_profiles
    profiles = model_profiles(load_fleet(path))
    assert profiles["a"].pinned and profiles["b"].preload and profiles["b"].idle_ttl_s == 300.0
    assert profiles["b"].priority == 1 and profiles["a"].priority == 0
    path.write_text("models:\n  - {name: a, arch: qwen2.5-7b, pin: true, idle_ttl_s: 60}\n")
    with pytest.raises(FleetFileError, match=r"fleet.yaml:2:\d+: models\[0\].*pin and idle_ttl_s"):
        load_fleet(path)


def test_resident_models_whose_members_fit_together_decode_in_one_joint_turn() -> None:
    """Two models' requests on one decode instance, both resident and their KV on the device: one Decode of all
    of them (the second model co-located, no quota turns); with joint turns off they take turns."""
    from scheduler import Decode, KvMoved

    def decode_after_handoff(joint: bool) -> list:
        models = _controls()
        sched = make_scheduler("token-level", models, make_instances(2, roles=("prefill", "decode")), LinearCosts(),
                               first_tokens=1, joint_turns=joint)
        for k, model in enumerate(("m0", "m1")):
            sched.submit(make_request(f"r{k}", model, 0.0, max_output_tokens=200), 0.0)
        now = 0.0
        for k, model in enumerate(("m0", "m1")):  # each prefill hands its KV to the decode instance
            plan = sched.schedule(now).actions
            if "i1" in plan:
                for act in plan["i1"]:
                    if isinstance(act, Switch):
                        sched.on_event(SwitchDone("i1", act.model), now)
                    elif type(act).__name__ == "SwapIn":
                        sched.on_event(KvMoved("i1", act.request_ids, "device"), now)
            sched.on_event(SwitchDone("i0", model), now + 0.5)
            sched.on_event(StepDone("i0", "prefill", (f"r{k}",), 1), now + 0.6)
            now += 1.0
        sched.instances["i1"].inflight.clear()  # the first turn's Decode ends (stopped for the newcomer)
        sched.instances["i1"].inflight_changed()
        sched.touch("i1")
        return list(sched.schedule(now).actions["i1"])

    acts = decode_after_handoff(True)
    decode = [a for a in acts if isinstance(a, Decode)][0]
    assert set(decode.request_ids) == {"r0", "r1"} and "joint" in decode.reason
    assert any(isinstance(a, Switch) and not a.evict for a in acts)  # the other model co-located
    acts = decode_after_handoff(False)
    assert len([a for a in acts if isinstance(a, Decode)][0].request_ids) == 1
