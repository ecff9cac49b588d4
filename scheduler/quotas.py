"""Aegaeon's decode time quotas: how long each batch of a round may decode.

With d_i the predicted step time of batch i, n_i = TPOT_SLO / d_i the tokens it
may produce per SLO period, and c0 the switching overhead of one round:

    alpha = max(c0 / (min_i n_i * Q_max) + sum_j 1/n_j, 0.5)
    q_i   = c0 / (n_i * (alpha - sum_j 1/n_j))

Every batch then spends alpha * TPOT_SLO per token on average over a round;
alpha <= 1 means the pace SLO holds. (Aegaeon, SOSP'25, section 4; its artifact.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def decode_quotas(step_times_s: Sequence[float], tpot_slo_s: float, switch_time_s: float,
                  max_quota_s: float = 4.0) -> list[float]:
    """Time quota (seconds) per batch of one round, in the order given.

    With no switching overhead (c0 = 0) the formula degenerates; any turn
    length then keeps the pace, so the slowest batch gets `max_quota_s` and
    the others proportionally less (the c0 > 0 branch's limit when the
    Q_max term dominates).
    """
    if not step_times_s:
        return []
    n_min, inverse_sum, alpha = _round_terms(step_times_s, tpot_slo_s, switch_time_s, max_quota_s)
    return [_quota(tpot_slo_s / d, n_min, inverse_sum, alpha, switch_time_s, max_quota_s) for d in step_times_s]


def first_decode_quota(step_times_s: Sequence[float], tpot_slo_s: float, switch_time_s: float,
                       max_quota_s: float = 4.0) -> float:
    """`decode_quotas(...)[0]` without the others' (a turn is planned for the first batch only)."""
    n_min, inverse_sum, alpha = _round_terms(step_times_s, tpot_slo_s, switch_time_s, max_quota_s)
    return _quota(tpot_slo_s / step_times_s[0], n_min, inverse_sum, alpha, switch_time_s, max_quota_s)


def round_alpha(step_times_s: Sequence[float], tpot_slo_s: float, switch_time_s: float,
                max_quota_s: float = 4.0) -> float:
    """The round's pace factor alpha (mean time per token / TPOT SLO)."""
    return _round_terms(step_times_s, tpot_slo_s, switch_time_s, max_quota_s)[2]


def _round_terms(step_times_s: Sequence[float], tpot_slo_s: float, switch_time_s: float,
                 max_quota_s: float) -> tuple[float, float, float]:
    """(min_i n_i, sum_j 1/n_j, alpha) of a round, its inputs checked. One plain loop: a turn boundary computes
    this."""
    n_min, inverse_sum, d_min = math.inf, 0.0, math.inf
    for d in step_times_s:
        d_min = min(d_min, d)
    if tpot_slo_s <= 0 or max_quota_s <= 0 or switch_time_s < 0 or not d_min > 0 or d_min == math.inf:
        raise ValueError(f"need positive step times, TPOT SLO and max quota and c0 >= 0; got "
                         f"d={list(step_times_s)}, tpot={tpot_slo_s}, c0={switch_time_s}, q_max={max_quota_s}")
    for d in step_times_s:
        n = tpot_slo_s / d
        inverse_sum += 1.0 / n
        if n < n_min:
            n_min = n
    return n_min, inverse_sum, max(switch_time_s / (n_min * max_quota_s) + inverse_sum, 0.5)


def _quota(n_i: float, n_min: float, inverse_sum: float, alpha: float, switch_time_s: float,
           max_quota_s: float) -> float:
    if switch_time_s == 0 or alpha == inverse_sum:  # no c0, or one too small to move alpha: the c0 -> 0 limit
        return max_quota_s * n_min / n_i
    return switch_time_s / (n_i * (alpha - inverse_sum))
