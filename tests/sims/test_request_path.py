"""The live pool's way in and out of each request (request_admit_s, token_deliver_s): what the simulator charges
for them, and how they are fitted to a benchmarks/gpu_pool.py run."""

from __future__ import annotations

import io

import pytest

from scheduler import Request
from sims.costmodel import RooflineCostModel
from sims.profiles import DEFAULTED, load_profile
from sims.profiles.calibrated import MIN_IDLE_REQUESTS, with_live_host, with_request_path
from tests.factories import LinearCosts, make_instances, make_models, make_sim

ADMIT, DELIVER = 0.004, 0.0011


class _PathCosts(LinearCosts):
    def request_admit_s(self) -> float:
        return ADMIT

    def token_deliver_s(self) -> float:
        return DELIVER


def _run(costs: LinearCosts) -> tuple[dict, str]:
    models, instances = make_models(2), make_instances(2, roles=["prefill", "decode"])
    requests = [Request(f"r{k}", f"m{k % 2}", 2.0 * k, 300, 20) for k in range(8)]  # one at a time: no queue
    log = io.StringIO()
    sim, _ = make_sim("token-level", models, instances, requests, costs=costs, plan_log=log)
    sim.run()
    return sim.records, log.getvalue()


def test_each_request_reaches_the_scheduler_admit_s_late_and_its_tokens_the_client_deliver_s_late() -> None:
    plain, plain_log = _run(LinearCosts())
    path, path_log = _run(_PathCosts())
    assert len(plain) == len(path) == 8
    for rid, before in plain.items():
        after = path[rid]
        assert after.arrival_at == before.arrival_at  # the client's arrival: TTFT counts from it
        assert after.first_token_at - after.arrival_at == pytest.approx(
            before.first_token_at - before.arrival_at + ADMIT + DELIVER, abs=1e-9)
        assert after.finished_at - after.first_token_at == pytest.approx(before.finished_at - before.first_token_at)
        assert after.generated == before.generated == 20
    # the same decisions, each plan that much later: only the arrival times the scheduler sees moved
    assert [line.split('"at":')[0] for line in path_log.splitlines()] == \
        [line.split('"at":')[0] for line in plain_log.splitlines()]


def test_the_profile_terms_reach_the_simulator_through_the_roofline_and_default_to_nothing() -> None:
    base = load_profile("h200-cudagraph")
    assert base.terms.request_admit_s == base.terms.token_deliver_s == 0.0
    assert "request_admit_s" in DEFAULTED and "charges nothing more" in DEFAULTED["token_deliver_s"]
    costs = RooflineCostModel.for_models({}, "h200", profile=base)
    assert (costs.request_admit_s(), costs.token_deliver_s()) == (0.0, 0.0)
    fitted = with_request_path(base, _light_run(), "run-r1.json", gpu="h200")
    costs = RooflineCostModel.for_models({}, "h200", profile=fitted)
    assert (costs.request_admit_s(), costs.token_deliver_s()) == (0.00398, 0.0011)


def _light_run(idle: int = 26) -> dict:
    return {"backend": "processes", "layout": "pd", "rate_rps": 1,
            "ttft_parts": {"requests": 32,
                           "admission (sent while idle)": {"n": idle, "mean_ms": 5.77, "p50_ms": 3.98, "max_ms": 46.1,
                                                           "sum_s": 0.15},
                           "delivery (sent while idle)": {"n": 27, "mean_ms": 1.16, "p50_ms": 1.1, "max_ms": 2.0,
                                                          "sum_s": 0.03}}}


def test_the_request_path_is_fitted_to_a_light_runs_idle_requests_with_provenance() -> None:
    base = load_profile("h200-cudagraph")
    fitted = with_request_path(base, _light_run(), "run-r1.json, fitted 2026-12-02", gpu="h200", name="mine")
    assert fitted.name == "mine" and fitted.terms.request_admit_s == 0.00398 and fitted.terms.token_deliver_s == 0.0011
    assert fitted.terms.model_dump(exclude={"request_admit_s", "token_deliver_s"}) == \
        base.terms.model_dump(exclude={"request_admit_s", "token_deliver_s"})  # nothing else moves
    for term, figure in (("request_admit_s", "3.98 ms"), ("token_deliver_s", "1.1 ms")):
        provenance = fitted.provenance[term]
        assert provenance.status == "measured" and provenance.gpus == ("h200",)
        assert figure in provenance.source and "26 requests" in provenance.source and "run-r1.json" in provenance.source
    with pytest.raises(ValueError, match=f"needs {MIN_IDLE_REQUESTS}"):  # under load an instance is seldom idle
        with_request_path(base, _light_run(idle=MIN_IDLE_REQUESTS - 1), "run-r19.json", gpu="h200")
    with pytest.raises(ValueError, match="no ttft_parts"):
        with_request_path(base, {"rate_rps": 1}, "old.json", gpu="h200")


def test_from_live_fits_the_request_path_only_where_the_run_has_enough_idle_requests() -> None:
    base = load_profile("h200-cudagraph")
    timings = {"slot1": {"<=1": {"steps": 40, "batch_mean": 1.0, "added_ms_p50": 0.05},
                         "<=32": {"steps": 40, "batch_mean": 20.0, "added_ms_p50": 0.09}}}
    light = with_live_host(base, {**_light_run(), "decode_timings": timings}, "r1.json", gpu="h200")
    heavy = with_live_host(base, {**_light_run(idle=2), "decode_timings": timings}, "r16.json", gpu="h200")
    assert light.terms.request_admit_s == 0.00398 and "request_admit_s" in light.description
    assert heavy.terms.request_admit_s == 0.0 and "request_admit_s" not in heavy.description
