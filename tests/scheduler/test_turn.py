"""token-level's decode turn: its states and transitions (token_decode.Turn), and a Stop only when one is due."""

from __future__ import annotations

from scheduler import Decode, Prefill, Stop, StepDone, SwitchDone, make_scheduler
from scheduler.policies.token_decode import CUT_IN, FIXED, OPEN_ENDED, PREEMPT, QUOTA, Batch, Turn
from tests.factories import LinearCosts, make_instances, make_models, make_request


def test_a_turn_counts_its_steps_down_and_is_over_at_zero() -> None:
    turn = Turn(Batch("m0", ["a"]), QUOTA, 5)
    assert not turn.over and turn.stop == ""
    turn.ran(3)
    assert turn.steps_left == 2 and not turn.over
    turn.ran(2)
    assert turn.over


def test_a_cut_in_asks_for_a_stop_and_the_turn_goes_on() -> None:
    turn = Turn(Batch("m0", ["a"]), QUOTA, 5)
    turn.cut_in()
    assert turn.stop == CUT_IN and not turn.over
    turn.planned()
    assert turn.stop == "" and turn.steps_left == 5


def test_only_an_open_ended_turn_is_preempted() -> None:
    for kind in (QUOTA, FIXED):
        turn = Turn(Batch("m0", ["a"]), kind, 5)
        turn.preempt()
        assert turn.stop == "" and turn.steps_left == 5, kind
    turn = Turn(Batch("m0", ["a"]), OPEN_ENDED, 40)
    turn.preempt()
    assert turn.stop == PREEMPT and turn.over
    cut = Turn(Batch("m0", ["a"]), OPEN_ENDED, 40)
    cut.cut_in()
    cut.preempt()  # the stop keeps the cut-in's name; the turn is over either way
    assert cut.stop == CUT_IN and cut.over


def _decoding(newcomer_model: str):
    """A prefill and a decode instance; request a (m0) decodes open-ended on i1 when `newcomer_model`'s request
    b has been prefilled."""
    sched = make_scheduler("token-level", make_models(2), make_instances(2, roles=["prefill", "decode"]),
                           LinearCosts(), first_tokens=1)
    sched.submit(make_request("a", "m0", 0.0, max_output_tokens=50), 0.0)
    sched.schedule(0.0)
    sched.on_event(SwitchDone("i0", "m0"), 0.5)
    sched.on_event(StepDone("i0", "prefill", ("a",), 1), 0.6)
    plan = sched.schedule(0.6)
    assert isinstance(plan.actions["i1"][-1], Decode) and "open-ended" in plan.actions["i1"][-1].reason
    sched.submit(make_request("b", newcomer_model, 0.7, max_output_tokens=50), 0.7)
    assert isinstance(sched.schedule(0.7).actions["i0"][-1], Prefill)
    assert sched.schedule(0.7).actions == {}  # i1 decodes on: nothing asks its turn to stop yet
    if newcomer_model != "m0":
        sched.on_event(SwitchDone("i0", newcomer_model), 1.2)
    sched.on_event(StepDone("i0", "prefill", ("b",), 1), 1.3)
    return sched, sched.schedule(1.3)


def test_a_newcomer_of_the_running_model_cuts_in_and_another_model_ends_an_open_ended_turn() -> None:
    _, plan = _decoding("m0")
    assert plan.actions["i1"] == (Stop(reason="a newcomer joins the running batch"),)
    _, plan = _decoding("m1")
    assert plan.actions["i1"] == (Stop(reason="another batch is due"),)


def test_a_quota_turn_ends_by_a_deadline_but_not_before_its_floor() -> None:
    turn = Turn(Batch("m0", ["a"]), QUOTA, 200, start_at=1.0, step_s=0.01, floor=10)
    turn.ran(5)
    turn.end_by(1.5)  # 50 steps from its start
    assert turn.steps_left == 45 and turn.stop == PREEMPT
    turn.planned()
    turn.end_by(1.02)  # before its floor: it still takes 10 steps in all
    assert turn.steps_left == 5 and turn.stop == PREEMPT
    for kind in (OPEN_ENDED, FIXED):
        other = Turn(Batch("m0", ["a"]), kind, 200, start_at=1.0, step_s=0.01, floor=10)
        other.end_by(1.5)
        assert other.steps_left == 200 and other.stop == "", kind


def test_a_handed_over_newcomer_of_another_model_cuts_a_quota_turn_to_its_next_token_deadline() -> None:
    """On a decode instance, three models' batches take quota turns of ~2 s (their weights do not fit together,
    so each turn costs a switch); a short answer of a fourth (held) model arrives through the hand-off. Its next
    token is due one TPOT SLO per token it has after its first: the running turn stops and ends by then, where it
    used to run its whole quota (the newcomer's mean TPOT over 20 tokens cannot absorb ~2 s)."""
    import dataclasses
    import io
    import json

    from tests.factories import GB, run_sim

    models = make_models(4, weight_gb=30.0, tpot_s=0.1)
    models["m3"] = dataclasses.replace(models["m3"], weight_bytes=2 * GB)
    requests = [make_request(f"{m}{k}", m, 0.05 * n + 0.01 * k, 200, 400)
                for n, m in enumerate(("m0", "m1", "m2")) for k in range(4)]
    requests += [make_request("early", "m3", 0.15, 200, 10), make_request("c", "m3", 3.0, 200, 20)]
    log = io.StringIO()
    sim, _ = run_sim("token-level", models, make_instances(2, roles=["prefill", "decode"]), requests,
                     LinearCosts(step_s=0.01, switch_s=0.6), plan_log=log)
    first = sim.records["c"].first_token_at
    due = first + 8 * 0.1  # its first 8 tokens come on the prefill instance (first_tokens)
    plans = [json.loads(line) for line in log.getvalue().splitlines()]
    after = [(p["at"], a) for p in plans if p["at"] > first for a in p["actions"].get("i1", [])]
    stops = [k for k, (_, a) in enumerate(after) if a["op"] == "Stop"]
    assert stops, "the running quota turn should stop for the newcomer"
    stop = stops[0]
    assert after[stop][1]["reason"] == "another batch is due" and after[stop][0] < due
    at, rest = after[stop + 1]
    assert rest["op"] == "Decode" and rest["reason"].startswith("rest of")
    assert at + rest["max_steps"] * 0.01 <= due + 0.01  # the turn ends by the newcomer's deadline
