"""The live pool's way in and out of each request (request_admit_s, token_deliver_s) and its host time around KV
moves (kv_call_host_s): what the simulator charges for them."""

from __future__ import annotations

import io

import pytest

from scheduler import Request
from sims.costmodel import RooflineCostModel
from sims.profiles import DEFAULTED, load_profile
from tests.factories import LinearCosts, make_instances, make_models, make_sim

ADMIT, DELIVER, KV_CALL = 0.004, 0.0011, 0.0025


class _PathCosts(LinearCosts):
    def request_admit_s(self) -> float:
        return ADMIT

    def token_deliver_s(self) -> float:
        return DELIVER


PROMPT_TOKEN = 2e-6


class _PromptCosts(_PathCosts):
    def request_prompt_token_s(self) -> float:
        return PROMPT_TOKEN


class _KvCallCosts(LinearCosts):
    def kv_call_host_s(self) -> float:
        return KV_CALL


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


def test_each_requests_client_times_move_by_the_way_ins_time_per_prompt_token() -> None:
    path, path_log = _run(_PathCosts())
    prompt, prompt_log = _run(_PromptCosts())
    for rid, before in path.items():
        after = prompt[rid]
        late = PROMPT_TOKEN * after.prompt_tokens  # 300 tokens: 0.6 ms
        assert after.first_token_at - after.arrival_at == pytest.approx(
            before.first_token_at - before.arrival_at + late, abs=1e-9)  # the TTFT holds it
        assert after.finished_at == pytest.approx(before.finished_at + late, abs=1e-9)
        assert after.finished_at - after.first_token_at == pytest.approx(before.finished_at - before.first_token_at)
    assert prompt_log == path_log  # the scheduler's view (and so every plan) is unchanged


def test_the_profile_terms_reach_the_simulator_through_the_roofline_and_default_to_nothing() -> None:
    base = load_profile("default")
    assert base.terms.request_admit_s == base.terms.token_deliver_s == 0.0
    assert "request_admit_s" in DEFAULTED and "charges nothing more" in DEFAULTED["token_deliver_s"]
    costs = RooflineCostModel.for_models({}, "h200", profile=base)
    assert (costs.request_admit_s(), costs.token_deliver_s()) == (0.0, 0.0)
    measured = base.model_copy(update={"terms": base.terms.model_copy(
        update={"request_admit_s": 0.00398, "token_deliver_s": 0.0011})})
    costs = RooflineCostModel.for_models({}, "h200", profile=measured)
    assert (costs.request_admit_s(), costs.token_deliver_s()) == (0.00398, 0.0011)
    assert RooflineCostModel.for_models({}, "h200", profile=base).request_prompt_token_s() == 0.0
    with_prompt = base.model_copy(update={"terms": base.terms.model_copy(update={"request_prompt_token_s": 3e-7})})
    assert RooflineCostModel.for_models({}, "h200", profile=with_prompt).request_prompt_token_s() == 3e-7
    assert RooflineCostModel.for_models({}, "h200", profile=base).kv_call_host_s() == 0.0
    with_kv = base.model_copy(update={"terms": base.terms.model_copy(update={"kv_call_host_s": 2e-4})})
    assert RooflineCostModel.for_models({}, "h200", profile=with_kv).kv_call_host_s() == 2e-4


def test_each_hand_off_takes_its_two_kv_moves_host_time_longer() -> None:
    """A request handed from the prefill to the decode instance (a SwapOut there, a SwapIn here) finishes
    2 x kv_call_host_s later; its first token (on the prefill instance, before any move) does not move."""
    plain, plain_log = _run(LinearCosts())
    moved, moved_log = _run(_KvCallCosts())
    assert '"SwapOut"' in plain_log and '"SwapIn"' in plain_log  # hand-offs happened
    for rid, before in plain.items():
        after = moved[rid]
        assert after.first_token_at == pytest.approx(before.first_token_at)
        assert after.finished_at - before.finished_at == pytest.approx(2 * KV_CALL, abs=1e-9)
