"""SLO and latency metrics: hand-worked cases, closed forms against per-token references, speed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sims.metrics import request_rows, summarize, weighted_percentiles
from sims.simulator import RequestRecord
from tests.factories import make_instances, make_models, make_workload, run_sim

SLO = {"m0": (1.0, 0.1), "m1": (2.0, 0.1)}


def record(segments: list[tuple[float, int, float]], *, request_id: str = "r", model: str = "m0",
           arrival_at: float = 0.0, prompt_tokens: int = 100, failed: str = "", finished: bool = True) -> RequestRecord:
    """A record as the simulator leaves it after these segments."""
    generated = sum(n for _, n, _ in segments)
    last = segments[-1][0] + (segments[-1][1] - 1) * segments[-1][2] if segments else None
    return RequestRecord(request_id, model, arrival_at, prompt_tokens, generated, generated,
                         segments[0][0] if segments else None, last if finished and not failed else None,
                         failed, list(segments))


def steady() -> RequestRecord:
    """TTFT 1 s, then 9 more tokens 50 ms apart: 10 tokens, finish at 1.45 s."""
    return record([(1.0, 1, 0.0), (1.05, 9, 0.05)])


def stalled() -> RequestRecord:
    """First token at 0.5 s, 10 tokens 100 ms apart (0.6..1.5), a 2 s stall, 10 more (3.5..4.4)."""
    return record([(0.5, 1, 0.0), (0.6, 10, 0.1), (3.5, 10, 0.1)])


def test_steady_request_latencies() -> None:
    m = summarize([steady()], SLO, duration_s=10.0)
    assert m["completed"] == 1 and m["failed"] == 0 and m["unfinished"] == 0
    assert m["mean_ttft_ms"] == pytest.approx(1000.0)
    assert m["mean_tpot_ms"] == pytest.approx(50.0) and m["p99_tpot_ms"] == pytest.approx(50.0)
    assert m["mean_e2el_ms"] == pytest.approx(1450.0)
    assert m["p50_itl_ms"] == pytest.approx(50.0) and m["std_itl_ms"] == pytest.approx(0.0, abs=1e-9)
    assert m["per_user_output_tokens_per_s"] == pytest.approx(20.0)  # one stream: 9 tokens in 0.45 s
    assert m["output_throughput"] == pytest.approx(1.0)  # 10 tokens over the 10 s run
    assert m["total_token_throughput"] == pytest.approx(11.0)  # plus 100 prompt tokens
    assert m["request_throughput"] == m["request_goodput"] == pytest.approx(0.1)
    assert m["slo_attainment"] == m["aegaeon_slo_attainment"] == 1.0


def test_two_second_stall_scored_by_hand() -> None:
    # Due: token k at 1 + (k-1)*0.1. Tokens 1..11 are early. Token 12 (due 2.1) comes at 3.5: behind
    # from 2.1, 1.4 s; tokens 13..21 stay 1.4 s late, each behind for its whole 0.1 s wait: 0.9 s.
    m = summarize([stalled()], SLO, duration_s=10.0)
    assert m["aegaeon_slo_attainment"] == pytest.approx(1 - 2.3 / 4.4)
    assert m["mean_tpot_ms"] == pytest.approx((4.4 - 0.5) / 20 * 1e3)  # 195 ms > 100 ms
    assert m["slo_attainment"] == 0.0
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([100.0] * 19 + [2000.0], 99))


def test_aegaeon_tolerates_a_burst_gap_the_standard_metric_fails() -> None:
    # TTFT SLO 2 s, first token at 0.2 s; a 1 s pause uses up slack, then 10 tokens at 100 ms.
    gap = record([(0.2, 1, 0.0), (1.2, 10, 0.1)], model="m1")
    m = summarize([gap], SLO, duration_s=10.0)
    assert m["mean_tpot_ms"] == pytest.approx(190.0)
    assert m["slo_attainment"] == 0.0 and m["request_goodput"] == 0.0
    assert m["aegaeon_slo_attainment"] == 1.0


def test_failed_and_unfinished_requests_are_misses() -> None:
    records = {"a": steady(), "b": record([(0.5, 1, 0.0)], request_id="b", failed="evicted"),
               "c": record([(0.5, 3, 0.05)], request_id="c", finished=False)}
    m = summarize(records, SLO, duration_s=10.0)
    assert (m["num_requests"], m["completed"], m["failed"], m["unfinished"]) == (3, 1, 1, 1)
    assert m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["aegaeon_slo_attainment"] == pytest.approx(1 / 3)
    assert m["total_output_tokens"] == 10 and m["mean_ttft_ms"] == pytest.approx(1000.0)  # completed only


def test_one_token_requests_pass_on_ttft_alone() -> None:
    fast, slow = record([(0.9, 1, 0.0)]), record([(1.1, 1, 0.0)], request_id="s")
    m = summarize([fast, slow], SLO, duration_s=1.0, makespan_s=2.0)
    assert m["slo_attainment"] == 0.5 and m["duration"] == 2.0
    assert m["mean_tpot_ms"] == 0.0 and m["p99_itl_ms"] == 0.0  # no samples: 0, as vLLM reports
    assert m["per_user_output_tokens_per_s"] == 0.0


def test_makespan_defaults_to_the_last_finish() -> None:
    assert summarize([stalled()], SLO, duration_s=2.0)["duration"] == pytest.approx(4.4)
    assert summarize([stalled()], SLO, duration_s=9.0)["duration"] == 9.0


def test_device_figures() -> None:
    devices = {"i0": SimpleNamespace(busy_s=30.0, num_switches=4, switch_s=2.0, kv_moved_bytes=1e9),
               "i1": SimpleNamespace(busy_s=15.0, num_switches=2, switch_s=1.0, kv_moved_bytes=0.0)}
    m = summarize([steady()], SLO, duration_s=60.0, devices=devices, num_gpus=4, gpus_per_instance={"i1": 2})
    assert m["gpu_busy_share"] == pytest.approx((30 + 15 * 2) / (4 * 60))
    assert (m["num_switches"], m["switch_seconds"], m["kv_bytes_moved"]) == (6, 3.0, 1e9)
    assert m["switches_per_gpu_per_minute"] == pytest.approx(6 / 4)
    assert summarize([steady()], SLO, 60.0, devices)["num_gpus"] == 2  # default: one GPU per instance
    assert "gpu_busy_share" not in summarize([steady()], SLO, 60.0)


def test_per_model_figures() -> None:
    records = [steady(), stalled(), record([(0.2, 1, 0.0), (1.2, 10, 0.1)], request_id="g", model="m1")]
    per = summarize(records, SLO, duration_s=10.0)["per_model"]
    assert list(per) == ["m0", "m1"]
    m0 = per["m0"]
    assert (m0["num_requests"], m0["completed"], m0["total_output_tokens"]) == (2, 2, 31)
    assert m0["slo_attainment"] == 0.5 and m0["aegaeon_slo_attainment"] == pytest.approx((1 + 1 - 2.3 / 4.4) / 2)
    assert m0["p50_ttft_ms"] == pytest.approx(750.0) and m0["ttft_slo_ms"] == 1000.0
    assert m0["p90_tpot_ms"] == pytest.approx(np.percentile([50.0, 195.0], 90))
    assert per["m1"]["request_throughput"] == pytest.approx(0.1) and per["m1"]["slo_attainment"] == 0.0


def test_request_rows() -> None:
    rows = request_rows({"r": steady(), "x": record([(0.5, 1, 0.0)], request_id="x", failed="lost")}, SLO)
    assert rows[0] == {"request_id": "r", "model": "m0", "arrival_at": 0.0, "prompt_tokens": 100,
                       "output_tokens": 10, "ttft_ms": 1000.0, "tpot_ms": 50.0, "e2el_ms": 1450.0,
                       "completed": True, "ttft_attained": True, "tpot_attained": True, "slo_attained": True,
                       "aegaeon_score": 1.0}
    assert rows[1]["ttft_ms"] is None and rows[1]["slo_attained"] is False and rows[1]["aegaeon_score"] == 0.0


def test_unknown_model_is_an_error() -> None:
    with pytest.raises(ValueError, match="m9"):
        summarize([record([(1.0, 1, 0.0)], model="m9")], SLO, 1.0)


def test_summarizes_a_simulated_run() -> None:
    models = make_models(3)
    sim, _ = run_sim("token-level", models, make_instances(3, roles=["prefill", "decode", "decode"]),
                     make_workload(100, list(models), seed=3))
    slo = {n: (p.ttft_slo_s, p.tpot_slo_s) for n, p in models.items()}
    m = summarize(sim.records, slo, duration_s=60.0, devices=sim.devices, num_gpus=3)
    assert m["completed"] + m["failed"] + m["unfinished"] == 100
    assert 0 <= m["slo_attainment"] <= 1 and 0 <= m["aegaeon_slo_attainment"] <= 1 and 0 < m["gpu_busy_share"] <= 1
    assert m["total_output_tokens"] == sum(r.generated for r in sim.records.values() if r.finished_at and not r.failed)
    assert json.loads(json.dumps(m, allow_nan=False)) == m  # JSON-ready: plain numbers, no NaN


# ---- closed forms against per-token references -------------------------------------------

def tokens(rec: RequestRecord) -> list[float]:
    return [t0 + i * delta for t0, n, delta in rec.segments for i in range(n)]


def reference_score(rec: RequestRecord, ttft_slo: float, tpot_slo: float) -> float:
    """Aegaeon's score token by token: behind on [max(due_k, tau_{k-1}), tau_k)."""
    taus = tokens(rec)
    prev, behind = rec.arrival_at, 0.0
    for k, tau in enumerate(taus):
        behind += max(0.0, tau - max(rec.arrival_at + ttft_slo + k * tpot_slo, prev))
        prev = tau
    return 1 - behind / (taus[-1] - rec.arrival_at)


def reference_itl(recs: list[RequestRecord]) -> list[float]:
    return [b - a for rec in recs for a, b in zip(tokens(rec), tokens(rec)[1:])]


grid = st.sampled_from([0.0, 0.05, 0.1, 0.15, 0.3])  # hits the ties: spacing == TPOT SLO, lateness == 0
seconds = st.one_of(grid, st.floats(0.0, 2.0))
segment = st.tuples(seconds, st.integers(1, 30), st.one_of(grid, st.floats(0.0, 0.5)))  # gap before, n, δ


@st.composite
def requests(draw: st.DrawFn) -> RequestRecord:
    arrival = draw(st.floats(0.0, 100.0))
    t, segments = arrival + draw(st.floats(0.01, 3.0)), []
    for gap, n, delta in draw(st.lists(segment, min_size=1, max_size=8)):
        t += gap
        segments.append((t, n, delta))
        t += (n - 1) * delta
    return record(segments, arrival_at=arrival)


@settings(max_examples=300, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=4), st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.05, 0.1]))
def test_closed_form_equals_per_token_references(recs: list[RequestRecord], ttft_slo: float, tpot_slo: float) -> None:
    recs = [RequestRecord(f"r{i}", "m0", r.arrival_at, 1, r.output_tokens, r.generated, r.first_token_at,
                          r.finished_at, "", r.segments) for i, r in enumerate(recs)]
    m = summarize(recs, {"m0": (ttft_slo, tpot_slo)}, duration_s=200.0)
    scores = [reference_score(r, ttft_slo, tpot_slo) for r in recs]
    assert m["aegaeon_slo_attainment"] == pytest.approx(np.mean(scores), abs=1e-9)
    gaps = np.array(reference_itl(recs)) * 1e3
    if len(gaps):
        for q in (50, 90, 99):
            assert m[f"p{q}_itl_ms"] == pytest.approx(np.percentile(gaps, q), abs=1e-6)
        assert m["mean_itl_ms"] == pytest.approx(gaps.mean(), abs=1e-6)
        assert m["std_itl_ms"] == pytest.approx(gaps.std(), abs=1e-6)


@given(st.lists(st.tuples(st.floats(-1e3, 1e3), st.integers(0, 5)), min_size=1, max_size=30),
       st.lists(st.floats(0, 100), min_size=1, max_size=5))
def test_weighted_percentiles_equal_numpy_on_the_expanded_array(pairs: list[tuple[float, int]],
                                                                qs: list[float]) -> None:
    values, weights = np.array([v for v, _ in pairs]), np.array([w for _, w in pairs], dtype=np.float64)
    expanded = np.repeat(values, weights.astype(int))
    want = np.percentile(expanded, qs) if len(expanded) else np.zeros(len(qs))
    assert weighted_percentiles(values, weights, qs) == pytest.approx(list(want), abs=1e-9)


@pytest.mark.slow
def test_a_million_requests_summarize_consistently() -> None:
    """Scale check (speed belongs to benchmarks/sim_speed.py): 1M records give the figures of their 20k templates."""
    rng = np.random.default_rng(0)
    num_templates, reuse = 20_000, 50  # 20k distinct 20-segment streams, each under 50 request ids
    arrivals = rng.uniform(0, 3600, num_templates)
    counts = rng.integers(1, 32, (num_templates, 20))
    counts[:, 0] = 1  # the prefill's token
    deltas = rng.uniform(0.02, 0.08, (num_templates, 20))
    deltas[:, 0] = 0.0
    spans = (counts - 1) * deltas
    gaps = rng.uniform(0.02, 1.0, (num_templates, 20))
    gaps[:, 0] = rng.uniform(0.1, 2, num_templates)  # TTFT
    starts = arrivals[:, None] + np.cumsum(gaps, axis=1) + np.cumsum(spans, axis=1) - spans
    templates = [record(list(zip(s, c, d)), arrival_at=a) for a, s, c, d in
                 zip(arrivals.tolist(), starts.tolist(), counts.tolist(), deltas.tolist())]
    recs = [RequestRecord(f"r{i}", f"m{i % 40}", t.arrival_at, 100, t.output_tokens, t.generated, t.first_token_at,
                          t.finished_at, "", t.segments) for i in range(reuse) for t in templates]
    slo = {f"m{k}": (1.0 + k / 40, 0.05) for k in range(40)}
    m = summarize(recs, slo, duration_s=3600.0)
    small = summarize(templates, {"m": (1.0, 0.05)} | {t.model: (1.0, 0.05) for t in templates}, duration_s=3600.0)
    assert m["completed"] == 1_000_000 and len(m["per_model"]) == 40
    for key in ("mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms"):
        assert m[key] == pytest.approx(small[key], rel=1e-6), key
