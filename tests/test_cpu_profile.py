"""A profile measured on a CPU, as a user meets it (issue 38 items 5 and 9): refused on a GPU fleet unless
`--force-profile` (then warned about, naming both devices), and accepted by the shipped CPU fleet
(examples/cpu.yaml) straight from `modelpool calibrate --device cpu --quick`."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.sims.test_capacity import TINY_FLEET
from tests.test_planner_first_hour import calibrated_profile, flat, invoke

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_FLEET = ROOT / "examples" / "cpu.yaml"


@pytest.fixture()
def h20_fleet(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_FLEET)  # pool.gpu: h20
    return path


def test_force_profile_turns_the_refusal_into_a_warning_naming_both_devices(
        h20_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cpu = calibrated_profile(tmp_path, "cpu", "cpu")
    code, output = invoke("simulate", "--fleet", str(h20_fleet), "--duration", "10", "--profile", str(cpu))
    assert code == 1
    assert "or pass --force-profile to use it anyway" in flat(output) and "examples/cpu.yaml" in output
    for command in (["simulate", "--fleet", str(h20_fleet), "--duration", "10"],
                    ["capacity", "--fleet", str(h20_fleet), "--duration", "10", "--workers", "0", "--policies",
                     "dedicated", "--no-sensitivity", "--what-if-tpot", "0", "--out", str(tmp_path / "r")],
                    ["estimate", "--model", "small-a", "--fleet", str(h20_fleet)]):
        code, output = invoke(*command, "--profile", str(cpu), "--force-profile")
        assert code == 0, (command, output)
        assert (f"warning: --profile {cpu} was measured on cpu (calibrated as GPU type cpu), but the fleet runs on "
                f"H20; used anyway (--force-profile)" in flat(output)), command


def test_the_cpu_fleet_example_is_valid() -> None:
    code, output = invoke("validate", str(CPU_FLEET))
    assert code == 0, output
    assert f"OK: {CPU_FLEET} is valid (16 GB per CPU)." in flat(output)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "modelpool.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_calibrate_on_this_cpu_then_simulate_and_size_the_cpu_fleet_with_it(tmp_path: pathlib.Path) -> None:
    """The whole path a CPU user takes; 16-26 s on 2 cores (calibrate --quick is most of it), so not `slow`."""
    from modelpool.calibrate import pick_host_backend
    from modelpool.config import load_fleet
    from modelpool.estimate import estimate_report
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile
    from sims.profiles.measurements import Measurements

    measured = tmp_path / "cpu.json"
    done = _cli("calibrate", "--device", "cpu", "--quick", "--out", str(measured))
    assert done.returncode == 0, done.stderr[-3000:]
    profile = load_profile(measured)
    assert profile.calibration is not None and profile.calibration.gpu == "cpu" and profile.device_spec is not None
    host = Measurements.model_validate_json(measured.read_text()).points.host
    assert host.backend == pick_host_backend(None, quick=True) and host.handoff_s  # serve's (no Ray cluster: quick)
    # the way in and out as clients measure it: through the gateway, its terms from those requests
    assert {p.prompt_tokens for p in host.gateway} == {16, 512, 4096}
    assert "through the gateway" in Measurements.model_validate_json(measured.read_text()).terms[
        "request_prompt_token_s"].how
    assert profile.terms.request_admit_s > 0 and profile.terms.token_deliver_s > 0

    done = _cli("simulate", "--fleet", str(CPU_FLEET), "--profile", str(measured), "--duration", "120",
                "--out", str(tmp_path / "sim"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning" not in done.stdout + done.stderr  # measured where the fleet runs: nothing to warn of
    text = flat(done.stdout)
    assert "terms measured on cpu; calibrated on cpu (cpu)" in text
    metrics = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    assert metrics["completed"] > 0 and metrics["failed"] == 0 and metrics["p50_tpot_ms"] > 0
    assert metrics["profile"]["calibration"]["device"] == "cpu"

    # the CPU's own rates cost the fleet, in simulate as in estimate (not the fleet file's rough laptop figures)
    fleet = load_fleet(CPU_FLEET)
    costs = RooflineCostModel(fleet, profile=profile)
    assert costs.gpu == profile.device_spec and costs.gpu != fleet.gpu()
    report = estimate_report(fleet, "smollm2-135m-chat", None, None, 1, 300, 2, str(measured))
    assert report["ttft_s"] == pytest.approx(costs.prefill_s("smollm2-135m-chat", 300, 1))

    out = tmp_path / "report"
    done = _cli("capacity", "--fleet", str(CPU_FLEET), "--profile", str(measured), "--duration", "60", "--workers",
                "0", "--policies", "dedicated,token-level", "--no-sensitivity", "--what-if-tpot", "0", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    sized = json.loads((out / "report.json").read_text())
    assert sized["gpu"] == "cpu" and set(sized["policies"]) == {"dedicated", "token-level"}
    assert all(entry["gpus"] >= 1 for entry in sized["policies"].values())
    assert sized["profile"]["calibration"]["gpu"] == "cpu"

    # the same profile on a GPU fleet (the shipped models.yaml, H20s): refused, naming both
    done = _cli("simulate", "--profile", str(measured), "--duration", "10")
    assert done.returncode == 1
    assert (f"--profile {measured} was measured on cpu (calibrated as GPU type cpu), but the fleet runs on H20"
            in flat(done.stderr))
