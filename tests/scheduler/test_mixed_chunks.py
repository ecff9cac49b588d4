"""token-level's mixed instances compute prompts in chunks beside their decode steps (issue 35): each
iteration's predicted time (CostModel.mixed_step_s) stays within `mixed_chunk_tpot` of the TPOT SLO."""

from __future__ import annotations

import io
import json

import pytest

from scheduler import Decode, Prefill
from tests.factories import LinearCosts, make_models, make_request, make_sim, run_sim


def _plans(log: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in log.getvalue().splitlines() if line.strip()]


def _actions(log: io.StringIO, op: str) -> list[dict]:
    return [a for plan in _plans(log) for acts in plan["actions"].values() for a in acts if a["op"] == op]


def _setup(share: float = 0.8):
    models = make_models(1, tpot_s=0.1, ttft_s=10.0)
    from tests.factories import make_instances
    instances = make_instances(1, roles=["mixed"])
    # a long decode already running, then a long prompt arrives
    requests = [make_request("d1", arrival_at=0.0, prompt_tokens=100, max_output_tokens=400),
                make_request("p1", arrival_at=1.0, prompt_tokens=3000, max_output_tokens=5)]
    costs = LinearCosts(step_s=0.02, prefill_per_token_s=1e-4)
    log = io.StringIO()
    sim, sched = run_sim("token-level", models, instances, requests, costs, plan_log=log, mixed_chunk_tpot=share)
    return sim, sched, log, costs


def test_prompt_goes_in_chunks_each_iteration_within_the_share_of_tpot():
    sim, sched, log, costs = _setup(0.8)
    iterations = [a for a in _actions(log, "Decode") if a.get("prefill_chunks")]
    assert iterations, "the prompt should be computed in chunks beside the decode steps"
    assert not [a for a in _actions(log, "Prefill") if "p1" in a["request_ids"]]
    assert sum(t for a in iterations for _, t in a["prefill_chunks"]) == 3000
    for a in iterations:
        assert a["max_steps"] == 1
        tokens = sum(t for _, t in a["prefill_chunks"])
        step = costs.mixed_step_s("m0", len(a["request_ids"]), 0, tokens, len(a["prefill_chunks"]))
        assert step <= 0.8 * 0.1 + 1e-3  # context tokens add at most 1e-7 s each here
    records = sim.records
    assert records["p1"].first_token_at is not None and records["d1"].finished_at is not None
    d1 = records["d1"]
    assert (d1.finished_at - d1.first_token_at) / (d1.output_tokens - 1) <= 0.1  # the decode kept its TPOT


def test_whole_prefill_when_chunks_are_off():
    sim, sched, log, costs = _setup(0.0)
    assert not [a for a in _actions(log, "Decode") if a.get("prefill_chunks")]
    assert [a for a in _actions(log, "Prefill") if "p1" in a["request_ids"]]


def test_earliest_deadline_first_among_queued_prompts():
    models = make_models(2, tpot_s=0.1)
    models["m1"] = models["m1"].__class__(**{**{f: getattr(models["m1"], f) for f in models["m1"].__dataclass_fields__},
                                          "ttft_slo_s": 2.0})
    from tests.factories import make_instances
    instances = make_instances(1, roles=["mixed"])
    requests = [make_request("d1", "m0", 0.0, 100, 300), make_request("d2", "m1", 0.0, 100, 300),
                make_request("late", "m0", 1.0, 2000, 3), make_request("urgent", "m1", 1.01, 2000, 3)]
    log = io.StringIO()
    sim, _ = run_sim("token-level", models, instances, requests, LinearCosts(step_s=0.02), plan_log=log)
    order = [a["prefill_chunks"][0][0] for a in _actions(log, "Decode") if a.get("prefill_chunks")]
    assert order and order[0] == "urgent"  # its TTFT deadline (3.01 s) is before late's (11 s)


def test_option_is_checked():
    from tests.factories import make_instances
    with pytest.raises(ValueError, match="mixed_chunk_tpot"):
        make_sim("token-level", make_models(1), make_instances(2, roles=["mixed", "mixed"]), [], mixed_chunk_tpot=1.5)


def _switches(log: io.StringIO) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for plan in _plans(log):
        for iid, acts in plan["actions"].items():
            for a in acts:
                if a["op"] == "Switch":
                    out.setdefault(a["model"], set()).add(iid)
    return out


@pytest.mark.parametrize("affinity", [0.7, 0.0])
def test_prompts_stay_with_the_mixed_instance_holding_their_model(affinity):
    """A busy model's prompts queue behind each other on the mixed instance that holds it (in time for their
    TTFT SLO) rather than pull its weights onto the other instance, where its decode would switch every turn."""
    from tests.factories import make_instances
    models = make_models(2, tpot_s=0.1, ttft_s=10.0)
    instances = make_instances(2, roles=["mixed", "mixed"])
    requests = [make_request("b0", "m1", 0.0, 100, 400)]
    requests += [make_request(f"a{k}", "m0", 0.01 * k, 6000, 50) for k in range(6)]
    log = io.StringIO()
    run_sim("token-level", models, instances, requests, LinearCosts(step_s=0.02, switch_s=0.5), plan_log=log,
            mixed_affinity=affinity)
    homes = _switches(log)["m0"]
    if affinity:
        assert len(homes) == 1, homes
    else:
        assert len(homes) == 2, homes  # the earliest predicted prefill end alone spreads them


def test_a_waiting_prompt_caps_the_open_ended_turn():
    """A prompt of a model not resident on a mixed instance waits while the decode batch has no slack for its
    switch and prefill, but the turn stops in time (half its TTFT SLO before its latest start) to weigh it."""
    from tests.factories import make_instances
    models = make_models(2, tpot_s=0.1, ttft_s=4.0)
    instances = make_instances(1, roles=["mixed"])
    requests = [make_request("d", "m0", 0.0, 100, 2000), make_request("p", "m1", 1.0, 3000, 5)]
    log = io.StringIO()
    sim, _ = run_sim("token-level", models, instances, requests, LinearCosts(step_s=0.06), plan_log=log)
    p = sim.records["p"]
    assert p.first_token_at is not None and p.first_token_at - p.arrival_at <= 4.0
    assert any("a prompt waits" in a["reason"] for a in _actions(log, "Decode"))


def test_a_head_not_resident_goes_before_chunks_by_its_latest_start():
    """Issue 35 / 37 item 5: a prompt of a model not resident, at the head of a mixed instance's groups, waits
    (the decode batch has no slack for its switch and prefill) while a resident model's prompts arrive faster
    than their chunks go. They go in chunks while it can wait; from its latest start that keeps its TTFT SLO
    (less its switch and one TPOT SLO) no chunk goes before it, not even of the prompt already started, so it
    keeps its TTFT SLO. (It used to wait for the stream to end: p's TTFT was 23 s.)"""
    from tests.factories import make_instances
    ttft, tpot = 4.0, 0.1
    models = make_models(2, tpot_s=tpot, ttft_s=ttft)
    instances = make_instances(1, roles=["mixed"])
    requests = [make_request("d", "m0", 0.0, 100, 2000), make_request("p", "m1", 1.0, 3000, 5)]
    # from just after p (its group heads the queue), a 2,000-token m0 prompt every 0.5 s for 10 s; each takes
    # ~1.1 s of chunks (0.08 s iterations carrying ~150 prompt tokens beside a 0.06 s decode step)
    requests += [make_request(f"s{k:02d}", "m0", 1.05 + 0.5 * k, 2000, 2) for k in range(20)]
    costs = LinearCosts(step_s=0.06)
    log = io.StringIO()
    sim, _ = run_sim("token-level", models, instances, requests, costs, plan_log=log)
    latest = 1.0 + ttft - costs.prefill_s("m1", 3000) - costs.switch_s("m1")  # the last start that keeps TTFT
    prefill_at = next(plan["at"] for plan in _plans(log) for acts in plan["actions"].values() for a in acts
                      if a["op"] == "Prefill" and "p" in a["request_ids"])
    assert latest - tpot <= prefill_at <= latest, (prefill_at, latest)
    chunked = [(plan["at"], rid) for plan in _plans(log) for acts in plan["actions"].values() for a in acts
               for rid, _ in a.get("prefill_chunks") or ()]
    assert [at for at, _ in chunked if at < latest - tpot]  # the stream went in chunks while p could wait
    late = sorted({rid for at, rid in chunked if latest - tpot <= at < prefill_at})
    assert not late, f"chunks of {late} went between p's latest start ({latest - tpot:.2f} s) and its prefill"
    p = sim.records["p"]
    assert p.first_token_at is not None and p.first_token_at - p.arrival_at <= ttft


def test_a_waiting_prompt_caps_the_turn_when_queued_prompts_cannot_go_in_chunks():
    """The chunk path's decode-only turn (a resident model's prompt queued, its KV not admitted yet) is cut for
    a waiting head like any other turn: p, of a model not resident, is weighed again in time for its TTFT SLO.
    (It used to wait behind d's open-ended turn, TTFT 1,220 s.)"""
    from tests.factories import make_instances
    models = make_models(2, tpot_s=0.1, ttft_s=4.0, kv_per_token=2_000_000)  # 26,000 tokens of device KV
    instances = make_instances(1, roles=["mixed"])
    requests = [make_request("d", "m0", 0.0, 100, 20000),  # 20,100 tokens of KV
                make_request("p", "m1", 1.0, 3000, 5),  # no slack for its switch and prefill beside d's decode
                make_request("q", "m0", 1.05, 8000, 5)]  # resident, chunkable, but its KV does not fit beside d's
    log = io.StringIO()
    sim, _ = run_sim("token-level", models, instances, requests, LinearCosts(step_s=0.06), plan_log=log)
    p = sim.records["p"]
    assert p.first_token_at is not None and p.first_token_at - p.arrival_at <= 4.0
    cut = [a for plan in _plans(log) if plan["at"] > 1.05 for a in plan["actions"].get("i0", ())
           if a["op"] == "Decode" and "a prompt waits" in a["reason"]]
    assert cut


def test_a_quota_turn_counts_its_chunked_iterations_by_their_time():
    """A quota turn on a mixed instance holds it for its quota's time: an iteration that carries prompt chunks
    beside the batch's step (0.08 s here) counts as the decode steps of its time (4 of 0.02 s), not as one step.
    Three models that do not fit the weights together, so turns are quota turns (c0 > 0) of ~2 s; m0's prompts
    stream in and go in chunks during m0's turns. (Counted as one step each, an m0 turn of 98 steps ran 32
    chunked iterations: 2.6 s of compute, 4.2 s wall, while m1's and m2's batches waited.) Only the prompt in
    flight when the quota is spent may run on to its last chunk (switched away, its rest would be prefilled
    whole, stalling every batch)."""
    import re

    from tests.factories import make_instances
    step_s, tpot = 0.02, 0.1
    models = make_models(3, tpot_s=tpot, ttft_s=10.0, weight_gb=30.0)  # two fit the 60 GB of weights, not three
    instances = make_instances(1, roles=["mixed"])
    requests = [make_request(r, m, at, 100, 3000) for r, m, at in (("a", "m0", 0.0), ("b", "m1", 0.05),
                                                                     ("c", "m2", 0.1))]
    requests += [make_request(f"p{k}", "m0", 5.0 + 0.5 * k, 2000, 3) for k in range(16)]
    costs = LinearCosts(step_s=step_s)
    log = io.StringIO()
    sim, _ = run_sim("token-level", models, instances, requests, costs, plan_log=log)
    turns: list[tuple[int, float]] = []  # per quota turn of m0: its quota in steps, the compute its Decodes took
    current: list | None = None
    for plan in _plans(log):
        for a in plan["actions"].get("i0", ()):
            if a["op"] != "Decode":
                continue
            started = re.search(r"(\w+) turn \(quota (\d+) steps\)", a["reason"])
            if started or "due first" in a["reason"] or a["reason"].startswith("joint"):
                current = [int(started.group(2)), 0.0] if started and started.group(1) == "m0" else None
                if current is not None:
                    turns.append(current)  # type: ignore[arg-type]
            if current is None:
                continue
            chunks = a.get("prefill_chunks") or ()
            tokens = sum(t for _, t in chunks)
            one = costs.mixed_step_s("m0", len(a["request_ids"]), 0, tokens, len(chunks)) if chunks else step_s
            current[1] += one * a["max_steps"]
    chunked = [(quota, took) for quota, took in turns if took > quota * step_s / 2]
    assert chunked, "m0's turns should carry its prompts' chunks"
    prompt_s = 5 * 0.8 * tpot  # a 2,000-token prompt's chunks: 4 iterations of 0.08 s (and a short fifth)
    for quota, took in chunked:
        assert took <= quota * step_s + prompt_s, (quota, took)
    assert all(sim.records[r].finished_at is not None for r in "abc")


def test_dispatch_predicts_a_mixed_instance_by_its_prompts_not_its_open_ended_turn():
    """Dispatch predicts when a prompt's prefill would end on a mixed instance from the prompts ahead of it,
    the chunks left of the one started included, not from the decode turn running there (a prompt ends an
    open-ended turn or goes in chunks beside it; the decode's share stretches the prediction). b (26,000 tokens)
    arrives while i0, holding m0, decodes d: it stays on i0 and goes in chunks (~3.8 s) beside d. q (10,000
    tokens) arrives while b's chunks go: behind them it would take its first token ~5 s after arriving, so it
    goes to i1 (a switch, then a whole prefill). (i0 used to look busy for the whole of d's open-ended turn,
    2,999 steps, so b went to i1 and pulled m0's weights there.)"""
    from tests.factories import make_instances
    models = make_models(1, tpot_s=0.1, ttft_s=4.0)
    instances = make_instances(2, roles=["mixed", "mixed"])
    requests = [make_request("d", "m0", 0.0, 100, 3000), make_request("b", "m0", 1.0, 26000, 5),
                make_request("q", "m0", 1.1, 10000, 5)]
    log = io.StringIO()
    sim, _ = run_sim("token-level", models, instances, requests, LinearCosts(step_s=0.02), plan_log=log)
    where: dict[str, set[str]] = {}
    for plan in _plans(log):
        for iid, acts in plan["actions"].items():
            for a in acts:
                for rid in a.get("request_ids", ()) if a["op"] == "Prefill" else ():
                    where.setdefault(rid, set()).add(iid)
                for rid, _ in a.get("prefill_chunks") or ():
                    where.setdefault(rid, set()).add(iid)
    assert where["d"] == where["b"] == {"i0"}
    assert where["q"] == {"i1"}
    for rid in ("b", "q"):
        record = sim.records[rid]
        assert record.first_token_at is not None and record.first_token_at - record.arrival_at <= 4.0, rid
