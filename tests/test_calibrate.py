"""`modelpool calibrate --quick --device cpu` on a fleet of tiny shapes, then `modelpool simulate --profile` with
the profile it wrote: the smoke run CI makes of the calibration (torch engine on CPU, random weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from modelpool.cli import app
from sims.profiles import TERM_NAMES, load_profile

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # small real inputs: H200 profiles and probes

FLEET = """\
gpus:
  cpu-box: {memory_gb: 16, hbm_tb_s: 0.05, bf16_tflops: 1.0, h2d_gb_s: 20, nvlink_gb_s: 10, usd_per_hour: 0.1,
            source: "a CI runner's CPU (nominal figures for the test)"}
pool: {gpu: cpu-box, num_gpus: 2, gpus_per_node: 2, gpus_per_host_link: 1, default_slo: {ttft_s: 5.0, tpot_s: 0.5}}
models:
  - name: tiny-qwen
    arch: {family: qwen2, num_layers: 2, hidden_size: 128, num_heads: 4, num_kv_heads: 2, intermediate_size: 256,
           vocab_size: 1024, max_context: 4096}
    traffic: {rate_rps: 0.5}
  - name: tiny-qwen-too
    arch: {family: qwen2, num_layers: 2, hidden_size: 128, num_heads: 4, num_kv_heads: 2, intermediate_size: 256,
           vocab_size: 1024, max_context: 4096}
    traffic: {rate_rps: 0.3}
  - name: tiny-llama
    arch: {family: llama, num_layers: 3, hidden_size: 192, num_heads: 6, num_kv_heads: 2, intermediate_size: 384,
           vocab_size: 1024, max_context: 4096}
    traffic: {rate_rps: 0.5}
"""


def test_calibrate_on_cpu_then_simulate_with_the_profile(tmp_path: Path) -> None:
    fleet = tmp_path / "tiny.yaml"
    fleet.write_text(FLEET)
    profile_path = tmp_path / "cpu-profile.json"
    res = CliRunner().invoke(app, ["calibrate", "--fleet", str(fleet), "--device", "cpu", "--quick",
                                   "--out", str(profile_path)])
    assert res.exit_code == 0, res.output
    profile = load_profile(profile_path)
    run = profile.calibration
    assert run is not None and run.device == "cpu" and run.gpu == "cpu-box" and run.quick
    assert run.shapes == ("tiny-qwen", "tiny-llama")  # two models share a shape: measured once
    assert "--device cpu" in run.command and run.measurements["live"]["decode"]["num_gaps"] > 0
    measured = [t for t in TERM_NAMES if profile.status(t, "cpu-box") == "measured"]
    assert set(measured) >= {"eff_compute", "eff_mem", "eff_kv", "eff_pcie", "decode_fixed_s", "prefill_host_s",
                             "decode_host_s", "eff_kv_move"}
    assert not profile.terms.decode_cuda_graphs  # CPU: eager steps
    # each prefill shape's first run is kept: what a shape the engine has not run costs on top (prefill_fresh_s)
    assert all(p["first_s"] > 0 for p in run.measurements["prefill"])
    assert profile.status("prefill_fresh_s", "cpu-box") == "measured"
    # the engine's padding setting is recorded (off on CPU) and the cost model charges accordingly
    assert profile.terms.prefill_padded is False and profile.status("prefill_padded", "cpu-box") == "measured"
    # KV moves beside the other engine's switch of the largest shape, at each shape's largest KV point
    beside = run.measurements["kv_shared"]
    assert [(k["arch"], k["batch"], k["context"], k["copied"]) for k in beside] == \
        [(name, 4, 48, "tiny-llama") for name in run.shapes]
    assert all(k[f"{way}_{what}"] > 0 for k in beside for way in ("save", "restore") for what in ("s", "copy_s", "span_s"))
    assert "checked against KV moves beside another engine's switch of tiny-llama" in \
        profile.provenance["link_sharing"].source
    assert {"kv_shared_restore_vs_rule_behind", "kv_shared_save_slowdown"} <= set(run.figures)
    assert profile.status("eff_mem", "h200") == "estimated"  # a CPU measurement is no H200 one

    # the engine terms fitted again to the measurements the profile carries: this build's fits, so none moves
    refit = tmp_path / "refit.json"
    res = CliRunner().invoke(app, ["calibrate", "--profile", str(profile_path), "--refit-engine", "--fleet",
                                   str(fleet), "--out", str(refit)])
    assert res.exit_code == 0, res.output
    again = load_profile(refit)
    assert again.name == "refit" and again.terms == profile.terms and "(none moved)" in again.description
    assert "refitted" in again.provenance["eff_mem"].source and again.calibration == profile.calibration
    other = tmp_path / "other.yaml"  # a fleet without the measured shapes, a profile without measurements
    other.write_text(FLEET.replace("tiny-llama", "tiny-other"))
    res = CliRunner().invoke(app, ["calibrate", "--profile", str(profile_path), "--refit-engine", "--fleet",
                                   str(other), "--out", str(refit)])
    assert res.exit_code == 1 and "tiny-llama" in res.output and "not in the fleet" in res.output
    res = CliRunner().invoke(app, ["calibrate", "--profile", "h200-cudagraph", "--refit-engine", "--out", str(refit)])
    assert res.exit_code == 1 and "carries no calibration measurements" in res.output
    res = CliRunner().invoke(app, ["calibrate", "--refit-engine", "--out", str(refit)])
    assert res.exit_code == 1 and "--refit-engine needs --profile" in res.output

    out = tmp_path / "sim"
    res = CliRunner().invoke(app, ["simulate", "--fleet", str(fleet), "--profile", str(profile_path),
                                   "--policy", "token-level", "--duration", "30", "--out", str(out)])
    assert res.exit_code == 0, res.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["completed"] > 0 and metrics["failed"] == 0
    assert metrics["profile"]["name"] == "cpu-profile" and metrics["profile"]["source"] == str(profile_path)
    assert metrics["profile"]["measured_on_this_gpu"] and metrics["profile"]["calibration"]["device"] == "cpu"


def test_calibrate_refuses_what_it_cannot_measure(tmp_path: Path) -> None:
    fleet = tmp_path / "moe.yaml"
    fleet.write_text("gpus:\n  big-cpu: {memory_gb: 512, hbm_tb_s: 0.2, bf16_tflops: 2, h2d_gb_s: 20, nvlink_gb_s: 10, "
                     "usd_per_hour: 1}\npool: {gpu: big-cpu}\nmodels:\n  - {name: moe, arch: qwen3-30b-a3b}\n")
    res = CliRunner().invoke(app, ["calibrate", "--fleet", str(fleet), "--device", "cpu", "--out",
                                   str(tmp_path / "p.json")])
    assert res.exit_code == 1
    assert "mixture of experts" in res.output and "no model shape" in res.output
    res = CliRunner().invoke(app, ["calibrate", "--fleet", str(fleet), "--device", "cpu", "--gpu", "nosuch"])
    assert res.exit_code == 1 and "--gpu 'nosuch'" in res.output


def test_a_cpu_measurement_does_not_count_for_a_gpu_type(tmp_path: Path) -> None:
    """--device cpu for a catalogue GPU would write a profile whose terms read as measured on that GPU."""
    fleet = tmp_path / "tiny.yaml"
    fleet.write_text(FLEET)
    out = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["calibrate", "--fleet", str(fleet), "--device", "cpu", "--gpu", "h200",
                                   "--quick", "--out", str(out)])
    assert res.exit_code == 1 and "measures this machine's CPU, not a H200" in res.output and not out.exists()


def test_calibrate_from_a_live_run_fits_the_host_terms_on_a_profile(tmp_path: Path) -> None:
    """`--from-live`: no measurement; the live pool's time outside the engine per decode step (a gpu_pool.py run
    JSON) becomes decode_host_s + decode_host_request_s on top of --profile, and simulate reads the result."""
    run = {"backend": "processes", "layout": "pd", "rate_rps": 1.0, "decode_timings": {"slot1": {
        "<=1": {"steps": 50, "batch_mean": 1.0, "outside_ms_p50": 0.3},
        "<=8": {"steps": 50, "batch_mean": 6.0, "outside_ms_p50": 0.35}}}}
    run_path, out = tmp_path / "run.json", tmp_path / "live.json"
    run_path.write_text(json.dumps(run))
    res = CliRunner().invoke(app, ["calibrate", "--from-live", str(run_path), "--profile", "h200-cudagraph",
                                   "--out", str(out)])
    assert res.exit_code == 1 and "--gpu TYPE" in res.output  # a shipped profile does not say which GPU ran live
    res = CliRunner().invoke(app, ["calibrate", "--from-live", str(run_path), "--profile", "h200-cudagraph",
                                   "--gpu", "h200", "--out", str(out)])
    assert res.exit_code == 0, res.output
    profile = load_profile(out)
    assert abs(profile.terms.decode_host_s - 2.9e-4) < 1e-9 and abs(profile.terms.decode_host_request_s - 1e-5) < 1e-12
    assert profile.status("decode_host_s", "h200") == "measured" and profile.status("decode_host_s", "h100") == "estimated"
    assert profile.name == "live" and "from the live pool run run.json" in profile.description
    res = CliRunner().invoke(app, ["simulate", "--profile", str(out), "--duration", "30"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["calibrate", "--from-live", str(run_path), "--out", str(out)])
    assert res.exit_code == 1 and "--from-live needs --profile" in res.output
    # prefills matched to their calls: with the fleet the run served (--fleet), prefill_live_scale too
    from modelpool.config import load_fleet
    from sims.costmodel import RooflineCostModel

    fleet = load_fleet(ROOT / "models.yaml")
    name, arch, tp = fleet.models[0].name, fleet.models[0].arch, fleet.models[0].tp
    costs = RooflineCostModel.for_models({name: (arch, tp)}, "h200", load_profile("h200-cudagraph"), gpu_name="h200")
    samples = [[name, tokens, 1, 1.3 * costs.prefill_s(name, tokens, 1)] for tokens in range(500, 3000, 100)]
    run_path.write_text(json.dumps({**run, "prefill_samples": {"slot0": samples},
                                    "prefill_overlap": {"slot0": [0.0] * len(samples)}}))
    res = CliRunner().invoke(app, ["calibrate", "--from-live", str(run_path), "--profile", "h200-cudagraph",
                                   "--gpu", "h200", "--fleet", str(ROOT / "models.yaml"), "--out", str(out)])
    assert res.exit_code == 0 and "prefill_live_scale 1.3" in res.output, res.output
    assert load_profile(out).status("prefill_live_scale", "h200") == "measured"
    other = tmp_path / "other.yaml"
    other.write_text((ROOT / "models.yaml").read_text().replace(f"name: {name}", "name: renamed-model"))
    res = CliRunner().invoke(app, ["calibrate", "--from-live", str(run_path), "--profile", "h200-cudagraph",
                                   "--gpu", "h200", "--fleet", str(other), "--out", str(out)])
    assert res.exit_code == 0 and f"does not have the run's model(s) {name}" in " ".join(res.output.split())
    assert load_profile(out).terms.prefill_live_scale == 1.0


def test_calibrate_request_path_fits_the_way_in_and_out_from_a_light_run(tmp_path: Path) -> None:
    """`--request-path`: request_admit_s and token_deliver_s from a light gpu_pool.py run's ttft_parts (its requests
    an idle instance went straight to), on top of --profile; a run without them, or under load, is refused by name."""
    parts = {"requests": 30, "admission (sent while idle)": {"n": 25, "mean_ms": 5.0, "p50_ms": 4.0, "max_ms": 9.0,
                                                             "sum_s": 0.1},
             "delivery (sent while idle)": {"n": 25, "mean_ms": 1.2, "p50_ms": 1.1, "max_ms": 2.0, "sum_s": 0.03}}
    light, out = tmp_path / "light.json", tmp_path / "path.json"
    light.write_text(json.dumps({"backend": "processes", "layout": "pd", "rate_rps": 1.0, "ttft_parts": parts}))
    res = CliRunner().invoke(app, ["calibrate", "--profile", "h200-cudagraph", "--gpu", "h200", "--request-path",
                                   str(light), "--out", str(out)])
    assert res.exit_code == 0, res.output
    profile = load_profile(out)
    assert (profile.terms.request_admit_s, profile.terms.token_deliver_s) == (0.004, 0.0011)
    assert profile.status("request_admit_s", "h200") == "measured" and "light.json" in profile.description
    res = CliRunner().invoke(app, ["simulate", "--profile", str(out), "--duration", "30"])
    assert res.exit_code == 0, res.output
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"rate_rps": 1.0}))
    res = CliRunner().invoke(app, ["calibrate", "--profile", "h200-cudagraph", "--gpu", "h200", "--request-path",
                                   str(bare), "--out", str(out)])
    assert res.exit_code == 1 and f"--request-path {bare}" in res.output and "no ttft_parts" in res.output
    res = CliRunner().invoke(app, ["calibrate", "--request-path", str(light), "--out", str(out)])
    assert res.exit_code == 1 and "--request-path needs --profile" in res.output


def test_calibrate_gpu_share_fits_the_probe_on_a_profile(tmp_path: Path) -> None:
    """`--gpu-share PROBE --profile P`: no measurement; gpu_share_slowdown is the median over prompts of the
    probe's prefill beside a decoding process over the same length alone, measured on P's GPU; a file that is no
    probe result is refused by name."""
    profile_path = DATA / "h200-calibrated.json"
    probe = {"m": {"fresh_again": [[100, 10.0], [200, 20.0], [300, 30.0]]},
             "with_decode_process": {"m": [[100, 15.0], [200, 40.0], [300, 36.0]]}}  # 1.5, 2.0, 1.2
    probe_path, out = tmp_path / "share.json", tmp_path / "shared.json"
    probe_path.write_text(json.dumps(probe))
    res = CliRunner().invoke(app, ["calibrate", "--gpu-share", str(probe_path), "--profile", str(profile_path),
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    profile = load_profile(out)
    assert profile.terms.gpu_share_slowdown == pytest.approx(1.5) and profile.name == "shared"
    assert profile.status("gpu_share_slowdown", "h200") == "measured" and "share.json" in \
        profile.provenance["gpu_share_slowdown"].source
    before = load_profile(profile_path).terms
    assert profile.terms.model_copy(update={"gpu_share_slowdown": before.gpu_share_slowdown}) == before  # only it
    probe_path.write_text(json.dumps({"m": {}}))
    res = CliRunner().invoke(app, ["calibrate", "--gpu-share", str(probe_path), "--profile", str(profile_path),
                                   "--out", str(tmp_path / "bad.json")])
    assert res.exit_code == 1 and "--gpu-share" in res.output and "share.json" in res.output
    assert not (tmp_path / "bad.json").exists()


def test_capacity_with_a_calibrated_profile_says_which_and_whether_measured_on_its_gpu(tmp_path: Path) -> None:
    """`modelpool capacity --profile FILE` with the profile calibrated on the H200: the report names it, says it was
    measured on this GPU type and by which command, and how the profile shares links and GPUs."""
    fleet = tmp_path / "h200.yaml"
    fleet.write_text("pool: {gpu: h200, num_gpus: 2, gpus_per_node: 2, gpus_per_host_link: 1}\nmodels:\n"
                     "  - {name: a, arch: qwen2.5-1.5b, traffic: {rate_rps: 0.3}}\n"
                     "  - {name: b, arch: qwen2.5-7b, traffic: {rate_rps: 0.3}}\n")
    path = DATA / "h200-calibrated.json"
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["capacity", "--fleet", str(fleet), "--profile", str(path), "--workers", "0",
                                   "--policies", "dedicated,token-level", "--duration", "60", "--what-if-tpot", "0",
                                   "--gpu-types", "h200,h100", "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["profile"]["name"] == "h200-calibrated" and report["profile"]["measured_on_this_gpu"]
    rows = {a["what"]: a["value"] for a in report["assumptions"]}
    calibrated = load_profile(path).calibration
    assert rows["cost model profile on H200"].startswith(f"profile h200-calibrated (measured on this GPU type; "
                                                         f"`{calibrated.command}` on NVIDIA H200")
    # the other GPU type compared: the H200's efficiencies carried by datasheet ratios, its times carried over
    assert rows["cost model profile on H100"].startswith("profile h200-calibrated (measured on h200, not on h100: "
                                                        "estimated;")
    assert "estimated from datasheet ratios (efficiencies measured on h200): eff_compute" in rows["cost model profile on H100"]
    assert "one at a time in the order they start" in rows["host links"]  # the H200's copy engine: fifo
    assert f"gpu_share_slowdown {load_profile(path).terms.gpu_share_slowdown} applies only where instances share a GPU" in rows["GPU time-sharing"]
    assert "cost model profile on H200" in (out / "report.md").read_text()


def test_a_gpu_is_not_counted_as_another_catalogue_gpu(capsys) -> None:  # type: ignore[no-untyped-def]
    """An H200 measured for a fleet whose pool.gpu is the H20 (the shipped models.yaml's) would write 'measured on
    h20'; a device the catalogue does not name, counted for a type of the fleet's own, only gets a note."""
    import typer

    from modelpool.calibrate import _check_device

    with pytest.raises(typer.Exit):
        _check_device("NVIDIA H200", "h20", cuda=True)
    assert "pass --gpu h200" in capsys.readouterr().err
    for name, gpu in (("NVIDIA H200", "h200"), ("NVIDIA H20", "h20"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                      ("NVIDIA H100 80GB HBM3", "h100")):
        _check_device(name, gpu, cuda=True)
    assert "note" not in capsys.readouterr().out
    _check_device("NVIDIA L40S", "my-l40s", cuda=True)
    assert "measuring NVIDIA L40S for GPU type 'my-l40s'" in capsys.readouterr().out


def test_a_broken_profile_file_is_named_by_simulate_capacity_and_estimate(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "half a profile"}')
    fleet = tmp_path / "f.yaml"
    fleet.write_text("pool: {gpu: h200, num_gpus: 1}\nmodels:\n  - {name: a, arch: qwen2.5-1.5b, traffic: {rate_rps: 0.1}}\n")
    for command in (["simulate", "--fleet", str(fleet), "--duration", "10"],
                    ["capacity", "--fleet", str(fleet), "--duration", "10", "--workers", "0", "--out", str(tmp_path / "r")],
                    ["estimate", "--model", "qwen2.5-7b", "--gpu", "h200"]):
        res = CliRunner().invoke(app, [*command, "--profile", str(bad)])
        assert res.exit_code == 1 and f"calibration profile {bad}: not a valid profile" in res.output, command
        assert "terms" in res.output and isinstance(res.exception, SystemExit), command  # an error line, no traceback


def test_serve_names_a_broken_profile_file(tmp_path: Path) -> None:
    """`modelpool serve --profile` on a GPU layout (built here without a GPU, as benchmarks/gpu_pool_sim.py does)."""
    import sys

    import typer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_pool import TINY_FLEET, build_models

    from modelpool.serve import fleet_deployment

    fleet = build_models(tmp_path, TINY_FLEET, "cpu")
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(typer.BadParameter, match=f"calibration profile {bad}: not a valid profile"):
        fleet_deployment(fleet, "torch", 1, None, "token-level", None, profile=bad)


def test_gpu_share_decode_takes_the_decode_term_from_its_own_probe_measured_the_same_way(tmp_path: Path) -> None:
    """--gpu-share-decode: gpu_share_decode_slowdown from a --decode-share probe, refused when it was measured with
    MPS and the --gpu-share probe without (or the other way round), and without --gpu-share."""
    results = DATA
    base, share, decode = (results / name for name in ("h200-calibrated-live-s12.json", "h200-prefill-share-s12.json",
                                                        "h200-decode-share-s13.json"))
    out = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["calibrate", "--profile", str(base), "--gpu-share", str(share),
                                   "--gpu-share-decode", str(decode), "--out", str(out)])
    assert res.exit_code == 0, res.output
    profile = load_profile(out)
    probe = json.loads(decode.read_text())["decode_share"]
    ratios = sorted(ms / sorted(probe["alone"][m])[1] for m, s in probe["beside_prefill_process"].items() for ms in s)
    assert profile.terms.gpu_share_decode_slowdown == pytest.approx((ratios[2] + ratios[3]) / 2, rel=1e-3)
    assert "time-sliced, no MPS" in profile.provenance["gpu_share_decode_slowdown"].source
    assert profile.terms.gpu_share_slowdown == load_profile(results / "h200-calibrated-live-s12.json").terms.gpu_share_slowdown
    mps = results / "h200-prefill-share-mps-s13.json"
    res = CliRunner().invoke(app, ["calibrate", "--profile", str(base), "--gpu-share", str(mps),
                                   "--gpu-share-decode", str(decode), "--out", str(tmp_path / "q.json")])
    assert res.exit_code != 0 and "measured without MPS" in res.output and "under MPS" in res.output
    assert not (tmp_path / "q.json").exists()
    res = CliRunner().invoke(app, ["calibrate", "--profile", str(base), "--gpu-share-decode", str(decode),
                                   "--out", str(tmp_path / "r.json")])
    assert res.exit_code != 0 and "--gpu-share-decode needs --gpu-share" in res.output
