"""benchmarks/fidelity_rate.py: the factor on a run's rate at which a simulated figure meets the live one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fidelity_rate import matching_factor  # noqa: E402


def _figures(factor: float) -> dict[str, float]:
    """A queue's figures at `factor` times the rate: TTFT rising steeply toward saturation at 1.5x, attainment
    falling."""
    wait = 0.05 / max(1e-9, 1.5 - factor)
    return {"ttft_p50_s": 0.03 + wait, "ttft_p90_s": 0.03 + 3 * wait, "slo_attainment": min(1.0, 1.3 - 0.4 * factor)}


@pytest.mark.parametrize("factor", [0.62, 0.9, 1.0, 1.25])
def test_the_factor_where_the_simulated_figure_meets_the_live_one_is_found(factor: float) -> None:
    live = _figures(factor)
    for name in ("ttft_p50_s", "ttft_p90_s"):
        assert matching_factor(name, live[name], _figures, steps=12) == pytest.approx(factor, rel=0.005)
    if live["slo_attainment"] < 1.0:
        assert matching_factor("slo_attainment", live["slo_attainment"], _figures, steps=12) == pytest.approx(
            factor, rel=0.005)


def test_a_live_figure_the_simulator_does_not_reach_inside_the_range_has_no_factor() -> None:
    assert matching_factor("ttft_p50_s", 0.01, _figures) is None  # below the simulated figure at every rate
    assert matching_factor("ttft_p50_s", _figures(1.49)["ttft_p50_s"], _figures, high=1.4) is None
    assert matching_factor("slo_attainment", 0.99, lambda f: {"slo_attainment": None}) is None
