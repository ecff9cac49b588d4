"""Scenarios: each fleet is what its name promises, each arrival process has its rate and burstiness, and the
lengths are the real distributions (behaviour, not recorded figures)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sims.scenarios import FLEETS, LOADS, SCENARIOS, Arrivals, Scenario, scenario, sharegpt_lengths, shipped_fleet
from sims.synthetic import onoff_arrivals
from sims.workload import TraceError

REPO = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("MODELPOOL_TRACES", REPO / "../shared/traces")).resolve()
needs_azure = pytest.mark.skipif(not (TRACES / "azure-llm-2023/AzureLLMInferenceTrace_code.csv").is_file(),
                                 reason="no ../shared/traces (the Azure LLM 2023 trace)")


def dispersion(times: np.ndarray, duration_s: float, bin_s: float = 1.0) -> float:
    """Variance over mean of the counts per bin: 1 for Poisson, far above for bursts."""
    counts = np.bincount((times // bin_s).astype(int), minlength=int(duration_s // bin_s))
    return float(counts.var() / counts.mean())


def test_fleets_cover_the_matrix() -> None:
    """At least four fleets: 8+ models; qwen2, qwen3 and llama shapes together; a few large; many small."""
    sizes = {name: [m.arch.params for m in spec.fleet("h100").models] for name, spec in FLEETS.items()}
    families = {name: {spec.family(arch) for _, arch in spec.models} for name, spec in FLEETS.items()}
    assert len(FLEETS) >= 4
    assert any(len(s) >= 8 for s in sizes.values())
    assert any({"qwen2", "qwen3", "llama"} <= f for f in families.values())
    assert any(len(s) <= 4 and min(s) >= 4e9 for s in sizes.values())
    assert any(len(s) >= 10 and max(s) <= 1.5e9 for s in sizes.values())
    # none is the harness the cost terms were measured on: Qwen2.5 1.5B/3B/7B, five models
    harness = sorted(["qwen2.5-1.5b"] * 2 + ["qwen2.5-3b"] * 2 + ["qwen2.5-7b"])
    assert all(sorted(arch for _, arch in spec.models) != harness for spec in FLEETS.values())


def test_every_scenario_fleet_loads_and_the_shipped_one_too() -> None:
    for spec in FLEETS.values():
        fleet = spec.fleet("h200")
        assert [m.name for m in fleet.models] == list(spec.names)
        assert fleet.pool.default_slo.ttft_s == spec.ttft_slo_s
        assert spec.weights().sum() == pytest.approx(1.0)
    assert len(shipped_fleet().models) >= 40
    with pytest.raises(TraceError, match="unknown scenario 'nope'"):
        scenario("nope")


def test_poisson_scenario_has_its_rate_popularity_and_no_bursts() -> None:
    s = SCENARIOS["eight-poisson"]
    w = s.workload(6.0, 2000.0, seed=3)
    assert w.rate_per_s == pytest.approx(6.0, rel=0.05)
    shares = np.bincount(w.model_index, minlength=len(w.models)) / len(w)
    assert shares == pytest.approx(FLEETS["eight"].weights(), abs=0.015)
    busiest = w.arrival_s[w.model_index == 0]
    gaps = np.diff(busiest)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)
    assert dispersion(busiest, 2000.0) == pytest.approx(1.0, abs=0.25)


def test_onoff_scenario_keeps_the_mean_rate_but_comes_in_bursts() -> None:
    s = SCENARIOS["mixed-onoff"]
    w = s.workload(5.0, 3000.0, seed=4)
    assert w.rate_per_s == pytest.approx(5.0, rel=0.1)
    busiest = w.arrival_s[w.model_index == 0]
    assert dispersion(busiest, 3000.0) > 3.0
    # silences: the longest gap of the busiest model spans many mean gaps
    assert np.diff(busiest).max() > 10 * np.diff(busiest).mean()


def test_onoff_arrivals_alone() -> None:
    rng = np.random.default_rng(0)
    times = onoff_arrivals(2.0, on_s=3.0, off_s=9.0, duration_s=5000.0, rng=rng)
    assert np.all(np.diff(times) >= 0) and times.min() >= 0 and times.max() < 5000.0
    assert times.size / 5000.0 == pytest.approx(2.0, rel=0.1)
    # within a burst the rate is rate * (on + off) / on = 8/s: the median gap is that of 8/s, not 2/s
    assert np.median(np.diff(times)) == pytest.approx(np.log(2) / 8.0, rel=0.2)
    assert onoff_arrivals(0.0, 1.0, 1.0, 10.0, rng).size == 0
    with pytest.raises(TraceError):
        onoff_arrivals(1.0, 0.0, 1.0, 10.0, rng)


def test_sharegpt_lengths_are_the_real_pairs_not_uniform() -> None:
    w = SCENARIOS["large-poisson"].workload(5.0, 2000.0, seed=5)
    pairs = sharegpt_lengths()
    table = set(zip(pairs.input_tokens.tolist(), pairs.output_tokens.tolist()))
    assert all(pair in table for pair in zip(w.input_tokens.tolist(), w.output_tokens.tolist()))
    assert np.median(w.input_tokens) == pytest.approx(np.median(pairs.input_tokens), rel=0.08)
    # a uniform draw over the same range would put the median halfway; ShareGPT's prompts are skewed long-tailed
    low, high = w.input_tokens.min(), w.input_tokens.max()
    assert np.median(w.input_tokens) < low + 0.4 * (high - low)


def test_workloads_are_seeded() -> None:
    s = SCENARIOS["small-poisson"]
    a, b, c = s.workload(3.0, 200.0, seed=1), s.workload(3.0, 200.0, seed=1), s.workload(3.0, 200.0, seed=2)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.input_tokens, b.input_tokens)
    assert not np.array_equal(a.arrival_s[:20], c.arrival_s[:20])


def test_outputs_are_clipped_to_the_scenario_limit() -> None:
    s = Scenario("clipped", "eight", Arrivals("poisson"), "sharegpt", max_output_tokens=100)
    w = s.workload(5.0, 400.0, seed=1)
    assert w.output_tokens.max() == 100 and any("clipped to 100" in note for note in w.notes)


def test_loads_are_light_and_near_the_knee() -> None:
    assert set(LOADS) == {"light", "knee"} and LOADS["light"] < 0.5 <= LOADS["knee"] <= 1.0


def test_a_missing_trace_says_how_to_fetch_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPOOL_TRACES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MODELPOOL_TRACES", str(tmp_path / "nowhere"))
    with pytest.raises(TraceError, match="modelpool traces fetch azure-code"):
        SCENARIOS["small-azure-code"].workload(2.0, 60.0)


@needs_azure
def test_trace_scenario_keeps_the_traces_bursts_and_lengths_at_the_asked_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPOOL_TRACES", str(TRACES))
    w = SCENARIOS["small-azure-code"].workload(4.0, 600.0, seed=1)
    assert w.rate_per_s == pytest.approx(4.0, rel=0.01)
    gaps = np.diff(w.arrival_s)
    assert gaps.std() / gaps.mean() > 3.0  # Azure code's gaps: far burstier than Poisson (CV 1)
    # the trace's own lengths: code completion has long prompts and short outputs
    assert np.median(w.input_tokens) > 500 and np.median(w.output_tokens) < 50
    conv = SCENARIOS["large-azure-conv"].workload(4.0, 600.0, seed=1)
    assert np.median(conv.output_tokens) > 3 * np.median(w.output_tokens)
    with pytest.raises(TraceError, match="shorten --duration"):
        SCENARIOS["small-azure-code"].workload(50.0, 3000.0)
