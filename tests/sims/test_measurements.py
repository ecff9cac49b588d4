"""The measurements file (sims.profiles.measurements): the fit recovers known terms from synthetic points, the
leave-one-shape-out error says how well a shape it never saw is predicted, and the file loads as a profile whose
every term says where it comes from."""

from __future__ import annotations

import math

import io
import json
from pathlib import Path

import pytest

from scheduler import InstanceSpec, Request
from scheduler.fleet import ARCHS, GPUS, Arch
from sims.costmodel import RooflineCostModel
from sims.profiles import CalibrationProfile, load_profile
from sims.profiles.measurements import (SCHEMA, CopyPoint, DecodePoint, DecodeSharePoints, GatewayPoint, HostPoints,
                                        KvMovePoint, Points, PrefillPoint, SharePoints, build, held_out_errors,
                                        host_terms)
from tests.factories import make_instances, make_models, make_sim

SHAPES = {key: Arch.model_validate({**ARCHS[key], "total_params": None})
          for key in ("qwen2.5-0.5b", "llama-3.2-1b", "qwen3-1.7b", "qwen2.5-3b", "qwen3-4b")}
TRUTH = {"eff_compute": 0.62, "eff_mem": 0.78, "eff_kv": 0.55, "eff_pcie": 0.85, "prefill_fixed_s": 2e-3,
         "prefill_layer_s": 4e-5, "decode_fixed_s": 3e-4, "decode_layer_s": 6e-6, "switch_fixed_s": 5e-3,
         "eff_kv_move": 0.6, "kv_move_fixed_s": 2e-4}


def _truth_costs() -> RooflineCostModel:
    base = load_profile("default")
    terms = base.terms.model_copy(update={**TRUTH, "launch_s_per_layer": 0.0})  # no launch floor under the prefills
    profile = base.model_copy(update={"terms": terms, "gpu_overrides": {}})
    return RooflineCostModel.for_models({name: (arch, 1) for name, arch in SHAPES.items()}, "h200", profile)


def _points(costs: RooflineCostModel, noise: float = 0.0) -> Points:
    """What a device that is exactly the truth profile would measure (times `1 + noise` for odd shapes)."""
    def jitter(index: int, seconds: float) -> float:
        return seconds * (1 + noise if index % 2 else 1.0)

    prefill, decode, swap, kv = [], [], [], []
    for index, name in enumerate(SHAPES):
        c = costs.constants(name)
        for tokens in (128, 512, 2048):
            prefill.append(PrefillPoint(shape=name, tokens=tokens, batch=1,
                                        seconds=jitter(index, costs.prefill_s(name, tokens, 1))))
        for batch in (1, 8, 32):
            for context in (256, 2048):
                decode.append(DecodePoint(shape=name, batch=batch, context=context, graphs=True,
                                          seconds=jitter(index, costs.decode_step_s(name, batch, batch * context))))
        swap.append(CopyPoint(shape=name, bytes=c.weight_bytes, seconds=jitter(index, costs.switch_s(name))))
        for batch, context in ((1, 512), (8, 2048)):
            nbytes = batch * context * c.kv_bytes_per_token_gpu
            seconds = jitter(index, nbytes * c.kv_s_per_byte + c.kv_move_fixed_s)
            kv.append(KvMovePoint(shape=name, batch=batch, context=context, bytes=nbytes, save_s=seconds,
                                  restore_s=seconds))
    host = HostPoints(step_s_by_batch={1: 1e-4 + 2e-6, 4: 1e-4 + 8e-6, 16: 1e-4 + 32e-6},
                      admit_s=[3e-4, 5e-4, 4e-4], deliver_s=[2e-5, 1e-5, 3e-5])
    return Points(prefill=prefill, decode=decode, swap=swap, kv_move=kv, host=host)


def _build(points: Points):
    return build(points, SHAPES, GPUS["h200"], device="NVIDIA H200", gpu="h200", measured_at="2026-12-06T04:00:00+00:00",
                 command="modelpool calibrate --device cuda --out m.json", settings={"prefill_padded": False})


def test_the_fit_recovers_the_terms_that_made_the_points_and_predicts_held_out_shapes_exactly() -> None:
    measured = _build(_points(_truth_costs()))
    for term, value in TRUTH.items():
        assert measured.terms[term].value == pytest.approx(value, rel=2e-3), term
        assert measured.terms[term].basis == "measured" and measured.terms[term].points > 0
    errors = held_out_errors(measured)
    assert set(errors) == {"prefill", "decode", "swap", "kv_move"}
    assert all(worst < 2e-3 for _, worst in errors.values())  # a shape it never saw, predicted
    assert measured.terms["eff_nvlink"].basis == "assumed" and "two GPUs" in measured.terms["eff_nvlink"].how
    assert measured.terms["host_token_s"].value == pytest.approx(2e-6) and measured.terms["host_call_s"].value == \
        pytest.approx(1e-4)
    assert measured.terms["request_admit_s"].value == 4e-4 and measured.terms["token_deliver_s"].value == 2e-5


def test_the_file_names_the_backend_its_host_costs_were_measured_on() -> None:
    points = _points(_truth_costs())
    measured = _build(points.model_copy(update={"host": points.host.model_copy(update={"backend": "processes"})}))
    assert measured.points.host.backend == "processes"
    for term in ("host_call_s", "host_token_s", "request_admit_s", "token_deliver_s"):
        assert "on the processes backend" in measured.terms[term].how, term
    again = type(measured).model_validate_json(measured.model_dump_json(by_alias=True))
    assert again.points.host.backend == "processes"
    older = json.loads(measured.model_dump_json(by_alias=True))  # a file written before the field: threads
    del older["points"]["host"]["backend"]
    assert type(measured).model_validate(older).points.host.backend == "threads"
    with pytest.raises(ValueError):
        HostPoints(backend="inprocess")  # tests' backend: never what serve runs


def test_the_held_out_error_shows_a_shape_that_departs_from_the_others() -> None:
    exact = held_out_errors(_build(_points(_truth_costs())))
    off = held_out_errors(_build(_points(_truth_costs(), noise=0.2)))  # every other shape 20% slower
    assert off["decode"][1] > 0.08 > exact["decode"][1]
    assert off["swap"][0] > exact["swap"][0]


def test_host_terms_are_the_line_through_the_idle_pools_step_times() -> None:
    terms = host_terms(HostPoints(step_s_by_batch={1: 0.0011, 2: 0.0012, 8: 0.0018}))
    assert terms["host_call_s"][0] == pytest.approx(1e-3) and terms["host_token_s"][0] == pytest.approx(1e-4)
    assert "request_admit_s" not in terms  # nothing measured, nothing claimed
    flat = host_terms(HostPoints(step_s_by_batch={1: 0.002, 4: 0.0019}))
    assert flat["host_token_s"][0] == 0.0  # never negative


def _through_gateway(prompt_tokens: int, in_s: float, out_s: float = 6e-4) -> GatewayPoint:
    return GatewayPoint(prompt_tokens=prompt_tokens, in_s=in_s, out_s=[out_s, 5e-4], admit_s=2e-4, deliver_s=1e-5,
                        ttft_s=in_s + 2e-4 + 1e-5 + out_s + 8e-4)


def test_through_the_gateway_the_way_in_is_a_line_over_prompt_tokens_and_the_way_out_the_first_tokens() -> None:
    # the client's send to the first engine call: 1.2 ms + 0.25 us per prompt token (in_s + the pool's 0.2 ms),
    # one outlier per length that the medians ignore; the way out: the pool's 10 us then 0.6 ms to the client
    points = [_through_gateway(n, 1e-3 + 2.5e-7 * n + extra, out)
              for n in (16, 512, 4096) for extra, out in ((0.0, 6e-4), (0.0, 6e-4), (0.05, 9e-3))]
    old = HostPoints(step_s_by_batch={1: 0.0011, 2: 0.0012}, admit_s=[3e-4], deliver_s=[2e-5])
    terms = host_terms(old.model_copy(update={"gateway": points}))
    assert terms["request_admit_s"] == (pytest.approx(1.2e-3), 9)
    assert terms["request_prompt_token_s"] == (pytest.approx(2.5e-7), 9)
    assert terms["token_deliver_s"] == (pytest.approx(6.1e-4), 9)
    flat = host_terms(HostPoints(gateway=[_through_gateway(16, 2e-3), _through_gateway(4096, 1.9e-3)]))
    assert flat["request_prompt_token_s"][0] == 0.0  # never negative
    # without gateway points (a file written before the probe): the pool's own way in and out, no prompt term
    before = host_terms(old)
    assert before["request_admit_s"] == (3e-4, 1) and before["token_deliver_s"] == (2e-5, 1)
    assert "request_prompt_token_s" not in before


def test_a_file_written_before_the_gateway_probe_reads_with_its_terms_as_written(tmp_path: Path) -> None:
    measured = _build(_points(_truth_costs()))
    older = json.loads(measured.model_dump_json(by_alias=True))
    del older["points"]["host"]["gateway"]
    assert "request_prompt_token_s" not in older["terms"]
    path = tmp_path / "h200-older.json"
    path.write_text(json.dumps(older))
    profile = load_profile(path)
    assert profile.terms.request_admit_s == 4e-4 and profile.terms.request_prompt_token_s == 0.0
    assert profile.provenance["request_prompt_token_s"].status == "estimated"  # not measured: says so
    points = _points(_truth_costs())
    through = _build(points.model_copy(update={"host": points.host.model_copy(update={
        "gateway": [_through_gateway(n, 1e-3 + 2.5e-7 * n) for n in (16, 512, 4096)]})}))
    path.write_text(through.model_dump_json(by_alias=True))
    profile = load_profile(path)
    assert profile.terms.request_prompt_token_s == pytest.approx(2.5e-7)
    assert profile.terms.request_admit_s == pytest.approx(1.2e-3)
    assert "through the gateway" in through.terms["request_prompt_token_s"].how


def test_kv_call_host_is_half_of_what_a_hand_off_adds_beyond_its_decode_call() -> None:
    # host_call_s 1 ms; hand-offs of 3.0, 3.2 (median), 9.0 ms: (3.2 - 1) / 2 per KV move
    terms = host_terms(HostPoints(step_s_by_batch={1: 0.0011, 2: 0.0012, 8: 0.0018},
                                  handoff_s=[0.003, 0.0032, 0.009]))
    assert terms["kv_call_host_s"] == (pytest.approx(0.0011), 3)
    assert "kv_call_host_s" not in host_terms(HostPoints(step_s_by_batch={1: 0.001}))
    assert host_terms(HostPoints(step_s_by_batch={1: 0.002}, handoff_s=[0.001]))["kv_call_host_s"][0] == 0.0


def test_the_file_loads_as_a_profile_with_every_terms_provenance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "h200-mine.json"
    path.write_text(_build(_points(_truth_costs())).model_dump_json(by_alias=True))
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["terms"]["eff_mem"]["unit"] == "fraction"
    profile = load_profile(path)
    assert profile.name == "h200-mine" and profile.calibration is not None and profile.calibration.gpu == "h200"
    assert profile.terms.eff_mem == pytest.approx(0.78, rel=2e-3)
    assert profile.basis("eff_mem", "h200") == "measured" and profile.basis("eff_mem", "h20") == "datasheet ratio"
    assert profile.basis("decode_fixed_s", "h20") == "carried over" and profile.basis("eff_nvlink", "h200") == "assumed"
    assert "leave-one-shape-out error" in profile.provenance["eff_mem"].source
    assert profile.device_spec is None  # a catalogue GPU: its datasheet figures
    data["schema"] = "modelpool.measurements/0"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"(?s)h200-mine.json: not a valid profile.*schema.*modelpool.measurements/1"):
        load_profile(path)


def test_a_device_the_catalogue_lacks_carries_its_measured_figures() -> None:
    spec = GPUS["h200"].model_copy(update={"hbm_tb_s": 0.05, "bf16_tflops": 1.0, "source": "measured"})
    measured = build(_points(_truth_costs()), SHAPES, spec, device="cpu", gpu="cpu", measured_at="2026-12-06",
                     command="modelpool calibrate --device cpu", settings={})
    profile = measured.profile()
    assert profile.device_spec == spec and profile.name == "cpu-measured"
    costs = RooflineCostModel.for_models({"m": (SHAPES["qwen2.5-0.5b"], 1)}, "cpu", profile)
    assert costs.gpu == spec  # no GPU entry to write by hand
    with pytest.raises(KeyError, match="measured on cpu"):
        RooflineCostModel.for_models({"m": (SHAPES["qwen2.5-0.5b"], 1)}, "tpu", profile)


def test_the_shipped_measurements_load_as_profiles_that_say_where_they_were_measured() -> None:
    from sims.profiles import shipped

    measured = [name for name in shipped() if name.endswith("-measured")]
    assert measured  # at least one device measured by `modelpool calibrate`
    for name in measured:
        profile = load_profile(name)
        run = profile.calibration
        assert run is not None and name == f"{run.gpu}-measured" and run.command.startswith("modelpool calibrate")
        assert profile.basis("eff_mem", run.gpu) == "measured" and profile.basis("eff_nvlink", run.gpu) == "assumed"
        assert "leave-one-shape-out" in profile.provenance["decode_fixed_s"].source


def _pair(decoder: str, prefiller: str | None, decode_beside: float, prefill_beside: float,
          tokens: int = 2048) -> SharePoints:
    """A decoder's steps of 5 ms alone and a prefill of 30 ms alone, each that much longer beside the other."""
    return SharePoints(shape=decoder, prefill_shape=prefiller, prefill_tokens=tokens, decode_batch=16, mps=True,
                       prefill_alone_s=[0.030, 0.031, 0.029], prefill_beside_s=[0.030 * prefill_beside] * 3,
                       decode_alone_s=[0.005, 0.0049, 0.0051], decode_beside_s=[0.005 * decode_beside] * 4)


def test_share_pairs_of_two_shapes_make_the_profiles_table_and_the_largest_beside_itself_the_terms(
        tmp_path: Path) -> None:
    small, large = "qwen2.5-0.5b", "qwen3-4b"
    points = _points(_truth_costs()).model_copy(update={"share": [
        _pair(small, small, 2.0, 1.1), _pair(large, large, 3.5, 1.2), _pair(small, large, 4.0, 1.0),
        _pair(large, small, 1.5, 0.9),  # a ratio under 1 is noise: 1
        _pair(small, small, 1.2, 2.0, 256), _pair(large, large, 2.0, 1.9, 256)]})
    measured = _build(points)
    assert measured.terms["share_decode_slowdown"].value == 3.5  # the largest shape beside itself
    assert measured.terms["share_prefill_slowdown"].value == 1.2
    path = tmp_path / "h200-pairs.json"
    path.write_text(measured.model_dump_json(by_alias=True))
    assert load_profile(path).share_pairs == []  # short prompts for two pairs only: no whole grid, the terms hold
    points = points.model_copy(update={"share": [*points.share, _pair(small, large, 3.0, 1.5, 256),
                                                 _pair(large, small, 1.1, 2.1, 256)]})
    path.write_text(_build(points).model_dump_json(by_alias=True))
    table = {(p.decode_shape, p.prefill_shape, p.prompt_tokens): (p.decode_slowdown, p.prefill_slowdown)
             for p in load_profile(path).share_pairs}
    assert table == {(small, small, 2048): (2.0, 1.1), (large, large, 2048): (3.5, 1.2),
                     (small, large, 2048): (4.0, 1.0), (large, small, 2048): (1.5, 1.0),
                     (small, small, 256): (1.2, 2.0), (large, large, 256): (2.0, 1.9),
                     (small, large, 256): (3.0, 1.5), (large, small, 256): (1.1, 2.1)}
    one = _build(points.model_copy(update={"share": [_pair(large, None, 3.0, 1.1)]}))  # a file of one pair
    path.write_text(one.model_dump_json(by_alias=True))
    assert load_profile(path).share_pairs == [] and one.terms["share_decode_slowdown"].value == 3.0
    older = json.loads(one.model_dump_json(by_alias=True))
    older["points"]["share"] = older["points"]["share"][0]  # written before the pairs: one object, not a list
    path.write_text(json.dumps(older))
    assert load_profile(path).terms.share_decode_slowdown == 3.0


def test_a_shape_whose_prefills_depart_from_the_formula_is_predicted_from_its_own_points() -> None:
    points = _points(_truth_costs())
    slow = "qwen2.5-0.5b"  # its prefills 1.7x what the truth's formula says (a host-bound shape, say)
    points = points.model_copy(update={"prefill": [p.model_copy(update={"seconds": p.seconds * 1.7})
                                                   if p.shape == slow else p for p in points.prefill]})
    profile = _build(points).profile()
    scales = {scale.shape: scale.prefill for scale in profile.shape_scales}
    assert set(scales) == set(SHAPES) and all(scale.points == 3 for scale in profile.shape_scales)
    assert scales[slow] > 1.2 and all(0.8 < scales[name] < 1.2 for name in SHAPES if name != slow)
    named = Arch.model_validate({**ARCHS[slow], "max_context": 4096})  # the same layers under another name
    fleet = {"mine": (named, 1), "mine-tp2": (named, 2)}
    here = RooflineCostModel.for_models(fleet, "h200", profile)
    bare = RooflineCostModel.for_models(fleet, "h200", profile.model_copy(update={"shape_scales": []}))
    elsewhere = RooflineCostModel.for_models(fleet, "h100", profile)
    mine = [p for p in points.prefill if p.shape == slow]
    errors = sorted(abs(here.prefill_s("mine", p.tokens, 1) / p.seconds - 1) for p in mine)
    formula = max(abs(bare.prefill_s("mine", p.tokens, 1) / p.seconds - 1) for p in mine)
    assert errors[0] < 0.01 and errors[-1] < formula / 2  # its median point exact; the formula 20-33% off
    assert here.prefill_s("mine", 512) == pytest.approx(scales[slow] * bare.prefill_s("mine", 512))
    assert here.prefill_s("mine-tp2", 512) == bare.prefill_s("mine-tp2", 512)  # timed at tp 1 only
    assert elsewhere.prefill_s("mine", 512) == RooflineCostModel.for_models(
        fleet, "h100", profile.model_copy(update={"shape_scales": []})).prefill_s("mine", 512)  # timed on an H200


def test_a_host_bound_shape_takes_its_scale_by_prompts_and_length_so_each_measured_point_holds() -> None:
    """A shape whose eager prefill hardly grows with its prompt (host-bound: 11 ms at 128 tokens, 12 ms at 2048;
    four prompts 16-30 ms) is charged its own point at each prompt count and length measured; between lengths
    a scale linear in log tokens per prompt, between prompt counts linear in log prompts, beyond them the
    nearest's; a profile written before the grid keeps the one median."""
    points = _points(_truth_costs())
    flat = "qwen2.5-0.5b"
    seconds = {(128, 1): 0.011, (512, 1): 0.0112, (2048, 1): 0.012, (128, 4): 0.016, (2048, 4): 0.030}
    points = points.model_copy(update={"prefill": [
        *(p for p in points.prefill if p.shape != flat),
        *(PrefillPoint(shape=flat, tokens=t, batch=b, seconds=s) for (t, b), s in seconds.items())]})
    profile = _build(points).profile()
    scale = next(s for s in profile.shape_scales if s.shape == flat)
    assert [(p, [t for t, _ in row]) for p, row in scale.by_prompts] == [(1, [128, 512, 2048]), (4, [128, 2048])]
    fleet = {"mine": (Arch.model_validate({**ARCHS[flat], "max_context": 4096}), 1)}
    here = RooflineCostModel.for_models(fleet, "h200", profile)
    bare = RooflineCostModel.for_models(fleet, "h200", profile.model_copy(update={"shape_scales": []}))
    for (tokens, prompts), measured in seconds.items():  # every point measured, as timed
        assert here.prefill_s("mine", tokens * prompts, prompts) == pytest.approx(measured, rel=1e-3)
    one = dict(scale.by_prompts[0][1])
    four = dict(scale.by_prompts[1][1])
    between = round(math.exp((math.log(128) + math.log(512)) / 2))  # halfway in log tokens
    assert here.prefill_s("mine", between) == pytest.approx(
        bare.prefill_s("mine", between) * (one[128] + one[512]) / 2, rel=2e-3)
    assert here.prefill_s("mine", 16) == pytest.approx(bare.prefill_s("mine", 16) * one[128])  # shorter: nearest
    assert here.prefill_s("mine", 4096) == pytest.approx(bare.prefill_s("mine", 4096) * one[2048])  # longer
    assert here.prefill_s("mine", 2 * 128, 2) == pytest.approx(  # two prompts: halfway in log prompts
        bare.prefill_s("mine", 2 * 128, 2) * (one[128] + four[128]) / 2, rel=1e-3)
    assert here.prefill_s("mine", 8 * 2048, 8) == pytest.approx(bare.prefill_s("mine", 8 * 2048, 8) * four[2048])
    one_median = profile.model_copy(update={"shape_scales": [scale.model_copy(update={"by_prompts": []})]})
    median_only = RooflineCostModel.for_models(fleet, "h200", one_median)
    assert median_only.prefill_s("mine", 128) == pytest.approx(bare.prefill_s("mine", 128) * scale.prefill)
    assert max(abs(median_only.prefill_s("mine", t * b, b) / s - 1) for (t, b), s in seconds.items()) > 0.1


def _decode_run(decoder: str, peer: str, beside: float, peer_beside: float) -> DecodeSharePoints:
    """A decoder's steps of 5 ms alone beside a second process's of 2 ms alone, each that much longer beside."""
    return DecodeSharePoints(shape=decoder, peer_shape=peer, decode_batch=16, peer_batch=16, mps=True,
                             alone_s=[0.005, 0.0049, 0.0051], beside_s=[0.005 * beside] * 4,
                             peer_alone_s=[0.002, 0.0021, 0.0019], peer_beside_s=[0.002 * peer_beside] * 3)


def test_decode_beside_decode_runs_make_the_profiles_decode_pairs_from_both_sides() -> None:
    small, large = "qwen2.5-0.5b", "qwen3-4b"
    runs = [_decode_run(small, small, 1.1, 1.3), _decode_run(large, large, 1.4, 1.4),
            _decode_run(small, large, 1.6, 1.02), _decode_run(large, small, 1.06, 1.5)]
    measured = _build(_points(_truth_costs()).model_copy(update={"share_decode": runs}))
    pairs = {(p.decode_shape, p.peer_shape): (p.decode_bytes, p.peer_bytes, p.slowdown)
             for p in measured.profile().decode_pairs}
    small_bytes, large_bytes = SHAPES[small].weight_bytes, SHAPES[large].weight_bytes
    # each run gives both sides' (under 1: 1); a shape beside a shape measured twice: the median of the two
    assert pairs == {(small, small): (small_bytes, small_bytes, 1.2), (large, large): (large_bytes, large_bytes, 1.4),
                     (small, large): (small_bytes, large_bytes, 1.55),
                     (large, small): (large_bytes, small_bytes, 1.04)}
    shares = RooflineCostModel.for_models({"a": (SHAPES[small], 1), "b": (SHAPES[large], 1)}, "h200",
                                          measured.profile()).gpu_shares(
        [InstanceSpec("p", 1, 80e9), InstanceSpec("d", 1, 80e9)], {"p": 0, "d": 0})
    assert shares is not None and shares.rate(("decode", small_bytes, 0), [("decode", large_bytes, 0)]) == \
        pytest.approx(1 / 1.55)
    partial = _build(_points(_truth_costs()).model_copy(update={"share_decode": runs[:2]}))  # no cross pairs
    assert partial.profile().decode_pairs == []  # not every shape beside every shape: the budget's 2 holds


def _hand_offs_on_one_gpu(profile: CalibrationProfile) -> tuple[str, float]:
    """A prefill and a decode instance of qwen3-4b on one H200, on `profile`: the Plan log and the mean finish."""
    costs = RooflineCostModel.for_models({"m0": (SHAPES["qwen3-4b"], 1)}, "h200", profile)
    instances = make_instances(2, roles=["prefill", "decode"])
    log = io.StringIO()
    sim, _ = make_sim("token-level", make_models(1), instances,
                      [Request(f"r{k}", "m0", 0.05 * k, 300, 40) for k in range(30)], costs=costs, plan_log=log)
    sim.gpus = costs.gpu_shares(instances, {"i0": 0, "i1": 0})
    sim.run()
    records = list(sim.records.values())
    assert all(r.generated == r.output_tokens for r in records)
    return log.getvalue(), sum(r.finished_at - r.arrival_at for r in records) / len(records)


def test_a_file_written_before_the_decode_pairs_loads_and_simulates_with_the_budgets_split(tmp_path: Path) -> None:
    large = "qwen3-4b"
    points = _points(_truth_costs()).model_copy(update={
        "share": [_pair(large, large, 3.0, 1.1)], "share_decode": [_decode_run(large, large, 1.2, 1.2)]})
    new = json.loads(_build(points).model_dump_json(by_alias=True))
    older = json.loads(json.dumps(new))
    del older["points"]["share_decode"]  # written before the decode-beside-decode runs
    path = tmp_path / "older.json"
    path.write_text(json.dumps(older))
    profile = load_profile(path)
    assert profile.decode_pairs == [] and profile.terms.share_decode_slowdown == 3.0
    path.write_text(json.dumps(new))
    measured = load_profile(path)
    assert [(p.decode_shape, p.peer_shape, p.slowdown) for p in measured.decode_pairs] == [(large, large, 1.2)]
    assert measured.model_copy(update={"decode_pairs": []}) == profile  # the rest as it was
    plans, finish = _hand_offs_on_one_gpu(profile)
    # as the simulator ran it before the pairs: decode beside decode at the budget's 2 (a table saying 2 likewise)
    two = [p.model_copy(update={"slowdown": 2.0}) for p in measured.decode_pairs]
    assert _hand_offs_on_one_gpu(measured.model_copy(update={"decode_pairs": two})) == (plans, finish)
    assert _hand_offs_on_one_gpu(measured)[1] < finish  # the measured 1.2: hand-offs' decode steps run sooner


def test_decode_ahead_is_the_engines_setting_and_a_gpu_file_before_the_term_reads_it_as_on() -> None:
    points = _points(_truth_costs())
    on = build(points, SHAPES, GPUS["h200"], device="NVIDIA H200", gpu="h200", measured_at="2026-12-07",
               command="modelpool calibrate --device cuda", settings={"prefill_padded": True, "decode_ahead": True})
    assert on.terms["decode_ahead"].value is True and on.terms["decode_ahead"].unit == "setting"
    assert RooflineCostModel.for_models({"m": (SHAPES["qwen2.5-0.5b"], 1)}, "h200", on.profile()).decode_ahead()
    older = on.model_copy(update={"terms": {k: v for k, v in on.terms.items() if k != "decode_ahead"}})
    profile = older.profile()
    assert profile.terms.decode_ahead and profile.basis("decode_ahead", "h200") == "measured"
    cpu = older.model_copy(update={"device": "cpu"})
    assert cpu.profile().terms.decode_ahead is False  # the engine queues nothing ahead on a CPU
