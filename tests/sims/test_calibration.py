"""Calibrated profiles without a device: the fits recover known terms, the live pool's terms are charged,
the new terms change nothing at their defaults (sims.profiles.fitting, .calibrated, sims.costmodel)."""

from __future__ import annotations

import pytest

from scheduler.fleet import GPUS, Arch
from sims.costmodel import RooflineCostModel
from sims.profiles import CalibrationProfile, load_profile
from sims.profiles.calibrated import MIN_STEPS, build_profile, fit_errors, with_engine_refit, with_live_host
from sims.profiles.fitting import Anchor, fit

SMALL = Arch(family="qwen2", num_layers=24, hidden_size=1536, num_heads=12, num_kv_heads=2, intermediate_size=8960,
             vocab_size=151936, tie_embeddings=True)
LARGE = Arch(family="qwen2", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, intermediate_size=18944,
             vocab_size=152064)
ARCHS = {"small": SMALL, "large": LARGE}
TRUE = {"eff_compute": 0.6, "eff_mem": 0.75, "eff_kv": 0.5, "eff_pcie": 0.85, "decode_fixed_s": 8e-4,
        "prefill_fixed_s": 2e-3, "prefill_layer_s": 1e-4, "prefill_request_s": 5e-4, "switch_fixed_s": 3e-3,
        "eff_kv_move": 0.7, "kv_move_fixed_s": 2e-4, "launch_s_per_layer": 3e-4}


def _truth() -> CalibrationProfile:
    base = load_profile("h200-cudagraph")
    return base.model_copy(update={"terms": base.terms.model_copy(update=TRUE)})


def _measurements(profile: CalibrationProfile, archs: dict[str, Arch] = ARCHS) -> dict:
    """What modelpool.measure would record on a device that follows `profile` exactly."""
    costs = RooflineCostModel.for_models({n: (a, 1) for n, a in archs.items()}, "h200", profile)
    graphs = costs.profile.terms
    eager = RooflineCostModel.for_models({n: (a, 1) for n, a in archs.items()}, "h200",
                                         profile.model_copy(update={"terms": graphs.model_copy(
                                             update={"decode_cuda_graphs": False})}))
    m: dict = {"device": "NVIDIA H200", "software": {"torch": "test"}, "figures": {}, "prefill": [], "decode": [],
               "swap": [], "kv_move": [], "shared": [],
               "shapes": {n: {"weight_bytes": a.weight_bytes, "num_layers": a.num_layers} for n, a in archs.items()}}
    for name in archs:
        c = costs.constants(name)
        for tokens in (128, 512, 2048):
            for batch in (1, 4):
                m["prefill"].append({"arch": name, "tokens": tokens, "batch": batch,
                                     "seconds": costs.prefill_s(name, tokens * batch, batch)})
        for batch in (1, 8, 32):
            for context in (256, 1024, 4096):
                m["decode"].append({"arch": name, "batch": batch, "context": context, "graphs": True,
                                    "seconds": costs.decode_step_s(name, batch, batch * context)})
        m["decode"].append({"arch": name, "batch": 1, "context": 256, "graphs": False,
                            "seconds": eager.decode_step_s(name, 1, 256)})
        m["swap"].append({"arch": name, "bytes": archs[name].weight_bytes, "seconds": costs.switch_s(name)})
        for batch in (1, 8):
            nbytes = batch * 2048 * c.kv_bytes_per_token_gpu
            seconds = costs.kv_move_s(name, batch * 2048) + costs.kv_move_overhead_s(name)
            m["kv_move"].append({"arch": name, "batch": batch, "context": 2048, "bytes": nbytes, "save_s": seconds,
                                 "restore_s": seconds})
    return m


RUN = {"command": "modelpool calibrate --fleet f.yaml --device cuda", "measured_at": "2026-12-01T00:00:00+00:00"}


def test_the_fit_recovers_the_terms_of_a_device_that_follows_the_model() -> None:
    m = _measurements(_truth())
    profile = build_profile(m, ARCHS, "h200", GPUS["h200"], run=RUN)
    for term, value in TRUE.items():
        assert getattr(profile.terms, term) == pytest.approx(value, rel=0.02), term
    assert profile.terms.decode_cuda_graphs and not profile.terms.prefill_cuda_graphs
    assert max(abs(check.error) for check in fit_errors(profile, ARCHS, GPUS["h200"])) < 0.01


MID = Arch(family="qwen2", num_layers=36, hidden_size=2048, num_heads=16, num_kv_heads=2, intermediate_size=11008,
          vocab_size=151936, tie_embeddings=True)


def test_the_decode_fit_tells_a_layers_and_a_requests_cost_apart_where_the_steps_can() -> None:
    """Three shapes whose layers are off their weight bytes' line, timed at several batches and contexts: the
    fit recovers decode_layer_s and decode_request_s beside the rest (and the eager floor less both). Two shapes
    at one context per request (ANCHORS.md's decode figures) cannot tell them from the intercept and the KV read:
    neither is fitted, so the shipped profiles keep their terms."""
    from sims.profiles.fit import DECODE, benchmark_arch

    truth = {**TRUE, "decode_fixed_s": 4e-4, "decode_layer_s": 2e-5, "decode_request_s": 7e-6}
    base = load_profile("h200-cudagraph")
    archs = {**ARCHS, "mid": MID}
    m = _measurements(base.model_copy(update={"terms": base.terms.model_copy(update=truth)}), archs)
    profile = build_profile(m, archs, "h200", GPUS["h200"], run=RUN)
    for term, value in truth.items():
        assert getattr(profile.terms, term) == pytest.approx(value, rel=0.02), term
    assert "per layer" in profile.provenance["decode_layer_s"].source
    assert max(abs(check.error) for check in fit_errors(profile, archs, GPUS["h200"])) < 0.01
    two = build_profile(_measurements(_truth()), ARCHS, "h200", GPUS["h200"], run=RUN)  # two shapes: no layer term
    assert two.terms.decode_layer_s == 0 and two.provenance["decode_layer_s"].status == "estimated"
    anchors = fit(DECODE, GPUS["h200"], benchmark_arch).terms
    assert "decode_layer_s" not in anchors and "decode_request_s" not in anchors
    # a profile fitted before the decode fit had those columns: refitted to the measurements it carries, its
    # engine terms come out true and its live-pool terms stay as they were
    stale = profile.model_copy(update={"terms": profile.terms.model_copy(update={
        "decode_fixed_s": 1.1e-3, "decode_layer_s": 0.0, "decode_request_s": 0.0, "prefill_live_scale": 1.2,
        "request_admit_s": 4e-3})})
    refit = with_engine_refit(stale, archs, GPUS["h200"], name="refit")
    for term, value in truth.items():
        assert getattr(refit.terms, term) == pytest.approx(value, rel=0.02), term
    assert refit.terms.prefill_live_scale == 1.2 and refit.terms.request_admit_s == 4e-3 and refit.name == "refit"
    assert "decode_fixed_s" in refit.description and "refitted" in refit.provenance["decode_layer_s"].source
    with pytest.raises(ValueError, match="mid"):  # a shape it measured that the fleet given lacks
        with_engine_refit(stale, ARCHS, GPUS["h200"])


def test_every_measured_term_says_where_and_how_it_was_measured() -> None:
    profile = build_profile(_measurements(_truth()), ARCHS, "h200", GPUS["h200"], run=RUN, name="mine")
    assert profile.name == "mine" and profile.calibration is not None and profile.calibration.gpu == "h200"
    for term in TRUE:
        entry = profile.provenance[term]
        assert entry.status == "measured" and entry.gpus == ("h200",), term
        assert "modelpool calibrate on NVIDIA H200 (h200), 2026-12-01" in entry.source, term
    assert profile.status("eff_nvlink", "h200") == "estimated"  # not measured: the base profile's
    assert profile.status("eff_mem", "h100") == "estimated"  # measured on an H200 only
    assert profile.calibration.measurements["swap"]  # the raw points travel with the profile (refit, audit)
    assert profile.summary("h200")["calibration"]["command"] == RUN["command"]


def test_a_shared_link_and_the_live_pool_give_their_terms() -> None:
    m = _measurements(_truth())
    large, small = (next(s["seconds"] for s in m["swap"] if s["arch"] == a) for a in ("large", "small"))
    rate = 0.8  # the link moves 0.8 of one copy's rate with two on it: both share until the small one is done
    span = 2 * small / rate + (large - small)
    m["shared"] = [{"archs": ["large", "small"], "bytes": [0, 0], "seconds": [span, 2 * small / rate], "span_s": span}]
    costs = RooflineCostModel.for_models({"small": (SMALL, 1)}, "h200", _truth())
    prefill, step = costs.prefill_s("small", 512, 1), costs.decode_step_s("small", 4, 4 * 320)
    m["live"] = {"arch": "small", "policy": "request-level", "backend": "threads",
                 "prefill": [{"tokens": 512, "ttft_s": prefill + 0.004, "engine_s": prefill + 0.001}] * 3,
                 "decode": {"batch": 4, "context": 320, "gap_s": step + 0.0007, "engine_s": step, "num_gaps": 100}}
    profile = build_profile(m, ARCHS, "h200", GPUS["h200"], run=RUN)
    assert profile.terms.eff_pcie_shared == pytest.approx(rate * profile.terms.eff_pcie, rel=0.01)
    assert profile.terms.link_sharing == "fair" and profile.provenance["link_sharing"].status == "measured"
    assert profile.terms.prefill_host_s == pytest.approx(0.004, rel=0.05)
    assert profile.terms.decode_host_s == pytest.approx(0.0007, rel=0.05)
    assert "sink" in profile.provenance["decode_host_s"].source


def test_the_live_pool_terms_are_charged_after_the_gpu_time() -> None:
    base = load_profile("h200-cudagraph")
    plain = RooflineCostModel.for_models({"m": (LARGE, 1)}, "h200", base)
    terms = base.terms.model_copy(update={"decode_host_s": 1e-3, "prefill_host_s": 5e-3, "prefill_request_s": 2e-4,
                                          "kv_move_fixed_s": 1e-4, "eff_kv_move": base.terms.eff_pcie / 2})
    live = RooflineCostModel.for_models({"m": (LARGE, 1)}, "h200", base.model_copy(update={"terms": terms}))
    assert live.decode_step_s("m", 8, 8000) == pytest.approx(plain.decode_step_s("m", 8, 8000) + 1e-3)
    assert live.decode_turn_s("m", 8, 8000, 10) == pytest.approx(plain.decode_turn_s("m", 8, 8000, 10) + 10e-3)
    per_request = RooflineCostModel.for_models({"m": (LARGE, 1)}, "h200", base.model_copy(
        update={"terms": terms.model_copy(update={"decode_host_request_s": 2e-5})}))
    assert per_request.decode_step_s("m", 8, 8000) == pytest.approx(live.decode_step_s("m", 8, 8000) + 8 * 2e-5)
    assert per_request.decode_turn_s("m", 8, 8000, 10) == pytest.approx(live.decode_turn_s("m", 8, 8000, 10) + 1.6e-3)
    assert live.prefill_s("m", 2048, 4) == pytest.approx(plain.prefill_s("m", 2048, 4) + 5e-3 + 4 * 2e-4)
    assert live.kv_move_s("m", 1000) == pytest.approx(2 * plain.kv_move_s("m", 1000))
    assert (live.kv_move_overhead_s("m"), plain.kv_move_overhead_s("m")) == (1e-4, 0.0)


def test_a_profile_written_before_the_new_terms_reads_as_before(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = load_profile("h200-cudagraph").model_dump(mode="json", exclude={"calibration"})
    for term in ("prefill_request_s", "prefill_host_s", "decode_host_s", "eff_kv_move", "kv_move_fixed_s",
                 "eff_pcie_shared"):
        del data["terms"][term], data["provenance"][term]
    path = tmp_path / "old.json"
    import json

    path.write_text(json.dumps(data))
    old = load_profile(path)
    assert old.terms == load_profile("h200-cudagraph").terms
    assert old.provenance["decode_host_s"].status == "estimated"


def test_times_of_flat_work_hold_an_efficiency_at_one_and_say_so() -> None:
    anchors = [Anchor("swap", "small", 0.01, swap_bytes=b) for b in (1e6, 2e6, 4e6)]  # no growth with bytes
    result = fit(anchors, GPUS["h200"], ARCHS.__getitem__)
    assert result.terms["eff_pcie"] == 1.0 and "eff_pcie" in result.held
    assert result.terms["switch_fixed_s"] == pytest.approx(0.01, rel=0.01)


def test_the_capacity_report_says_which_profile_and_whether_it_was_measured_on_its_gpu() -> None:
    from sims.report import _calibrated

    profile = build_profile(_measurements(_truth()), ARCHS, "h200", GPUS["h200"], run=RUN, name="mine")
    here, there = _calibrated(profile, "h200"), _calibrated(profile, "h100")
    assert here.startswith("measured on this GPU type") and RUN["command"] in here and "NVIDIA H200" in here
    assert there.startswith("measured on h200, not on h100: estimated")
    assert _calibrated(load_profile("default"), "h20") == "not measured on h20: estimated"
    assert profile.summary("h100")["measured_on_this_gpu"] is False


def test_one_copy_waiting_for_the_other_reads_as_first_come_first_served() -> None:
    m = _measurements(_truth())
    large, small = (next(s["seconds"] for s in m["swap"] if s["arch"] == a) for a in ("large", "small"))
    # as on the H200: the small switch kept its time alone, the large one waited for it
    m["shared"] = [{"archs": ["large", "small"], "bytes": [0, 0], "seconds": [large + small, small],
                    "span_s": large + small}] * 2
    profile = build_profile(m, ARCHS, "h200", GPUS["h200"], run=RUN)
    assert profile.terms.link_sharing == "fifo" and "the other waited" in profile.provenance["link_sharing"].source
    assert profile.terms.eff_pcie_shared == pytest.approx(profile.terms.eff_pcie, rel=0.01)


def test_kv_moves_beside_a_switch_are_checked_against_the_link_rule() -> None:
    """A restore shares the switch's direction of the link (fifo: it waits for the switch, or goes first); a save
    goes the other way, which the links charge as if alone. Measurements that do otherwise are said to."""
    m = _measurements(_truth())
    large, small = (next(s["seconds"] for s in m["swap"] if s["arch"] == a) for a in ("large", "small"))
    m["shared"] = [{"archs": ["large", "small"], "bytes": [0, 0], "seconds": [large + small, small],
                    "span_s": large + small}] * 2  # fifo at the rate of one copy
    kv = next(k for k in m["kv_move"] if k["arch"] == "small" and k["batch"] == 8)
    row = {"arch": "small", "batch": 8, "context": 2048, "bytes": kv["bytes"], "copied": "large", "copy_bytes": 0,
           "restore_s": large + kv["restore_s"], "save_s": kv["save_s"]}
    m["kv_shared"] = [row]
    profile = build_profile(m, ARCHS, "h200", GPUS["h200"], run=RUN)
    source = profile.provenance["link_sharing"].source
    assert "restore (the switch's direction)" in source and "NOT" not in source
    assert "behind the switch" in source and "switch of large" in source
    figures = profile.calibration.figures  # type: ignore[union-attr]
    assert figures["kv_shared_restore_vs_rule_behind"] == pytest.approx(1.0, rel=1e-3)
    assert figures["kv_shared_save_vs_rule_first"] == pytest.approx(1.0, rel=1e-3)

    m["kv_shared"] = [row | {"restore_s": 3 * kv["restore_s"], "save_s": 2 * kv["save_s"]}]  # neither rule's charge
    source = build_profile(m, ARCHS, "h200", GPUS["h200"], run=RUN).provenance["link_sharing"].source
    assert source.count("does NOT follow the rule") == 2
    assert "save (the other direction) took 2.00x its time alone" in source


def _live_run(buckets: dict[str, dict], other: dict[str, dict] | None = None) -> dict:
    return {"backend": "processes", "layout": "pd", "rate_rps": 10.0,
            "decode_timings": {"slot1": buckets, "slot0": other or {}}}


def test_the_live_pool_host_terms_come_from_a_run_of_the_live_pool() -> None:
    """decode_host_s + decode_host_request_s x batch through each bucket's time outside the engine: a line the
    fit recovers, from the engine that decoded most, buckets of too few steps left out."""
    line = {"<=1": 1.0, "<=4": 3.2, "<=16": 11.0, "<=64": 40.5}  # bucket -> mean batch
    buckets = {key: {"steps": 100, "batch_mean": batch, "outside_ms_p50": 0.25 + 0.012 * batch} for key, batch in line.items()}
    buckets["<=256"] = {"steps": MIN_STEPS - 1, "batch_mean": 200.0, "outside_ms_p50": 50.0}  # too few: ignored
    few = {"<=1": {"steps": 30, "batch_mean": 1.0, "outside_ms_p50": 9.0}}  # the prefill instance's few decodes
    base = load_profile("h200-cudagraph")
    with pytest.raises(ValueError, match="which GPU type"):  # a shipped profile: no calibration run names the GPU
        with_live_host(base, _live_run(buckets, few), "a test")
    fitted = with_live_host(base, _live_run(buckets, few), "a test", "h200")
    assert fitted.terms.decode_host_s == pytest.approx(2.5e-4, rel=1e-3)
    assert fitted.terms.decode_host_request_s == pytest.approx(1.2e-5, rel=1e-3)
    source = fitted.provenance["decode_host_request_s"]
    assert source.status == "measured" and "processes backend, pd layout" in source.source and "slot1" in source.source
    assert fitted.status("decode_host_request_s", "h200") == "measured" and fitted.name == base.name
    assert fitted.terms.decode_fixed_s == base.terms.decode_fixed_s  # the engine's terms stay
    old = {key: {k: v for k, v in b.items() if k != "batch_mean"} for key, b in buckets.items()}  # before batch_mean
    assert with_live_host(base, _live_run(old), "a test", "h200").terms.decode_host_request_s > 0
    with pytest.raises(ValueError, match="decode_timings"):
        with_live_host(base, {"backend": "threads"}, "a test", "h200")
    with pytest.raises(ValueError, match="needs two"):
        with_live_host(base, _live_run({"<=1": {"steps": 500, "period_ms_p50": 2.0}}), "a test", "h200")


def test_a_staged_hand_off_move_costs_what_the_live_pool_paid_for_it() -> None:
    """kv_handoff_fixed_s: the average of the export's and the import's mean call in the run's kv_timings (hand-offs
    staged in device memory; their median in runs that predate the mean), fitted only where both sides ran often
    enough; the simulator's staged move charges it instead of kv_move_fixed_s, which it takes where the profile
    has none."""
    from pathlib import Path

    from modelpool.config import load_fleet
    from scheduler.instance import kv_device_move_s

    buckets = {"<=1": {"steps": 100, "batch_mean": 1.0, "added_ms_p50": 0.03},
               "<=16": {"steps": 100, "batch_mean": 12.0, "added_ms_p50": 0.08}}
    run = {**_live_run(buckets), "kv_timings": {
        "slot0": {"export_kv(device)": {"calls": 128, "ms_p50": 7.7}},
        "slot1": {"import_kv(device)": {"calls": 118, "ms_p50": 4.5}, "restore_kv": {"calls": 118, "ms_p50": 0.05}}}}
    base = load_profile("h200-cudagraph")
    assert base.terms.kv_handoff_fixed_s is None and "kv_move_fixed_s" in base.provenance["kv_handoff_fixed_s"].source
    fitted = with_live_host(base, run, "a test", "h200")
    assert fitted.terms.kv_handoff_fixed_s == pytest.approx(6.1e-3, rel=1e-3)
    source = fitted.provenance["kv_handoff_fixed_s"]
    assert source.status == "measured" and "medians: export_kv(device) 7.70 ms over 128 calls" in source.source
    assert "kv_handoff_fixed_s" in fitted.description
    # a run that records the mean: the slow calls count, as the simulator charges every move
    timed = {**run, "kv_timings": {"slot0": {"export_kv(device)": {"calls": 128, "ms_p50": 7.7, "ms_mean": 13.0}},
                                   "slot1": {"import_kv(device)": {"calls": 118, "ms_p50": 4.5, "ms_mean": 24.0}}}}
    by_mean = with_live_host(base, timed, "a test", "h200")
    assert by_mean.terms.kv_handoff_fixed_s == pytest.approx(18.5e-3, rel=1e-3)
    assert "means: export_kv(device) 13.00 ms" in by_mean.provenance["kv_handoff_fixed_s"].source
    # a run from before ms_mean: each side's mean by its engine's seconds in that method over its calls
    totals = {**run, "call_s_by_engine": {"slot0": {"export_kv": {"calls": 130, "s": 1.3}},
                                          "slot1": {"import_kv": {"calls": 100, "s": 3.0}}}}
    assert with_live_host(base, totals, "a test", "h200").terms.kv_handoff_fixed_s == pytest.approx(20e-3, rel=1e-3)
    few = {**run, "kv_timings": {"slot0": {"export_kv(device)": {"calls": 3, "ms_p50": 7.7}},
                                 "slot1": {"import_kv(device)": {"calls": 118, "ms_p50": 4.5}}}}
    assert with_live_host(base, few, "a test", "h200").terms.kv_handoff_fixed_s is None  # one side too rare: unfitted
    assert with_live_host(base, _live_run(buckets), "a test", "h200").terms.kv_handoff_fixed_s is None

    fleet = load_fleet(Path(__file__).resolve().parents[2] / "models.yaml")
    model = fleet.models[0].name
    before, after = (RooflineCostModel(fleet, profile=p) for p in (base, fitted))
    moves = [(model, 1000), (model, 300)]
    copies = sum(before.kv_device_copy_s(m, t) for m, t in moves)
    assert kv_device_move_s(before, moves) == pytest.approx(copies + base.terms.kv_move_fixed_s)
    assert kv_device_move_s(after, moves) == pytest.approx(copies + 6.1e-3)
    assert after.kv_move_overhead_s(model) == before.kv_move_overhead_s(model)  # host moves keep their overhead


def test_a_hand_offs_move_is_fitted_per_call_and_per_request_from_the_runs_kv_calls() -> None:
    """With the run's KV calls one by one (`kv_calls`), kv_handoff_fixed_s + kv_handoff_request_s x requests is a
    least-squares line through both sides' staged calls (host-path calls left out); the simulator's staged move
    charges both."""
    from pathlib import Path

    from modelpool.config import load_fleet
    from scheduler.instance import kv_device_move_s

    buckets = {"<=1": {"steps": 100, "batch_mean": 1.0, "added_ms_p50": 0.03},
               "<=16": {"steps": 100, "batch_mean": 12.0, "added_ms_p50": 0.08}}
    calls = {"slot0": [["export_kv(device)", n, 0.004 + 0.0015 * n] for n in (1, 2, 4, 6) * 4]
             + [["export_kv", 3, 0.2]],  # through host memory: not a staged move
             "slot1": [["import_kv(device)", n, 0.004 + 0.0015 * n] for n in (1, 8, 12, 20) * 3]
             + [["restore_kv", 9, 0.001]]}
    run = {**_live_run(buckets), "kv_calls": calls}
    fitted = with_live_host(load_profile("h200-cudagraph"), run, "a test", "h200")
    assert fitted.terms.kv_handoff_fixed_s == pytest.approx(4e-3, rel=1e-3)
    assert fitted.terms.kv_handoff_request_s == pytest.approx(1.5e-3, rel=1e-3)
    assert "28 export and import calls (1 to 20 requests each)" in fitted.provenance["kv_handoff_request_s"].source
    one_side = {**run, "kv_calls": {"slot0": calls["slot0"]}}  # the importer's calls missing: not fitted so
    assert with_live_host(load_profile("h200-cudagraph"), one_side, "a test", "h200").terms.kv_handoff_request_s == 0.0

    fleet = load_fleet(Path(__file__).resolve().parents[2] / "models.yaml")
    model = fleet.models[0].name
    costs = RooflineCostModel(fleet, profile=fitted)
    moves = [(model, 1000), (model, 300), (model, 20)]
    copies = sum(costs.kv_device_copy_s(m, t) for m, t in moves)
    assert kv_device_move_s(costs, moves) == pytest.approx(copies + 4e-3 + 3 * 1.5e-3)


def test_the_live_pools_prefill_scale_is_fitted_to_its_prefills_less_the_neighbours_slowdown() -> None:
    """prefill_live_scale: a run's prefills matched to their calls (`prefill_overlap`), each less the slowdown the
    simulator charges for its overlapped share and less the host terms, over the engine terms' prediction; the
    cost model's prefill then charges it (the GPU part only), and a refit on top of it recovers the same scale."""
    shipped = load_profile("h200-cudagraph")
    base = shipped.model_copy(update={"terms": shipped.terms.model_copy(update={"gpu_share_slowdown": 1.2})})
    archs = {"m-small": (SMALL, 1), "m-large": (LARGE, 1)}
    costs = RooflineCostModel.for_models(archs, "h200", base, gpu_name="h200")
    shapes = [("m-small", 900, 1), ("m-large", 4000, 4), ("m-small", 3000, 3), ("m-large", 600, 1)] * 6
    overlaps = [0.0, 1.0, 0.5, 0.1] * 6
    host = costs.prefill_host_s("m-small")
    samples = [[m, t, n, ((costs.prefill_s(m, t, n) - host) * 1.15 + host) * (1 + 0.2 * o)]
               for (m, t, n), o in zip(shapes, overlaps)]
    buckets = {"<=1": {"steps": 100, "batch_mean": 1.0, "added_ms_p50": 0.03},
               "<=16": {"steps": 100, "batch_mean": 12.0, "added_ms_p50": 0.08}}
    run = {**_live_run(buckets), "prefill_samples": {"slot0": samples}, "prefill_overlap": {"slot0": overlaps}}
    fitted = with_live_host(base, run, "a test", "h200", archs=archs)
    assert fitted.terms.prefill_live_scale == pytest.approx(1.15, rel=1e-3)
    assert "the 12 that ran mostly alone (under 20% overlapped) 1.150x" in fitted.provenance["prefill_live_scale"].source
    assert with_live_host(base, run, "a test", "h200").terms.prefill_live_scale == 1.0  # no shapes: not fitted
    unmatched = {**run, "prefill_overlap": {"slot0": [None] * len(samples)}}
    assert with_live_host(base, unmatched, "a test", "h200", archs=archs).terms.prefill_live_scale == 1.0
    after = RooflineCostModel.for_models(archs, "h200", fitted, gpu_name="h200")
    for m, t, n in shapes[:4]:
        assert after.prefill_s(m, t, n) - host == pytest.approx((costs.prefill_s(m, t, n) - host) * 1.15, rel=1e-3)
    again = with_live_host(fitted, run, "a test", "h200", archs=archs)  # the base's own scale divided out
    assert again.terms.prefill_live_scale == pytest.approx(1.15, rel=1e-3)


def test_a_prefill_at_a_fresh_shape_costs_what_its_first_run_did() -> None:
    """prefill_fresh_s: calibrate's first run of each prefill shape over its repeats (median), or the engine alone
    at the live run's shapes (--from-live); the simulator adds it to every prefill, with prefill_host_s."""
    from pathlib import Path

    from modelpool.config import load_fleet

    m = _measurements(_truth())
    extra = [0.004, 0.010, 0.012, -0.001]  # the last: a first run faster than the repeats counts as 0
    m["prefill"] = [{**p, "first_s": p["seconds"] + extra[k % len(extra)]} for k, p in enumerate(m["prefill"])]
    profile = build_profile(m, ARCHS, "h200", GPUS["h200"], run=RUN)
    values = sorted(max(0.0, extra[k % len(extra)]) for k in range(len(m["prefill"])))
    want = (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2
    assert profile.terms.prefill_fresh_s == pytest.approx(want, rel=1e-3) and want > 0
    assert profile.provenance["prefill_fresh_s"].status == "measured"
    assert max(abs(check.error) for check in fit_errors(profile, ARCHS, GPUS["h200"])) < 0.01  # engine terms as before
    old = build_profile(_measurements(_truth()), ARCHS, "h200", GPUS["h200"], run=RUN)  # no first runs recorded
    assert old.terms.prefill_fresh_s == 0.0

    buckets = {"<=1": {"steps": 100, "batch_mean": 1.0, "added_ms_p50": 0.03},
               "<=16": {"steps": 100, "batch_mean": 12.0, "added_ms_p50": 0.08}}
    run = {**_live_run(buckets), "prefill_vs_standalone": {"samples": 69, "standalone_fresh_ms_p50": 46.44,
                                                           "standalone_best_ms_p50": 37.0}}
    base = load_profile("h200-cudagraph")
    fitted = with_live_host(base, run, "a test", "h200")
    assert fitted.terms.prefill_fresh_s == pytest.approx(9.44e-3, rel=1e-3)
    assert "46.44 ms" in fitted.provenance["prefill_fresh_s"].source and "prefill_fresh_s" in fitted.description
    assert with_live_host(base, _live_run(buckets), "a test", "h200").terms.prefill_fresh_s == 0.0
    # a run with the per-shape figure (first run less repeats, shape by shape) takes its median, not the
    # difference of the two medians (shapes that are slow at both would count)
    paired = {**run, "prefill_vs_standalone": {**run["prefill_vs_standalone"], "standalone_fresh_extra_ms_p50": 1.5}}
    refit = with_live_host(base, paired, "a test", "h200")
    assert refit.terms.prefill_fresh_s == pytest.approx(1.5e-3) and "1.5 ms" in refit.provenance["prefill_fresh_s"].source

    fleet = load_fleet(Path(__file__).resolve().parents[2] / "models.yaml")
    model = fleet.models[0].name
    before, after = (RooflineCostModel(fleet, profile=p) for p in (base, fitted))
    assert after.prefill_s(model, 512, 1) - before.prefill_s(model, 512, 1) == pytest.approx(9.44e-3, rel=1e-6)
