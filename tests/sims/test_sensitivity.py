"""The capacity report's sensitivity line (sims.sensitivity): the least certain terms 20% worse, searched again."""

from __future__ import annotations

import json
import pathlib

import pytest
from typer.testing import CliRunner

from modelpool.cli import app
from scheduler.fleet import ARCHS, Arch
from sims.costmodel import RooflineCostModel
from sims.profiles import load_profile
from sims.sensitivity import OVERHEADS, RATES, sensitivity_entry, worse_profile
from tests.sims.test_capacity import TINY_FLEET


def test_the_worse_profile_lowers_the_rates_and_raises_the_overheads_and_nothing_else() -> None:
    base = load_profile("default")
    terms = base.terms_for("h100").model_copy(update={"host_call_s": 1e-4})
    base = base.model_copy(update={"terms": terms, "gpu_overrides": {}})
    worse = worse_profile(base, "h100")
    for term in RATES:
        before = getattr(terms, term)
        assert getattr(worse.terms, term) == (None if before is None else pytest.approx(0.8 * before)), term
    for term in OVERHEADS:
        assert getattr(worse.terms, term) == pytest.approx(1.2 * getattr(terms, term)), term
    changed = {*RATES, *OVERHEADS}
    assert {t: v for t, v in worse.terms.model_dump().items() if t not in changed} == \
        {t: v for t, v in terms.model_dump().items() if t not in changed}
    assert worse.provenance["eff_mem"].status == "estimated" and "20% worse" in worse.provenance["eff_mem"].source
    models = {"m": (Arch.model_validate(ARCHS["qwen2.5-7b"]), 1)}
    plain, slow = (RooflineCostModel.for_models(models, "h100", p) for p in (base, worse))
    assert slow.decode_step_s("m", 1, 512) > 1.2 * plain.decode_step_s("m", 1, 512) * 0.99  # bytes-bound: ~1/0.8
    assert slow.switch_s("m") == pytest.approx(plain.switch_s("m") / 0.8, rel=0.02)


def test_the_entry_puts_both_answers_side_by_side() -> None:
    entry = sensitivity_entry({"dedicated": (8, True), "token-level": (3, True)},
                              {"dedicated": (8, True), "token-level": (4, False)}, "h20")
    assert entry["policies"]["token-level"] == {"gpus": 3, "met": True, "worse_gpus": 4, "worse_met": False}
    assert entry["line"].startswith("If the memory-bandwidth efficiency, host link and per-step overhead are 20% "
                                    "worse on H20")
    assert "token-level 3 -> 4 (unmet)" in entry["line"] and "dedicated 8 -> 8" in entry["line"]


@pytest.mark.slow
def test_capacity_reports_the_answer_with_the_terms_worse(tmp_path: pathlib.Path) -> None:
    fleet = tmp_path / "tiny.yaml"
    fleet.write_text(TINY_FLEET)
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["capacity", "--fleet", str(fleet), "--duration", "60", "--workers", "0",
                                   "--what-if-tpot", "0", "--policies", "dedicated,token-level", "--out", str(out)])
    assert res.exit_code == 0, res.output
    entry = json.loads((out / "report.json").read_text())["sensitivity"]
    assert set(entry["policies"]) == {"dedicated", "token-level"} and entry["worse_by"] == 0.2
    for policy, e in entry["policies"].items():
        assert e["gpus"] >= 1 and e["worse_gpus"] >= 1, policy
    assert entry["line"] in " ".join(res.output.split())
    assert "## Sensitivity" in (out / "report.md").read_text() and "<h2>Sensitivity</h2>" in \
        (out / "report.html").read_text()
    res = CliRunner().invoke(app, ["capacity", "--fleet", str(fleet), "--duration", "60", "--workers", "0",
                                   "--what-if-tpot", "0", "--policies", "dedicated", "--no-sensitivity",
                                   "--out", str(out)])
    assert res.exit_code == 0 and json.loads((out / "report.json").read_text())["sensitivity"] is None
