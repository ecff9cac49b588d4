"""Each policy on small hand-built scenarios: assert on the Plans it returns."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import (Decode, InstanceAdded, InstanceLost, KvMoved, Prefetch, Prefill, StepDone, Stop, SwapIn, SwapOut, Switch, SwitchDone,
                       decode_quotas, make_scheduler)
from scheduler.fleet import GB
from tests.factories import LinearCosts, make_instances, make_models, make_request


def ops(plan, iid):
    return [type(a).__name__ for a in plan.actions.get(iid, ())]


def test_dedicated_loads_its_model_once_then_batches_continuously() -> None:
    sched = make_scheduler("dedicated", make_models(2), make_instances(2), LinearCosts())
    plan = sched.schedule(0.0)
    assert plan.actions == {"i0": (Switch("m0", reason="load the instance's own model"),),
                            "i1": (Switch("m1", reason="load the instance's own model"),)}
    sched.on_event(SwitchDone("i0", "m0"), 0.5)
    sched.on_event(SwitchDone("i1", "m1"), 0.5)
    for k in range(3):
        sched.submit(make_request(f"r{k}", "m0", 0.6), 0.6)
    plan = sched.schedule(0.6)
    (prefill,) = plan.actions["i0"]
    assert isinstance(prefill, Prefill) and prefill.request_ids == ("r0", "r1", "r2")
    assert "i1" not in plan.actions  # m1's instance never serves m0
    sched.on_event(StepDone("i0", "prefill", ("r0", "r1", "r2"), 1), 0.7)
    (decode,) = sched.schedule(0.7).actions["i0"]
    assert isinstance(decode, Decode) and decode.request_ids == ("r0", "r1", "r2") and decode.max_steps == 19
    # a new m0 request while i0 decodes: stop at the next token boundary to admit it
    sched.submit(make_request("r3", "m0", 0.8), 0.8)
    assert isinstance(sched.schedule(0.8).actions["i0"][0], Stop)
    sched.on_event(StepDone("i0", "decode", ("r0", "r1", "r2"), 5), 0.85)
    (prefill,) = sched.schedule(0.85).actions["i0"]
    assert prefill.request_ids == ("r3",)


def test_dedicated_gives_spare_instances_to_the_busiest_model() -> None:
    sched = make_scheduler("dedicated", make_models(2, rates=[5.0, 0.1]), make_instances(3), LinearCosts())
    assert sorted(sched.owner.values()) == ["m0", "m0", "m1"]


def test_dedicated_refuses_a_pool_too_small() -> None:
    with pytest.raises(ValueError, match="needs 3 TP1 instances"):
        make_scheduler("dedicated", make_models(3), make_instances(2), LinearCosts())


def test_request_level_switches_a_free_instance_and_never_evicts_a_busy_model() -> None:
    sched = make_scheduler("request-level", make_models(3), make_instances(1), LinearCosts())
    sched.submit(make_request("a", "m0", 0.0), 0.0)
    plan = sched.schedule(0.0)
    assert ops(plan, "i0") == ["Switch", "Prefill"] and plan.actions["i0"][0].model == "m0"
    sched.on_event(SwitchDone("i0", "m0"), 0.5)
    sched.on_event(StepDone("i0", "prefill", ("a",), 1), 0.6)
    sched.submit(make_request("b", "m1", 0.6), 0.6)
    plan = sched.schedule(0.6)
    assert ops(plan, "i0") == ["Decode"]  # m1 waits: m0 still has a running request
    sched.on_event(StepDone("i0", "decode", ("a",), 19, ("a",)), 1.0)
    plan = sched.schedule(1.0)
    assert ops(plan, "i0") == ["Switch", "Prefill"] and plan.actions["i0"][0].model == "m1"
    assert "evict LRU idle m0" in plan.actions["i0"][0].reason


def test_spatial_colocates_models_that_fit_and_decodes_them_together() -> None:
    models = make_models(3, weight_gb=20.0)
    sched = make_scheduler("spatial", models, make_instances(1, memory_gb=80.0), LinearCosts())
    assert sched.placement == {"i0": ["m0", "m1", "m2"]}
    plan = sched.schedule(0.0)
    assert [a.evict for a in plan.actions["i0"]] == [False, False, False]
    for m in ("m0", "m1", "m2"):
        sched.on_event(SwitchDone("i0", m), 0.5)
    sched.submit(make_request("a", "m0", 1.0), 1.0)
    sched.submit(make_request("b", "m2", 1.0), 1.0)
    plan = sched.schedule(1.0)
    assert ops(plan, "i0") == ["Prefill", "Prefill"]
    sched.on_event(StepDone("i0", "prefill", ("a",), 1), 1.1)
    sched.on_event(StepDone("i0", "prefill", ("b",), 1), 1.2)
    (decode,) = sched.schedule(1.2).actions["i0"]
    assert set(decode.request_ids) == {"a", "b"}  # one step advances both models


def test_spatial_refuses_a_model_that_fits_nowhere() -> None:
    models = make_models(3, weight_gb=35.0)
    sched = make_scheduler("spatial", models, make_instances(1, memory_gb=80.0), LinearCosts())
    sched.submit(make_request("a", "m2", 0.0), 0.0)
    plan = sched.schedule(0.0)
    assert plan.failed and plan.failed[0][0] == "a" and "no instance with memory" in plan.failed[0][1]


def _token_level(**options):
    models = make_models(3)
    instances = make_instances(2, roles=["prefill", "decode"])
    return make_scheduler("token-level", models, instances, LinearCosts(), **options)


def test_token_level_groups_fcfs_prefills_switches_and_prefetches() -> None:
    sched = _token_level(first_tokens=1)
    sched.submit(make_request("a", "m0", 0.0), 0.0)
    sched.submit(make_request("b", "m1", 0.1), 0.1)
    sched.submit(make_request("c", "m0", 0.2), 0.2)
    plan = sched.schedule(0.2)
    acts = plan.actions["i0"]
    assert [type(a) for a in acts] == [Switch, Prefetch, Prefill]
    assert acts[0].model == "m0" and acts[2].request_ids == ("a", "c") and acts[2].kv_to_host
    assert acts[1].model == "m1"  # the next group's model, fetched while m0 prefills (so it comes first)
    assert [g.model for g in sched.prefill.groups["i0"]] == ["m1"]


def test_token_level_prefill_instance_decodes_the_first_tokens_then_hands_off() -> None:
    sched = _token_level()  # first_tokens=8
    for rid in ("a", "c"):
        sched.submit(make_request(rid, "m0", 0.0), 0.0)
    (switch, prefill) = sched.schedule(0.0).actions["i0"]
    assert not prefill.kv_to_host
    sched.on_event(SwitchDone("i0", "m0"), 0.5)
    sched.on_event(StepDone("i0", "prefill", ("a", "c"), 1), 0.6)
    (decode,) = sched.schedule(0.6).actions["i0"]
    assert isinstance(decode, Decode) and decode.request_ids == ("a", "c") and decode.max_steps == 7
    sched.on_event(StepDone("i0", "decode", ("a", "c"), 7), 0.7)
    (swap_out,) = sched.schedule(0.7).actions["i0"]  # its own plan: the KV moved counts the 7 new tokens
    assert isinstance(swap_out, SwapOut) and swap_out.request_ids == ("a", "c")
    sched.on_event(KvMoved("i0", ("a", "c"), "host"), 0.71)
    assert sched.requests["a"].instance_id == "i1"  # joined the decode instance once its KV reached host memory
    assert ops(sched.schedule(0.71), "i1") == ["Switch", "SwapIn", "Decode"]


def test_token_level_keeps_prompts_queued_while_no_prefill_instance_lives() -> None:
    # dispatch reads only the queues that got requests (queued_models): a model left queued because every
    # prefill instance of its TP is lost must stay there and go out once one comes back, after newer arrivals
    sched = _token_level(first_tokens=1)
    sched.on_event(InstanceLost("i0", "test"), 0.0)
    sched.submit(make_request("a", "m0", 0.1), 0.1)
    assert "i0" not in sched.schedule(0.1).actions
    assert list(sched.queues["m0"]) == ["a"] and "m0" in sched.queued_models
    sched.submit(make_request("b", "m1", 0.2), 0.2)
    assert "i0" not in sched.schedule(0.2).actions
    assert list(sched.queues["m1"]) == ["b"] and set(sched.queued_models) == {"m0", "m1"}
    sched.on_event(InstanceAdded("i0"), 0.3)
    acts = sched.schedule(0.3).actions["i0"]
    assert [type(a) for a in acts] == [Switch, Prefetch, Prefill] and acts[2].request_ids == ("a",)
    assert [g.model for g in sched.prefill.groups["i0"]] == ["m1"]  # b waits in the next group, a before it (FCFS)
    assert not sched.queued_models and not any(sched.queues.values())


def test_token_level_decode_turns_go_to_the_batch_due_first() -> None:
    sched = _token_level(first_tokens=1, joint_turns=False)  # quota turns (a joint turn would decode both at once)
    for rid, model in (("a", "m0"), ("b", "m1")):
        sched.submit(make_request(rid, model, 0.0, max_output_tokens=500), 0.0)
    plan = sched.schedule(0.0)
    sched.on_event(SwitchDone("i0", "m0"), 0.5)
    sched.on_event(StepDone("i0", "prefill", ("a",), 1), 0.6)
    assert sched.requests["a"].instance_id == "i1"
    plan = sched.schedule(0.6)
    assert ops(plan, "i1") == ["Switch", "SwapIn", "Decode"]  # a sole batch: open-ended turn
    assert plan.actions["i1"][2].max_steps == 499
    # b arrives on the decoder while a's open-ended turn runs: stop it; quotas begin
    sched.on_event(SwitchDone("i0", "m1"), 1.0)
    sched.on_event(StepDone("i0", "prefill", ("b",), 1), 1.1)
    assert ops(sched.schedule(1.1), "i1") == ["Stop"]
    sched.on_event(SwitchDone("i1", "m0"), 1.1)
    sched.on_event(KvMoved("i1", ("a",), "device"), 1.1)
    sched.on_event(StepDone("i1", "decode", ("a",), 3), 1.2)
    plan = sched.schedule(1.2)
    acts = plan.actions["i1"]
    # a owes token 5 at 0.6 + 4 * 0.1 = 1.0, b token 2 at 1.2: a goes first, for its quota; m1 is prefetched
    assert [type(a) for a in acts] == [Prefetch, Decode]
    assert acts[1].request_ids == ("a",) and acts[1].max_steps < 496 and "quota" in acts[1].reason
    sched.on_event(StepDone("i1", "decode", ("a",), acts[1].max_steps), 2.0)
    acts = sched.schedule(2.0).actions["i1"]
    # b's turn; a's KV stays on the device (both fit), m1's switch was prefetched, m0 stays resident beside it
    assert [type(a) for a in acts] == [Switch, SwapIn, Decode]
    assert acts[0].model == "m1" and "prefetched" in acts[0].reason and acts[1].request_ids == ("b",)
    assert acts[0].keep == ("m0",) and "a" in sched.instances["i1"].on_device
    sched.on_event(SwitchDone("i1", "m1"), 2.3)
    sched.on_event(KvMoved("i1", ("b",), "device"), 2.3)
    sched.on_event(StepDone("i1", "decode", ("b",), acts[2].max_steps), 3.0)
    acts, now = sched.schedule(3.0).actions["i1"], 3.0
    while [type(a) for a in acts] == [Decode] and acts[0].request_ids == ("b",):  # b's turns until a is due first
        now += 0.5
        sched.on_event(StepDone("i1", "decode", ("b",), acts[0].max_steps), now)
        acts = sched.schedule(now).actions["i1"]
    assert [type(a) for a in acts] == [Switch, Decode] and acts[1].request_ids == ("a",)  # back to m0: its KV never left, its weights neither
    assert "resident" in acts[0].reason and acts[0].keep == ("m1",)


def _first_quota_turn(min_turn_tpot: float):
    """Two one-request batches of small models (switches of 5 ms) on one decode instance whose weight region holds
    one of them (so each turn switches): the first quota turn."""
    models = make_models(2)
    costs = LinearCosts(switch_s=0.005)
    one_model = [dataclasses.replace(spec, kv_bytes=40 * GB, weight_bytes=models["m0"].weight_bytes)
                 for spec in make_instances(2, roles=["prefill", "decode"])]
    sched = make_scheduler("token-level", models, one_model, costs, first_tokens=1, min_turn_tpot=min_turn_tpot)
    for rid, model in (("a", "m0"), ("b", "m1")):
        sched.submit(make_request(rid, model, 0.0, max_output_tokens=500), 0.0)
    sched.schedule(0.0)
    sched.on_event(SwitchDone("i0", "m0"), 0.01)
    sched.on_event(StepDone("i0", "prefill", ("a",), 1), 0.02)
    sched.schedule(0.02)  # a's open-ended turn on i1
    sched.on_event(SwitchDone("i0", "m1"), 0.03)
    sched.on_event(StepDone("i0", "prefill", ("b",), 1), 0.04)
    assert ops(sched.schedule(0.04), "i1") == ["Stop"]  # b arrived: the quota turns begin
    sched.on_event(SwitchDone("i1", "m0"), 0.04)
    sched.on_event(KvMoved("i1", ("a",), "device"), 0.04)
    sched.on_event(StepDone("i1", "decode", ("a",), 2), 0.05)
    decode = sched.schedule(0.05).actions["i1"][-1]
    assert isinstance(decode, Decode) and len(decode.request_ids) == 1 and "quota" in decode.reason
    first = decode.request_ids[0]  # the batch due first; the other one waits
    order = sorted(("a", "b"), key=lambda rid: rid != first)
    step_s = [costs.decode_step_s(sched.requests[r].model, 1, sched.requests[r].context_tokens) for r in order]
    return decode.max_steps, step_s, models["m0"].tpot_slo_s


def test_token_level_quota_turns_last_at_least_the_floor() -> None:
    """The formula alone gives a 5 ms-switch round turns shorter than a step here; the floor (one TPOT SLO period by
    default) makes the turn last that long, and min_turn_tpot=0 restores the formula's length."""
    steps, step_s, tpot = _first_quota_turn(0.0)
    formula_steps = max(1, int(decode_quotas(step_s, tpot, 2 * 0.005, 2.0)[0] / step_s[0]))
    assert steps == formula_steps and steps * step_s[0] < tpot / 2
    steps, step_s, tpot = _first_quota_turn(1.0)
    assert steps * step_s[0] >= tpot > (steps - 1) * step_s[0]
    steps, step_s, tpot = _first_quota_turn(2.5)
    assert steps * step_s[0] >= 2.5 * tpot > (steps - 1) * step_s[0]
    with pytest.raises(ValueError, match="min_turn_tpot must be >= 0"):
        _token_level(min_turn_tpot=-1)


def test_token_level_needs_prefill_and_decode_instances() -> None:
    with pytest.raises(ValueError, match="needs prefill and decode instances"):
        make_scheduler("token-level", make_models(1), make_instances(1, roles=["decode"]), LinearCosts())


def test_unknown_model_and_oversized_requests_fail_cleanly() -> None:
    sched = make_scheduler("dedicated", make_models(1), make_instances(1), LinearCosts())
    sched.submit(make_request("x", "nope"), 0.0)
    sched.submit(make_request("y", "m0", prompt_tokens=40000), 0.0)
    failed = dict(sched.schedule(0.0).failed)
    assert "unknown model 'nope'" in failed["x"] and "exceed" in failed["y"]


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        make_scheduler("fifo", make_models(1), make_instances(1), LinearCosts())


def test_every_policy_takes_the_base_keywords_with_the_base_defaults() -> None:
    """The policies spell PolicyBase's keywords out (no **kwargs, for mypyc): their defaults must not drift."""
    import inspect

    from scheduler import POLICIES
    from scheduler.policies import PolicyBase

    if not inspect.isfunction(PolicyBase.__init__):
        pytest.skip("compiled with mypyc (setup.py): no Python signatures to read")
    base = {name: p.default for name, p in inspect.signature(PolicyBase.__init__).parameters.items()
            if p.kind is p.KEYWORD_ONLY}
    assert base.keys() >= {"max_batch_size", "keep_ended"}
    for cls in POLICIES.values():
        params = inspect.signature(cls.__init__).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), cls.name
        assert {name: params[name].default for name in base if name in params} == base, cls.name
