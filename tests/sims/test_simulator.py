"""The event loop: deterministic, and same-time events in a defined order."""

from __future__ import annotations

import io

import numpy as np
import pytest

from scheduler import Request, make_scheduler
from sims.simulator import Simulator
from tests.factories import LinearCosts, make_instances, make_models, make_sim, make_workload, run_sim


def _log(policy: str, roles=None, seed: int = 7) -> tuple[str, dict]:
    models = make_models(3)
    log = io.StringIO()
    sim, _ = run_sim(policy, models, make_instances(3, roles=roles), make_workload(200, list(models), seed=seed),
                     plan_log=log)
    summary = {rid: (r.first_token_at, r.finished_at, tuple(r.segments)) for rid, r in sim.records.items()}
    return log.getvalue(), summary


def test_same_inputs_give_byte_identical_plan_logs_and_records() -> None:
    for policy, roles in (("token-level", ["prefill", "decode", "decode"]), ("request-level", None)):
        first, second = _log(policy, roles), _log(policy, roles)
        assert first[0] == second[0] and first[1] == second[1]
        assert first[0].count("\n") > 100
    assert _log("request-level", seed=8)[0] != _log("request-level", seed=7)[0]


class _Recorder:
    """A scheduler stand-in that records the order of calls (implements the contract)."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []

    def submit(self, request, now):
        self.calls.append(("submit", request.request_id, now))

    def on_event(self, event, now):
        self.calls.append(("event", type(event).__name__, now))

    def schedule(self, now):
        from scheduler import Plan, Switch

        self.calls.append(("schedule", "", now))
        if now == 0.0:  # a switch that completes exactly when two requests arrive
            return Plan(at=now, actions={"i0": (Switch("m0", reason="test"),)})
        return Plan(at=now)


def test_tie_break_arrivals_then_completions_then_one_schedule() -> None:
    recorder = _Recorder()
    costs = LinearCosts(switch_s=1.0)
    requests = [Request("a", "m0", 0.0, 10, 5), Request("b", "m0", 1.0, 10, 5), Request("c", "m0", 1.0, 10, 5)]
    Simulator(recorder, costs, requests, kv_bytes_per_token={"m0": 1}).run()
    assert recorder.calls == [
        ("submit", "a", 0.0), ("schedule", "", 0.0),
        ("submit", "b", 1.0), ("submit", "c", 1.0), ("event", "SwitchDone", 1.0), ("schedule", "", 1.0),
    ]


def test_a_stop_cuts_a_turn_at_the_next_step_boundary() -> None:
    models = make_models(1)
    costs = LinearCosts(step_s=0.01, per_token_s=0.0)
    sched = make_scheduler("dedicated", models, make_instances(1), costs)
    requests = [Request("a", "m0", 0.0, 10, 1000), Request("b", "m0", 2.0049, 10, 5)]
    sim = Simulator(sched, costs, requests, kv_bytes_per_token={"m0": 1})
    sim.run()
    a = sim.records["a"]
    # a's first long turn was cut at the step boundary after b arrived (2.0049 s -> the step ending at ~2.01)
    first_turn_end = a.segments[1][0] + (a.segments[1][1] - 1) * a.segments[1][2]
    assert abs(first_turn_end - 2.01) < 0.011 and a.segments[1][1] < 999
    assert sim.records["b"].first_token_at < 2.03
    assert a.generated == 1000 and sim.records["b"].generated == 5


# ---- Sarathi-style chunked prefill (dedicated, chunked_prefill_tokens) ----------------
def _chunked(requests, chunk: int = 64, max_batch: int = 8, log=None):
    models = make_models(1)
    costs = LinearCosts(step_s=0.01, per_token_s=0.0, prefill_per_token_s=1e-4)
    sched = make_scheduler("dedicated", models, make_instances(1), costs, max_batch_size=max_batch,
                           chunked_prefill_tokens=chunk)
    capacity = {iid: inst.kv_capacity_bytes for iid, inst in sched.instances.items()}
    sim = Simulator(sched, costs, requests, kv_bytes_per_token={"m0": 1}, kv_capacity=capacity, plan_log=log)
    sim.run()
    return sim


def test_chunked_prefill_spreads_a_long_prompt_over_iterations_that_keep_decoding() -> None:
    import json

    log = io.StringIO()
    # a is decoding (from ~0.5 s, after the switch) when b's 200-token prompt arrives; chunks of
    # 64 tokens less 1 for a's decode token = 63 prompt tokens per iteration
    sim = _chunked([Request("a", "m0", 0.0, 10, 100), Request("b", "m0", 0.8, 200, 5)], log=log)
    plans = [json.loads(line) for line in log.getvalue().splitlines()]
    decodes = [a for p in plans for acts in p["actions"].values() for a in acts if a["op"] == "Decode"]
    assert decodes[0]["prefill_chunks"] == [["a", 10]] and decodes[0]["request_ids"] == []
    mixed = [d for d in decodes[1:] if "prefill_chunks" in d]
    assert [d["prefill_chunks"] for d in mixed] == [[["b", 63]], [["b", 63]], [["b", 63]], [["b", 11]]]
    assert all(d["request_ids"] == ["a"] and d["max_steps"] == 1 for d in mixed)
    assert all(sum(t for _, t in d["prefill_chunks"]) + len(d["request_ids"]) <= 64 for d in mixed)
    plain = [d for d in decodes if "prefill_chunks" not in d]  # plain Decodes: their JSON has no new key
    assert len(plain) >= 3 and set(plain[0]) == {"op", "request_ids", "max_steps", "reason"}
    a, b = sim.records["a"], sim.records["b"]
    assert a.generated == 100 and b.generated == 5 and a.finished_at and b.finished_at
    # b's first token comes with the iteration that computes its last chunk: 4 iterations after it was admitted
    iterations = [seg for seg in a.segments if seg[0] > 0.8][:4]
    assert len(iterations) == 4 and all(n == 1 for _, n, _ in iterations)
    assert b.first_token_at == iterations[-1][0]
    assert b.segments[0] == (b.first_token_at, 1, iterations[-1][2])


def test_chunked_prefill_packs_queued_prompts_fcfs_into_the_budget_and_respects_the_batch_cap() -> None:
    import json

    log = io.StringIO()
    requests = [Request(f"r{k}", "m0", 0.0, 30, 3) for k in range(5)]
    _chunked(requests, chunk=64, max_batch=3, log=log)
    first = json.loads(log.getvalue().splitlines()[1])  # after the instance's Switch
    (decode,) = first["actions"]["i0"]
    assert decode["request_ids"] == [] and decode["prefill_chunks"] == [["r0", 30], ["r1", 30], ["r2", 4]]


def test_chunked_prefill_is_only_for_policies_that_support_it() -> None:
    import pytest

    models = make_models(1)
    with pytest.raises(ValueError, match="does not support chunked prefill"):
        make_scheduler("token-level", models, make_instances(2, roles=["prefill", "decode"]), LinearCosts(),
                       chunked_prefill_tokens=512)
    with pytest.raises(ValueError, match="must exceed max_batch_size"):
        make_scheduler("dedicated", models, make_instances(1), LinearCosts(), max_batch_size=128,
                       chunked_prefill_tokens=64)


def test_the_executor_refuses_a_chunk_past_the_prompt() -> None:
    import pytest
    from scheduler import Decode, Plan
    from sims.simulator import InvariantViolation

    class Greedy(_Recorder):
        def schedule(self, now):
            if now == 0.0:
                from scheduler import Switch

                return Plan(at=now, actions={"i0": (Switch("m0", reason="t"),
                                                    Decode((), 1, "t", prefill_chunks=(("a", 11),)))})
            return Plan(at=now)

    sim = Simulator(Greedy(), LinearCosts(), [Request("a", "m0", 0.0, 10, 5)], kv_bytes_per_token={"m0": 1})
    with pytest.raises(InvariantViolation, match="prefill chunk of 11 tokens"):
        sim.run()


@pytest.mark.parametrize("policy, roles", [("dedicated", None), ("token-level", ("prefill", "decode", "decode", "prefill")),
                                           ("token-level", ("mixed", "mixed", "decode", "prefill"))])
def test_skipping_quiet_schedules_leaves_the_plan_log_unchanged(policy, roles) -> None:
    def log_of(skip: bool) -> str:
        models = make_models(3)
        log = io.StringIO()
        sim, sched = make_sim(policy, models, make_instances(4, roles=roles), make_workload(300, list(models), seed=5),
                              plan_log=log, faults=[(9.0, "i1")])
        assert sched.skip_quiet_schedules  # both skip by default
        sched.skip_quiet_schedules = skip
        sim.run()
        return log.getvalue()

    skipped = log_of(True)
    assert skipped.count("\n") > 300 and '"SwapIn"' in skipped or policy == "dedicated"
    assert skipped == log_of(False)


@pytest.mark.parametrize("policy", ["dedicated", "token-level"])
def test_the_scheduler_forgetting_ended_requests_changes_no_plan(policy) -> None:
    """simulate() runs the scheduler with keep_ended=False, as the live pool does: the same Plan log and records."""
    from modelpool.config import parse_fleet
    from sims.run import simulate
    from sims.workload import Workload

    fleet = parse_fleet("pool: {gpu: h200, num_gpus: 4}\nmodels:\n  - {name: a, arch: qwen2.5-1.5b}\n"
                        "  - {name: b, arch: qwen2.5-3b}\n  - {name: c, arch: qwen2.5-1.5b}\n")
    rng = np.random.default_rng(7)
    n = 600
    workload = Workload.from_columns(np.sort(rng.uniform(0, 60, n)), rng.integers(0, 3, n), rng.integers(50, 900, n),
                                     rng.integers(1, 400, n), models=("a", "b", "c"), source="test")

    def run(keep_ended: bool) -> tuple[str, list]:
        log = io.StringIO()
        result = simulate(fleet, workload, policy, plan_log=log, keep_ended=keep_ended)
        return log.getvalue(), [(r.generated, r.first_token_at, r.finished_at, r.segments) for r in result.records.values()]

    kept, forgotten = run(True), run(False)
    assert kept[0].count("\n") > 500 and sum(g for g, *_ in kept[1]) > 10_000
    assert forgotten == kept


def test_run_simulate_writes_the_plan_log() -> None:
    from modelpool.config import parse_fleet
    from sims.run import simulate
    from sims.workload import Workload

    fleet = parse_fleet("pool: {gpu: h200, num_gpus: 1}\nmodels:\n  - {name: a, arch: qwen2.5-1.5b}\n")
    workload = Workload.from_columns([0.0, 0.5], [0, 0], [100, 50], [10, 5], models=("a",), source="test")
    log = io.StringIO()
    result = simulate(fleet, workload, "dedicated", plan_log=log)
    assert result.metrics["completed"] == 2 and result.num_events > 0 and result.sim_wall_s > 0
    assert log.getvalue().count("\n") == result.num_plans > 0


def test_reusing_decode_batches_changes_nothing() -> None:
    """The executor's batch cache (O(1) planning of an unchanged batch) gives the same plans and records."""

    def run(reuse: bool) -> tuple[str, dict]:
        out = []
        for policy, roles, options in (("dedicated", None, {"chunked_prefill_tokens": 512, "max_batch_size": 64}),
                                       ("dedicated", None, {}), ("token-level", ["prefill", "decode", "decode"], {}),
                                       ("spatial", None, {})):
            models = make_models(3)
            log = io.StringIO()
            sim, _ = make_sim(policy, models, make_instances(3, roles=roles),
                              make_workload(300, list(models), rate=4.0, seed=11), plan_log=log, **options)
            sim.reuse_batches = reuse
            sim.run()
            out.append((log.getvalue(), {rid: (r.generated, r.first_token_at, r.finished_at, tuple(r.segments))
                                         for rid, r in sim.records.items()}))
        return str([o[0] for o in out]), {k: o[1] for k, o in enumerate(out)}

    assert run(True) == run(False)


@pytest.mark.parametrize("roles", [("prefill", "decode", "decode", "prefill", "decode"), ("mixed",) * 3 + ("decode",)])
def test_token_level_planning_only_touched_instances_plans_exactly_what_a_full_scan_does(roles) -> None:
    """Token-level plans only instances whose state changed since its last plan: the Plan log must be byte-identical
    to planning every instance at every call, with mixed instances and a lost instance."""
    def log_of(full_scan: bool) -> str:
        models = make_models(4)
        log = io.StringIO()
        sim, sched = make_sim("token-level", models, make_instances(len(roles), roles=roles),
                              make_workload(500, list(models), seed=3), plan_log=log, faults=[(40.0, "i1")])
        sched.full_scan = full_scan
        sim.run()
        return log.getvalue()

    full = log_of(True)
    assert full.count("\n") > 1000 and '"Switch"' in full
    assert log_of(False) == full


def test_two_model_slots_a_model_switched_away_from_comes_back_without_a_copy() -> None:
    """Like the engine's two weight slots: A, then B (a full copy), then A again costs nothing - A stayed in the
    other slot; a prefetch of the model already in the spare slot copies nothing either; a third model C is a copy."""
    from scheduler import Plan, Prefetch, Switch

    script = [(Switch("m0", reason="t"),), (Switch("m1", reason="t"),),
              (Prefetch("m0", reason="t"), Switch("m0", reason="t")), (Switch("m2", reason="t"),)]

    class Scripted(_Recorder):
        def schedule(self, now):
            self.calls.append(("schedule", "", now))
            busy = sum(1 for c in self.calls if c[0] == "event") < sum(1 for c in self.calls if c[0] == "planned")
            if script and not busy:
                self.calls.append(("planned", "", now))
                return Plan(at=now, actions={"i0": script.pop(0)})
            return Plan(at=now)

    sched = Scripted()
    sim = Simulator(sched, LinearCosts(switch_s=0.5), [Request("a", "m0", 0.0, 10, 5)], kv_bytes_per_token={"m0": 1})
    sim.run()
    done = [now for kind, name, now in sched.calls if name == "SwitchDone"]
    assert done == [0.5, 1.0, 1.0, 1.5]  # m0 copied, m1 copied, m0 back for free, m2 copied
    assert sim.devices["i0"].switch_s == 1.5


@pytest.mark.parametrize("policy,roles", [("token-level", ("prefill", "decode", "decode", "mixed")),
                                          ("dedicated", None), ("spatial", None), ("request-level", None)])
def test_forgetting_ended_requests_changes_no_decision(policy, roles) -> None:
    """keep_ended=False (the live pool's setting) drops a request from the scheduler once it ended; late events
    that still name it (a lost instance's, a step that included it) are ignored for it: same Plan log, nothing kept."""
    from scheduler.request import TERMINAL

    def log_of(keep: bool) -> tuple[str, int, int]:
        models = make_models(3)
        log = io.StringIO()
        _, sched = run_sim(policy, models, make_instances(4, roles=roles), make_workload(300, list(models), seed=4),
                           plan_log=log, faults=[(30.0, "i1")], keep_ended=keep)
        live = sum(r.status not in TERMINAL for r in sched.requests.values())
        return log.getvalue(), len(sched.requests), live

    kept, forgot = log_of(True), log_of(False)
    assert kept[1] == 300 and forgot[1] == forgot[2] == kept[2]  # only the never-ended stay (dedicated: the lost
    assert forgot[0] == kept[0]                                  # instance's model has nowhere to go)


@pytest.mark.parametrize("policy,roles", [("token-level", ("prefill", "decode", "decode", "mixed")),
                                          ("dedicated", None), ("spatial", None), ("request-level", None)])
def test_the_event_loop_makes_no_reference_cycles(policy, roles) -> None:
    """The loop runs with the cyclic collector off (its passes over the growing records cost time and found
    nothing to free); a cycle made there and dropped would stay until the next collection, so none may be
    made. Faults and chunked prefill included. The collector is on again afterwards. (The simulator and the
    scheduler are held while collecting: token-level's prefill and decode sides refer back to their policy,
    one cycle per scheduler, made when it is built and freed with it.)"""
    import gc

    models = make_models(3)
    options = {"chunked_prefill_tokens": 512} if policy == "dedicated" else {}
    gc.collect()
    assert gc.isenabled()
    sim, sched = run_sim(policy, models, make_instances(4, roles=roles), make_workload(300, list(models), seed=5),
                         faults=[(20.0, "i1")], **options)
    assert gc.isenabled()
    assert gc.collect() == 0
    assert sim.records and sched is not None


def test_a_prefill_that_moves_its_kv_to_host_takes_the_move_after_its_token() -> None:
    """token-level with first_tokens=1 prefills with kv_to_host: the first token comes when the prefill ends,
    the step (and the instance) is done once the prompt's KV is in host memory."""
    models = make_models(1)
    instances = make_instances(2, roles=("prefill", "decode"))

    def first_segments(kv_per_token_s: float) -> tuple[float, float]:
        sim, _ = run_sim("token-level", models, instances, [Request("r0", "m0", 0.0, 1000, 50)],
                         LinearCosts(kv_per_token_s=kv_per_token_s),
                         first_tokens=1)
        record = sim.records["r0"]
        assert record.finished_at is not None and record.generated == 50
        return record.first_token_at, record.segments[1][0]  # the first token, the first decoded one

    costs = LinearCosts(kv_per_token_s=1e-4)
    first, decoded = first_segments(1e-4)
    free_first, free_decoded = first_segments(0.0)
    move_s = costs.kv_move_s("m0", 1001)  # prompt + first token
    assert first == pytest.approx(costs.switch_s("m0") + costs.prefill_s("m0", 1000), abs=1e-12) == free_first
    assert decoded - free_decoded >= 2 * move_s - 1e-12  # the decoder waits for the move out, then the move in
