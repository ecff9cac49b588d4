"""Issue 3's "done when": a 1-hour Azure 2023 replay and a ServeGen-based multi-model replay
each finish under every policy with sane numbers.

Both are mapped onto the shipped 47-model fleet: the Azure conversation trace (one model,
~19k requests in its hour) split over the models with Zipf(1.2) popularity, and a slice of
ServeGen's three language models with every client as its own stream, dealt round-robin onto
the fleet and stretched to ~10 req/s. Dedicated gets one instance per model (54 GPUs is the
minimum; 64 leaves spares); the pooled policies get 24 GPUs.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import pytest

from modelpool.config import load_fleet
from sims.run import SimResult, simulate
from sims.traces import load_workload
from sims.workload import Workload

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
REPLAYS = {
    "azure-1h": "azure-conv;duration=3600;popularity=zipf:1.2",
    "servegen": "servegen:language/m-large,m-mid,m-small;by=client;duration=5;scale=0.005",
}
GPUS = {"dedicated": 64, "request-level": 24, "spatial": 24, "token-level": 24}


@cache
def _workload(name: str) -> Workload:
    fleet = load_fleet(ROOT / "models.yaml")
    return load_workload(REPLAYS[name], [m.name for m in fleet.models], seed=0)


@cache
def _replay(name: str, policy: str) -> SimResult:
    return simulate(load_fleet(ROOT / "models.yaml"), _workload(name), policy, num_gpus=GPUS[policy])


def test_the_replays_are_the_intended_size() -> None:
    azure, servegen = _workload("azure-1h"), _workload("servegen")
    assert 15_000 < len(azure) < 25_000 and 3_000 < azure.duration_s <= 3_600
    assert len(set(azure.model_index.tolist())) == 47
    assert 5_000 < len(servegen) < 20_000 and len(set(servegen.model_index.tolist())) > 20


@pytest.mark.parametrize("policy", list(GPUS))
@pytest.mark.parametrize("name", list(REPLAYS))
def test_replay_finishes_with_sane_numbers(name: str, policy: str) -> None:
    workload = _workload(name)
    result = _replay(name, policy)
    m = result.metrics
    # every request ends: completed, or failed with a reason
    assert m["num_requests"] == len(workload) == len(result.records)
    assert m["unfinished"] == 0 and m["completed"] + m["failed"] == len(workload)
    for record in result.records.values():
        if record.failed:
            continue
        assert record.finished_at is not None and record.generated == record.output_tokens
        assert record.arrival_at <= record.first_token_at <= record.finished_at
    assert all(r.failed for r in result.records.values() if r.finished_at is None)
    assert m["failed"] <= 0.01 * len(workload)
    # latencies positive and ordered
    for metric in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (m[f"p{q}_{metric}_ms"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, (metric, p50, p90, p99)
        assert m[f"mean_{metric}_ms"] > 0
    assert m["p50_ttft_ms"] <= m["p50_e2el_ms"]
    # throughput is tokens over the makespan
    span = m["duration"]
    assert span >= workload.duration_s
    assert math.isclose(m["output_throughput"], m["total_output_tokens"] / span, rel_tol=1e-9)
    assert math.isclose(m["request_throughput"], m["completed"] / span, rel_tol=1e-9)
    assert m["total_output_tokens"] == sum(r.generated for r in result.records.values() if not r.failed)
    assert 0 < m["gpu_busy_share"] <= 1
    assert 0 <= m["aegaeon_slo_attainment"] <= 1 and 0 <= m["slo_attainment"] <= 1
    # rough sanity: a lightly loaded pool meets most SLOs; dedicated with spares meets nearly all
    assert m["slo_attainment"] >= (0.95 if policy == "dedicated" else 0.8)
    if policy == "dedicated":
        assert m["num_switches"] == sum(1 for spec in result.instances)  # each instance loads its model once
