"""benchmarks/fidelity_breakdown.py splits a request's time from a Plan log the same way on both sides."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fidelity_breakdown import Request, attach, busy_overlap, live_ids, read_plans  # noqa: E402


def plan(at, **actions):
    return json.dumps({"actions": actions, "at": at, "failed": []})


def prefill(ids, swapout=()):
    acts = [{"op": "SwapOut", "request_ids": list(swapout), "reason": "hand the KV over"}] if swapout else []
    return acts + [{"op": "Prefill", "request_ids": list(ids), "reason": "head group", "kv_to_host": False}]


def decode(ids, steps, reason="x turn", switch=False):
    acts = [{"op": "Switch", "model": "m", "evict": True, "keep": [], "reason": "due"}] if switch else []
    return acts + [{"op": "Decode", "request_ids": list(ids), "max_steps": steps, "reason": reason}]


LOG = [
    plan(1.00, p=prefill(["a"])),
    plan(1.02, p=decode(["a"], 7, "first 8 tokens before the hand-off")),
    plan(1.04, p=prefill(["b"], swapout=["a"])),
    plan(1.05, d=decode(["a"], 10, switch=True)),
    plan(1.07, p=decode(["b"], 7, "first 8 tokens before the hand-off")),
    plan(1.08, d=[{"op": "Stop", "reason": "another batch is due"}]),
    plan(1.09, d=decode(["a", "b"], 5)),
    plan(1.10, p=[{"op": "SwapOut", "request_ids": ["b"], "reason": "hand the KV over"}]),
    plan(1.20, d=decode(["a"], 3)),
]


def test_steps_end_at_their_instances_next_plan_and_a_stop_marks_the_step_it_cuts():
    log = read_plans(LOG)
    p, d = log.by_instance["p"], log.by_instance["d"]
    assert [s.kind for s in p] == ["prefill", "handoff-decode", "prefill", "handoff-decode", "other"]
    assert [s.span_s for s in p[:4]] == pytest.approx([0.02, 0.02, 0.03, 0.03])
    assert p[-1].end is None
    assert [s.kind for s in d] == ["turn", "turn", "turn"]  # the Stop is no step of its own
    assert d[0].stopped and d[0].end == pytest.approx(1.09) and not d[1].stopped
    assert d[1].next_ids == ("a",) and d[1].max_steps == 5


def test_overlap_counts_the_peers_busy_share_of_a_step():
    log = read_plans(LOG)
    turn = log.by_instance["d"][0]  # 1.05 - 1.09: the peer's hand-off decode 1.04-1.07 and its steps after
    assert busy_overlap(turn, log.by_instance["p"]) == pytest.approx(1.0)
    last = log.by_instance["d"][1]  # 1.09 - 1.20: the peer's hand-off decode to 1.10, then a lone SwapOut (idle)
    assert busy_overlap(last, log.by_instance["p"]) == pytest.approx(0.01 / 0.11)


def test_a_requests_ttft_and_tpot_split_into_parts_that_add_up():
    log = read_plans(LOG)
    reqs = {"a": Request(0, "m", arrival=0.99, ttft=0.031, tpot=0.01, tokens=30)}
    attach(reqs, log)
    parts = reqs["a"].parts(offset=0.001)
    assert parts["wait"] == pytest.approx(0.01) and parts["prefill"] == pytest.approx(0.02)
    assert parts["rest"] == pytest.approx(0.001)
    assert parts["handoff_steps"] == pytest.approx(0.019) and parts["handoff_wait"] == pytest.approx(0.01)
    assert parts["num_turns"] == 3
    span = parts["tpot"] * 29
    assert parts["handoff_steps"] + parts["handoff_wait"] + parts["in_turns"] + parts["between_turns"] \
        == pytest.approx(span)


def test_live_ids_come_in_the_gateways_order():
    lines = [plan(1.0, p=prefill(["cmpl-ab0a"])), plan(1.1, p=prefill(["cmpl-ab09", "cmpl-ab0b"]))]
    assert live_ids(lines) == ["cmpl-ab09", "cmpl-ab0a", "cmpl-ab0b"]
