"""decode_quotas against hand-worked examples; the request lifecycle's checked edges."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import IllegalTransition, RequestStatus, decode_quotas, transition
from scheduler.quotas import first_decode_quota, round_alpha
from tests.factories import make_request

S = RequestStatus


def test_quotas_two_batches_hand_worked() -> None:
    # d = 10 ms and 20 ms, TPOT 100 ms -> n = 10, 5; sum 1/n = 0.3; c0 = 0.5 s
    # alpha = max(0.5 / (5 * 4) + 0.3, 0.5) = 0.5; q1 = 0.5 / (10 * 0.2) = 0.25; q2 = 0.5 / (5 * 0.2) = 0.5
    q = decode_quotas([0.010, 0.020], 0.1, 0.5)
    assert q == pytest.approx([0.25, 0.5])
    # each batch then averages alpha * TPOT = 50 ms per token over the round
    round_s = 0.5 + sum(q)
    assert round_s / (q[0] / 0.010) == pytest.approx(0.05)
    assert round_s / (q[1] / 0.020) == pytest.approx(0.05)


def test_quotas_when_the_max_quota_term_dominates() -> None:
    # d = 40 ms, 50 ms, TPOT 100 ms -> n = 2.5, 2; sum 1/n = 0.9; c0 = 2 s
    # alpha = 2 / (2 * 4) + 0.9 = 1.15 (> 1: the pace SLO cannot hold); q_i = c0 / (n_i * 0.25)
    q = decode_quotas([0.040, 0.050], 0.1, 2.0)
    assert q == pytest.approx([3.2, 4.0])  # the slowest batch gets exactly Q_max
    assert round_alpha([0.040, 0.050], 0.1, 2.0) == pytest.approx(1.15)


def test_quotas_without_switching_cost_give_long_proportional_turns() -> None:
    assert decode_quotas([0.01, 0.02], 0.1, 0.0) == pytest.approx([2.0, 4.0])


def test_quotas_single_batch_and_empty() -> None:
    # one batch: n = 10, alpha = max(1 / (10 * 4) + 0.1, 0.5) = 0.5, q = 1 / (10 * 0.4) = 0.25
    assert decode_quotas([0.01], 0.1, 1.0) == pytest.approx([0.25])
    assert decode_quotas([], 0.1, 1.0) == []


@pytest.mark.parametrize("args", [([0.0], 0.1, 1.0), ([0.01], 0.0, 1.0), ([0.01], 0.1, -1.0)])
def test_quotas_reject_nonsense(args: tuple) -> None:
    with pytest.raises(ValueError, match="positive"):
        decode_quotas(*args)
    with pytest.raises(ValueError, match="positive"):
        first_decode_quota(*args)


@given(st.lists(st.floats(1e-4, 0.5), min_size=1, max_size=5), st.floats(0.01, 1.0), st.floats(0.0, 5.0),
       st.floats(0.5, 8.0))
def test_first_quota_is_exactly_the_first_of_the_round(steps: list[float], tpot: float, c0: float, q_max: float) -> None:
    quotas = decode_quotas(steps, tpot, c0, q_max)
    assert first_decode_quota(steps, tpot, c0, q_max) == quotas[0]  # bit for bit: the token-level plans use it
    assert len(quotas) == len(steps) and all(q >= 0 for q in quotas)


def test_lifecycle_allows_the_normal_path() -> None:
    req = make_request()
    for to in (S.PREFILLING, S.SWAPPED, S.RUNNING, S.SWAPPED, S.RUNNING, S.FINISHED):
        transition(req, to)
    assert req.status is S.FINISHED and req.done


@pytest.mark.parametrize("path", [[S.RUNNING], [S.PREFILLING, S.RUNNING, S.PREFILLING],
                                  [S.PREFILLING, S.FINISHED, S.QUEUED], [S.CANCELLED, S.FAILED]])
def test_lifecycle_rejects_illegal_edges(path: list[RequestStatus]) -> None:
    req = make_request()
    with pytest.raises(IllegalTransition, match=req.request_id):
        for to in path:
            transition(req, to)


def test_only_transition_writes_status() -> None:
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    writers = []
    for path in (root / "scheduler").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.status\s*=[^=]", line) and path.name != "request.py":
                writers.append(f"{path.name}:{number}")
    assert writers == []
