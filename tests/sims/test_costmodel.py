"""The roofline cost model: accuracy against the H200 anchors, its physics, its closed forms."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer import Typer
from typer.testing import CliRunner

from modelpool.estimate import estimate_command, estimate_report, render_estimate
from scheduler.catalog import ARCHS
from scheduler.costs import CostModel, padded_prefill_tokens
from scheduler.fleet import GPUS, Arch, Fleet
from sims.costmodel import RooflineCostModel, expected_experts_touched
from sims.profiles import TERM_NAMES, CalibrationProfile, load_profile
from sims.profiles.fit import DECODE, EAGER_DECODE, PREFILL, SWAP, benchmark_arch, build_profiles, error_table


def make_costs(*keys: str, tp: int = 1, gpu: str = "h200", profile: str = "h200-cudagraph") -> RooflineCostModel:
    return RooflineCostModel.for_models({key: (Arch.model_validate(ARCHS[key]), tp) for key in keys}, gpu, load_profile(profile))


# ---- accuracy against ANCHORS.md ----------------------------------------------------------------
@pytest.mark.parametrize("anchor", DECODE, ids=lambda a: f"{a.arch}-b{a.batch}")
@pytest.mark.parametrize("shape", ["benchmark", "catalogue"])
def test_decode_within_10_percent_of_every_h200_measurement(anchor, shape):
    arch = benchmark_arch(anchor.arch) if shape == "benchmark" else Arch.model_validate(ARCHS[anchor.arch])
    costs = RooflineCostModel.for_models({"m": (arch, 1)}, "h200", load_profile("h200-cudagraph"))
    predicted = costs.decode_step_s("m", anchor.batch, anchor.batch * anchor.tokens)
    assert predicted == pytest.approx(anchor.measured_s, rel=0.10)


@pytest.mark.parametrize("profile", ["default", "h200-cudagraph", "h200-eager"])
def test_every_anchor_of_every_shipped_profile_within_5_percent(profile):
    checks = error_table(load_profile(profile))
    assert len(checks) == len(PREFILL) + len(SWAP) + (len(DECODE) if profile != "h200-eager" else 1)
    assert max(abs(check.error) for check in checks) < 0.05, [(c.label, round(c.error, 3)) for c in checks]


def test_eager_decode_is_launch_bound_for_the_7b_shape():
    costs = RooflineCostModel.for_models({"m": (benchmark_arch(EAGER_DECODE.arch), 1)}, "h200", load_profile("h200-eager"))
    assert costs.decode_bound("m", 1, 512) == "launch"
    assert costs.decode_step_s("m", 1, 512) == pytest.approx(EAGER_DECODE.measured_s, rel=0.01)


def test_shipped_profiles_are_exactly_what_the_fit_produces():
    for name, profile in build_profiles().items():
        assert load_profile(name) == profile, f"{name}.json differs from `python -m sims.profiles.fit --write`"


def test_switch_of_catalogue_7b_on_h200_is_about_a_quarter_second():
    costs = make_costs("qwen2.5-7b")
    assert 0.26 <= costs.switch_s("qwen2.5-7b") <= 0.28
    kv = costs.kv_move_s("qwen2.5-7b", 10_000)
    assert kv == pytest.approx(10_000 * Arch.model_validate(ARCHS["qwen2.5-7b"]).kv_bytes_per_token / 54.83e9, rel=0.01)


# ---- physics ------------------------------------------------------------------------------------
def test_touched_experts_go_from_k_to_all():
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(128, 8, 10_000) == pytest.approx(128)
    assert expected_experts_touched(128, 8, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert expected_experts_touched(0, 0, 64) == 0.0


def test_moe_decode_streams_more_experts_as_the_batch_grows():
    costs = make_costs("qwen3-30b-a3b")
    one, many = costs.decode_step_s("qwen3-30b-a3b", 1, 512), costs.decode_step_s("qwen3-30b-a3b", 64, 512)
    arch = Arch.model_validate(ARCHS["qwen3-30b-a3b"])
    extra_experts = expected_experts_touched(128, 8, 64) - 8
    extra_bytes = extra_experts * arch.num_layers * arch.expert_params * 2
    terms = costs.terms
    expected = extra_bytes / (4.8e12 * terms.eff_mem) + 63 * arch.kv_bytes_per_token / (4.8e12 * terms.eff_mem)
    assert many - one == pytest.approx(expected, rel=1e-9)
    assert one < 0.5 * costs.decode_step_s("qwen3-30b-a3b", 512, 512)  # a big batch streams all 30B


def test_tp2_halves_the_memory_time_and_adds_two_all_reduces_per_layer():
    one, two = make_costs("qwen2.5-7b"), make_costs("qwen2.5-7b", tp=2)
    arch, terms = Arch.model_validate(ARCHS["qwen2.5-7b"]), one.terms
    batch, context = 8, 8 * 1000
    memory_tp1 = one.decode_step_s("qwen2.5-7b", batch, context) - terms.decode_fixed_s
    message = batch * arch.hidden_size * 2
    allreduce = 2 * arch.num_layers * (terms.allreduce_latency_s + 2 * (2 - 1) / 2 * message / (900e9 * terms.eff_nvlink))
    assert two.decode_step_s("qwen2.5-7b", batch, context) == pytest.approx(
        memory_tp1 / 2 + allreduce + terms.decode_fixed_s, rel=1e-9)
    assert two.switch_s("qwen2.5-7b") == pytest.approx(one.switch_s("qwen2.5-7b") / 2, rel=1e-9)


def test_kv_heads_replicate_when_tp_exceeds_them():
    arch = Arch.model_validate(ARCHS["qwen2.5-7b"])  # 4 KV heads
    assert make_costs("qwen2.5-7b", tp=4).constants("qwen2.5-7b").kv_bytes_per_token_gpu == arch.kv_bytes_per_token / 4
    assert make_costs("qwen2.5-7b", tp=8).constants("qwen2.5-7b").kv_bytes_per_token_gpu == arch.kv_bytes_per_token / 4


def test_flop_bound_takes_over_at_large_batch():
    costs = make_costs("qwen2.5-7b")
    assert costs.decode_bound("qwen2.5-7b", 1, 512) == "memory"
    assert costs.decode_bound("qwen2.5-7b", 1024, 1024 * 128) == "compute"
    small, large = costs.decode_step_s("qwen2.5-7b", 1024, 1024 * 128), costs.decode_step_s("qwen2.5-7b", 2048, 2048 * 128)
    assert large == pytest.approx(2 * small, rel=0.05)  # compute bound: time ~ proportional to tokens


def test_prefill_is_quadratic_in_prompt_length_and_memory_bound_when_short():
    costs = make_costs("qwen2.5-7b")
    one_long, two_short = costs.prefill_s("qwen2.5-7b", 32_768, 1), costs.prefill_s("qwen2.5-7b", 32_768, 2)
    assert two_short < one_long
    c = costs.constants("qwen2.5-7b")
    assert one_long - two_short == pytest.approx(c.attn_s_per_pair * 32_768 ** 2 / 4 - c.lm_head_s_per_row, rel=1e-9)
    # a 16-token prompt costs about what streaming the weights does (eager: at least the launch floor)
    assert costs.prefill_s("qwen2.5-7b", 16) == pytest.approx(max(c.stream_static_s, c.prefill_floor_s), rel=0.2)
    assert costs.prefill_s("qwen2.5-7b", 0) == 0.0


def test_a_padding_engine_is_charged_its_padded_rows_and_the_prompts_own_attention():
    """prefill_padded: the GEMM rows and K/V writes of scheduler.costs.padded_prefill_tokens (the torch engine on
    CUDA pads), attention over the prompts' own tokens; a length that is already a padded count costs the same."""
    plain = make_costs("qwen2.5-7b")
    profile = load_profile("h200-cudagraph")
    pads = profile.model_copy(update={"terms": profile.terms.model_copy(update={"prefill_padded": True})})
    padded = RooflineCostModel.for_models({"qwen2.5-7b": (Arch.model_validate(ARCHS["qwen2.5-7b"]), 1)}, "h200", pads)
    c = plain.constants("qwen2.5-7b")
    assert padded.prefill_s("qwen2.5-7b", 1024) == plain.prefill_s("qwen2.5-7b", 1024)  # a bucket already
    assert padded_prefill_tokens(1025) == 1152
    extra = padded.prefill_s("qwen2.5-7b", 1025) - plain.prefill_s("qwen2.5-7b", 1025)
    assert extra == pytest.approx(127 * c.gemm_s_per_token, rel=1e-6)  # compute-bound at 1025 tokens
    assert load_profile("default").terms.prefill_padded is False  # shipped profiles: as before


# ---- closed forms -------------------------------------------------------------------------------
def _looped(costs: RooflineCostModel, model: str, batch: int, context: int, steps: int) -> float:
    return sum(costs.decode_step_s(model, batch, context + batch * s) for s in range(steps))


@pytest.mark.parametrize("batch,context,steps", [(1, 512, 1), (8, 8 * 512, 200), (32, 32 * 3000, 1000)])
def test_turn_equals_sum_of_steps_in_the_linear_regime(batch, context, steps):
    costs = make_costs("qwen2.5-7b")
    assert costs.decode_bound("qwen2.5-7b", batch, context + batch * steps) == "memory"
    assert costs.decode_turn_s("qwen2.5-7b", batch, context, steps) == pytest.approx(
        _looped(costs, "qwen2.5-7b", batch, context, steps), rel=1e-9)


@pytest.mark.parametrize("profile,batch,context", [("h200-cudagraph", 300, 300 * 100), ("h200-eager", 64, 64 * 5200)])
def test_turn_equals_sum_of_steps_across_the_crossover(profile, batch, context):
    costs, steps = make_costs("qwen2.5-7b", profile=profile), 1500
    first, last = costs.decode_bound("qwen2.5-7b", batch, context), costs.decode_bound("qwen2.5-7b", batch, context + batch * steps)
    assert (first, last) in {("compute", "memory"), ("launch", "memory")}
    assert costs.decode_turn_s("qwen2.5-7b", batch, context, steps) == pytest.approx(
        _looped(costs, "qwen2.5-7b", batch, context, steps), rel=1e-9)


_PROFILES = {name: load_profile(name) for name in ("h200-cudagraph", "h200-eager")}
_COSTS = {(name, gpu): RooflineCostModel.for_models(
    {key: (Arch.model_validate(ARCHS[key]), tp) for key, tp in (("qwen2.5-7b", 1), ("qwen3-30b-a3b", 2), ("qwen2.5-72b", 4))},
    gpu, profile) for name, profile in _PROFILES.items() for gpu in ("h200", "h20")}


def _crossover(costs: RooflineCostModel, model: str, batch: int) -> int:
    """The first batch context at which the bound changes (bisection), 0 if it never does."""
    low, high = 0, batch * 200_000
    if costs.decode_bound(model, batch, low) == costs.decode_bound(model, batch, high):
        return 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if costs.decode_bound(model, batch, middle) == costs.decode_bound(model, batch, 0) else (low, middle)
    return high


@st.composite
def turns(draw: st.DrawFn) -> tuple[tuple[str, str], str, int, int]:
    """(costs key, model, batch, context per request); half of them start just before a change of bound."""
    key = draw(st.sampled_from(sorted(_COSTS)))
    model = draw(st.sampled_from(["qwen2.5-7b", "qwen3-30b-a3b", "qwen2.5-72b"]))
    batch = draw(st.integers(1, 1024))
    crossover = _crossover(_COSTS[key], model, batch) // batch if draw(st.booleans()) else 0
    return key, model, batch, max(0, crossover - draw(st.integers(0, 300))) if crossover else draw(st.integers(0, 4000))


@settings(max_examples=150, deadline=None)
@given(turn=turns(), steps=st.integers(0, 600))
def test_turn_matches_the_loop_everywhere(turn, steps):
    key, model, batch, context_per_request = turn
    costs = _COSTS[key]
    assert costs.decode_turn_s(model, batch, batch * context_per_request, steps) == pytest.approx(
        _looped(costs, model, batch, batch * context_per_request, steps), rel=1e-9, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(turn=turns(), seconds=st.floats(0.0, 30.0))
def test_steps_within_inverts_the_turn(turn, seconds):
    key, model, batch, context_per_request = turn
    costs, context = _COSTS[key], batch * context_per_request
    steps = costs.steps_within_s(model, batch, context, seconds)
    assert costs.decode_turn_s(model, batch, context, steps) <= seconds
    assert costs.decode_turn_s(model, batch, context, steps + 1) > seconds
    assert costs.steps_within_s(model, batch, context, costs.decode_turn_s(model, batch, context, steps)) >= steps


# ---- profiles -----------------------------------------------------------------------------------
def test_profile_schema_rejects_unknown_terms_and_missing_provenance():
    data = load_profile("default").model_dump(mode="json")
    with pytest.raises(ValueError, match="extra"):
        CalibrationProfile.model_validate({**data, "terms": {**data["terms"], "eff_magic": 1.0}})
    with pytest.raises(ValueError, match="unknown term"):
        CalibrationProfile.model_validate({**data, "gpu_overrides": {"h20": {"eff_magic": 1.0}}})
    with pytest.raises(ValueError, match="missing"):
        CalibrationProfile.model_validate({**data, "gpu_overrides": {"h20": {"eff_mem": 0.7}}})
    with pytest.raises(ValueError, match="less than or equal"):
        CalibrationProfile.model_validate({**data, "terms": {**data["terms"], "eff_mem": 1.5}})


def test_provenance_is_measured_only_on_the_measured_gpu(tmp_path):
    profile = load_profile("default")
    assert profile.status("eff_mem", "h200") == "measured"
    assert profile.status("eff_mem", "h20") == "estimated"
    assert profile.status("eff_nvlink", "h200") == "estimated"
    assert profile.status("eff_pcie", "h100") == "measured"
    assert profile.terms_for("h100").eff_pcie != profile.terms.eff_pcie
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(profile.model_dump(mode="json")))
    assert load_profile(path) == profile
    with pytest.raises(FileNotFoundError):
        load_profile("no-such-profile")


def test_basis_says_measured_datasheet_ratio_carried_over_or_assumed():
    profile = load_profile("default")
    h20 = profile.bases("h20")
    assert h20["measured"] == []
    assert {"eff_compute", "eff_mem", "eff_kv", "eff_pcie"} <= set(h20["datasheet ratio"])  # H200 shares of datasheet rates
    assert all(term.startswith("eff_") for term in h20["datasheet ratio"])
    assert {"decode_fixed_s", "prefill_fixed_s", "launch_s_per_layer"} <= set(h20["carried over"])
    assert {"eff_nvlink", "allreduce_latency_s"} <= set(h20["assumed"]) and "eff_mem" not in h20["assumed"]
    assert sorted(sum(h20.values(), [])) == sorted(TERM_NAMES)
    assert profile.basis("eff_pcie", "h100") == "measured"  # its own override, measured on an H100
    assert profile.basis("eff_mem", "h200") == "measured" and profile.basis("eff_nvlink", "h200") == "assumed"


def test_cost_model_from_a_fleet_satisfies_the_scheduler_protocol():
    fleet = Fleet.model_validate({"pool": {"gpu": "h20", "num_gpus": 4},
                                  "models": [{"name": "chat", "arch": "qwen2.5-7b"}, {"name": "big", "arch": "qwen2.5-72b", "tp": 4}]})
    costs: CostModel = RooflineCostModel(fleet)
    assert costs.switch_s("big") == pytest.approx(costs.switch_s("chat") * 72.7 / 7.61 / 4, rel=1e-6)
    assert costs.decode_step_s("chat", 0, 0) == 0.0
    assert RooflineCostModel(fleet, gpu="h200").decode_step_s("chat", 1, 512) < costs.decode_step_s("chat", 1, 512)


# ---- estimate -----------------------------------------------------------------------------------
def test_estimate_report_for_a_catalogue_arch():
    report = estimate_report(None, "qwen2.5-7b", "h200", None, 8, 1024, 257, "h200-cudagraph")
    costs = make_costs("qwen2.5-7b")
    assert report["ttft_s"] == costs.prefill_s("qwen2.5-7b", 1024)
    assert report["tpot_s"] == pytest.approx(costs.decode_turn_s("qwen2.5-7b", 8, 8 * 1025, 256) / 256)
    assert report["tokens_per_s"] == pytest.approx(8 * report["tokens_per_s_per_user"])
    usable = GPUS["h200"].memory_gb * 1e9 * 0.9
    assert report["kv_capacity_bytes"] == pytest.approx(usable - report["weight_bytes"])
    assert report["max_concurrent_requests"] == report["kv_capacity_tokens"] // (1024 + 257)
    assert report["provenance"]["eff_mem"] == "measured"
    assert report["basis"]["datasheet ratio"] == [] and report["measured_elsewhere_on"] == []
    assert "TPOT" in render_estimate(report)
    json.dumps(report)


def test_estimate_says_which_terms_come_from_datasheet_ratios_off_the_measured_gpu():
    report = estimate_report(None, "qwen2.5-7b", "h20", None, 1, 512, 256)
    assert report["basis"]["measured"] == [] and "eff_mem" in report["basis"]["datasheet ratio"]
    assert report["measured_elsewhere_on"] == ["h200"]
    text = render_estimate(report, width=200)
    assert "profile terms measured on H20 " in text and "estimated from datasheet ratios (efficiencies measured on H200)" in text
    datasheet_line = next(line for line in text.splitlines() if "datasheet ratios" in line)
    assert "eff_mem" in datasheet_line and "decode_fixed_s" not in datasheet_line
    assert "carried over unchanged" in text and "assumed" in text
    h100 = estimate_report(None, "qwen2.5-7b", "h100", None, 1, 512, 256)
    assert h100["basis"]["measured"] == ["eff_pcie"] and "eff_pcie" not in h100["basis"]["datasheet ratio"]


def test_estimate_command_prints_json_and_rejects_unknown_models():
    app = Typer()
    app.command("estimate")(estimate_command)
    app.command("noop")(lambda: None)  # a second command keeps `estimate` a subcommand
    runner = CliRunner()
    result = runner.invoke(app, ["estimate", "--model", "qwen3-32b", "--gpu", "h20", "--tp", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["weight_bytes_per_gpu"] == pytest.approx(32.8e9)
    bad = runner.invoke(app, ["estimate", "--model", "gpt-9", "--gpu", "h200"])
    assert bad.exit_code == 1 and "unknown model" in bad.output
