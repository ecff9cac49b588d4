"""How one GPU's host link serves two instances' copies: benchmarks/gpu_link_share.py (tiny buffers here; the H200
run is in BENCHMARKS.md) and `modelpool calibrate --link-share`, which reads link_sharing and eff_pcie_shared
from its result into a profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from modelpool.cli import app
from sims.profiles import load_profile
from sims.profiles.calibrated import link_sharing_of

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
BASE = DATA / "h200-calibrated-live-mps-s17.json"
ALONE = {"7b": [0.277, 0.278, 0.276], "3b": [0.112, 0.113, 0.112], "kv": [0.012, 0.012, 0.013]}


def probe(seconds: list[float], span: float, *, mps: bool | None = True) -> dict:
    return {"mode": "processes", "mps": mps, "measured_at": "2026-12-05T12:00:00+00:00", "alone": ALONE,
            "shared": [{"archs": ["7b", "3b"], "seconds": seconds, "span_s": span}] * 3,
            "small_beside": [{"big": "7b", "small": "kv", "big_s": 0.29, "small_s": 0.024, "small_started_s": 0.05}]}


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_the_probe_runs_tiny_on_cpu_and_names_a_rule(tmp_path: Path, mode: str) -> None:
    """Each size alone, the pairs together and the small copy beside the largest, from two threads or two
    processes; the result names which rule the pairs followed."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_link_share import PAIRS, main

    out = tmp_path / "link.json"
    assert main(["--tiny", "--repeats", "2", "--out", str(out)] + (["--threads"] if mode == "threads" else [])) == 0
    got = json.loads(out.read_text())
    assert got["mode"] == mode and set(got["alone"]) == {"7b", "3b", "1.5b", "kv"}
    assert all(len(v) == 2 and all(s > 0 for s in v) for v in got["alone"].values())
    assert len(got["shared"]) == 2 * len(PAIRS) and {tuple(r["archs"]) for r in got["shared"]} == set(PAIRS)
    for run in got["shared"]:  # the span covers both copies
        assert run["span_s"] >= max(run["seconds"]) - 1e-6
    assert got["small_beside"][0]["big"] == "7b" and got["small_beside"][0]["small"] == "kv"
    assert got["verdict"].startswith(("fifo", "fair", "the copies did not overlap"))


def test_the_rule_is_read_from_whether_one_copy_kept_its_time_alone() -> None:
    alone = {k: sorted(v)[1] for k, v in ALONE.items()}
    # the 3B kept its time, the 7B waited for it: fifo, the link's rate (w1 + w2) / span
    rule, rate = link_sharing_of(alone, [{"archs": ["7b", "3b"], "seconds": [0.39, 0.112], "span_s": 0.39}])
    assert rule == "fifo" and rate == pytest.approx((0.277 + 0.112) / 0.39)
    # both slowed: processor sharing; the last ends at 2 w2 / rate + w1 - w2
    rule, rate = link_sharing_of(alone, [{"archs": ["7b", "3b"], "seconds": [0.45, 0.25], "span_s": 0.45}])
    assert rule == "fair" and rate == pytest.approx(2 * 0.112 / (0.45 - (0.277 - 0.112)))
    # one after the other (no overlap): nothing to read
    assert link_sharing_of(alone, [{"archs": ["7b", "3b"], "seconds": [0.277, 0.112], "span_s": 0.277}]) is None


def test_calibrate_link_share_puts_the_probe_s_rule_on_a_profile(tmp_path: Path) -> None:
    """`--link-share PROBE --profile P`: no measurement; link_sharing and eff_pcie_shared from the probe's pairs,
    measured (the provenance says processes under MPS and the probe's file), every other term as P has it; the probe
    stays in the measurements, so a refit reads the link from it too."""
    from sims.profiles.calibrated import _link_sharing

    path, out = tmp_path / "link_mps.json", tmp_path / "linked.json"
    path.write_text(json.dumps(probe([0.45, 0.25], 0.45)))
    res = CliRunner().invoke(app, ["calibrate", "--profile", str(BASE), "--link-share", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    before, after = load_profile(BASE), load_profile(out)
    assert before.terms.link_sharing == "fifo" and after.terms.link_sharing == "fair"
    rate = 2 * 0.112 / (0.45 - (0.277 - 0.112))
    assert after.terms.eff_pcie_shared == pytest.approx(rate * before.terms.eff_pcie, rel=1e-3)
    assert after.terms.model_copy(update={"link_sharing": "fifo", "eff_pcie_shared": before.terms.eff_pcie_shared}) \
        == before.terms
    source = after.provenance["link_sharing"].source
    assert "processes (under MPS) on one device" in source and "link_mps.json" in source and "both copies slowed" in source
    assert after.status("link_sharing", "h200") == "measured"
    assert _link_sharing(after.calibration.measurements) == ("fair", pytest.approx(rate))
    assert _link_sharing(before.calibration.measurements)[0] == "fifo"  # calibrate's two threads


def test_calibrate_link_share_refuses_a_probe_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "link.json"
    path.write_text(json.dumps(probe([0.277, 0.112], 0.277)))  # no overlap
    res = CliRunner().invoke(app, ["calibrate", "--profile", str(BASE), "--link-share", str(path),
                                   "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 1 and "--link-share" in res.output and "did not overlap" in res.output
    path.write_text(json.dumps({"alone": {}}))
    res = CliRunner().invoke(app, ["calibrate", "--profile", str(BASE), "--link-share", str(path),
                                   "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 1 and "not a gpu_link_share.py result" in res.output and "link.json" in res.output
    assert not (tmp_path / "p.json").exists()
