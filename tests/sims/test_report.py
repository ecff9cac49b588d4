"""The capacity report: the JSON schema the issue fixes, Markdown and CSV, and an HTML page that is
self-contained (checked structurally everywhere, and rendered by headless Chromium where installed)."""

from __future__ import annotations

import base64
import csv
import html.parser
import json
import pathlib
import shutil
import subprocess

import pytest

from modelpool.capacity import write_report
from modelpool.config import parse_fleet
from sims.capacity import Goal, InlineEvaluator
from sims.capacity_eval import Context, evaluate, run_pool
from sims.capacity_study import StudyConfig, study
from sims.report import REQUIRED_POLICY_KEYS
from sims.run import fleet_workload_spec
from sims.traces import load_workload
from tests.sims.test_capacity import TINY_FLEET

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict]:
    fleet = parse_fleet(TINY_FLEET, "tiny.yaml")
    workload = load_workload(fleet_workload_spec(fleet, 60), [m.name for m in fleet.models], seed=0)
    ctx = Context(fleet, workload, stop_below=0.99)
    config = StudyConfig(("dedicated", "request-level", "spatial", "token-level"), ("h20", "h100"), Goal(0.99))
    result = study(ctx, config, InlineEvaluator(lambda p: evaluate(ctx, p)), lambda jobs: [run_pool(ctx, *j) for j in jobs])
    out = tmp_path_factory.mktemp("report")
    write_report(result, ctx, out, fleet_path="tiny.yaml", trace="fleet", seed=0, command="test")
    return out, json.loads((out / "report.json").read_text())


def test_json_has_the_required_schema(written: tuple[pathlib.Path, dict]) -> None:
    _, report = written
    assert report["slo_target"] == 0.99 and report["slo_metric"] == "per-request"
    assert isinstance(report["dedicated_gpus"], int) and report["dedicated_gpus"] == 3
    assert set(report["policies"]) == {"dedicated", "request-level", "spatial", "token-level"}
    for name, entry in report["policies"].items():
        assert set(REQUIRED_POLICY_KEYS) <= set(entry), name
        assert isinstance(entry["gpus"], int) and entry["gpus"] >= 1
        assert 0.0 <= entry["attainment"] <= 1.0
        assert entry["p99_ttft_ms"] > 0 and entry["p99_tpot_ms"] > 0
        assert entry["models_per_gpu"] == pytest.approx(3 / entry["gpus"], abs=1e-3)
        assert entry["usd_per_month"] == pytest.approx(entry["gpus"] * 1.8 * 730)  # H20 price x hours a month
    assert report["headline"]["dedicated_gpus"] == report["dedicated_gpus"]


def test_json_carries_everything_the_report_shows(written: tuple[pathlib.Path, dict]) -> None:
    _, report = written
    assert {r["model"] for r in report["per_model"]} == {"small-a", "small-b", "small-c"}
    row = report["per_model"][0]
    assert {"rate_rps", "mean_prompt_tokens", "mean_output_tokens", "dedicated_gpus", "token-level"} <= set(row)
    assert {"p99_ttft_ms", "p99_tpot_ms"} <= set(row["token-level"])
    tl = report["policies"]["token-level"]
    assert tl["output_tokens_per_s"] > 0 and tl["per_user_output_tokens_per_s"] > 0  # pool vs one stream
    assert 0 < tl["gpu_busy_share"] <= 1 and tl["switches_per_gpu_per_minute"] >= 0
    assert report["curves"] and all(c["gpus"] >= 1 for c in report["curves"])
    assert set(report["gpu_types"]) == {"h20", "h100"}
    assert set(report["gpu_types"]["h100"]["policies"]) == set(report["policies"])
    statuses = {a["status"] for a in report["assumptions"]}
    assert {"measured", "estimated", "input"} <= statuses
    assert any("eff_compute" in a["what"] and a["status"] == "estimated" for a in report["assumptions"])  # not an H20
    profile_row = next(a for a in report["assumptions"] if a["what"] == "cost model profile on H20")
    assert profile_row["status"] == "estimated" and "profile default" in profile_row["value"]
    assert "measured on h20: none" in profile_row["value"]
    assert "estimated from datasheet ratios (efficiencies measured on h200): eff_compute" in profile_row["value"]
    mem = next(a for a in report["assumptions"] if a["what"] == "cost model: eff_mem")
    assert "on h20 estimated from datasheet ratios" in mem["source"]
    assert report["tries"] and report["what_if"][0]["tpot_slo_factor"] == 2.0


def test_the_floor_is_under_every_answer_and_in_the_text(written: tuple[pathlib.Path, dict]) -> None:
    out, report = written
    floor = report["floor"]
    assert floor["gpus"] == sum(c["gpus"] for c in floor["classes"].values()) >= 1
    for policy, entry in report["policies"].items():
        if entry["met"]:  # a floor above something the simulator achieved would be wrong
            assert entry["gpus"] >= floor["gpus"], policy
    assert floor["classes"]["1"]["decode_load"] > 0 and floor["classes"]["1"]["prefill_load"] > 0
    assert f"Floor: {floor['gpus']} H20s" in (out / "report.md").read_text()


def test_decode_floor_batches_every_active_request_at_slo_pace() -> None:
    import numpy as np

    from sims.capacity_eval import decode_floor_load
    from sims.workload import Workload
    from tests.factories import LinearCosts

    costs = LinearCosts(step_s=0.01, per_token_s=0.0)
    # two requests of m0: [0, 1) and [0.5, 1.5) at 0.1 s per token; m1 gets none
    work = Workload(np.array([0.0, 0.5]), np.array([0, 0], dtype=np.int32), np.array([100, 100], dtype=np.int32),
                    np.array([10, 10], dtype=np.int32), ("m0", "m1"), "test", 2.0)
    steps = decode_floor_load(work, costs, {"m0": 0.1, "m1": 0.1}, {"m0": 4096, "m1": 4096})
    assert steps == pytest.approx(15 * costs.decode_step_s("m0", 1, 0))  # 5 + 5 (shared) + 5 steps


def test_markdown_and_csv(written: tuple[pathlib.Path, dict]) -> None:
    out, report = written
    text = (out / "report.md").read_text()
    assert report["headline"]["sentence"] in text and "## Policies" in text and "## Assumptions" in text
    assert "## GPU types" in text and "## Per model" in text
    with (out / "capacity.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["gpu"], r["policy"]) for r in rows} == {(g, p) for g in ("h20", "h100") for p in report["policies"]}
    with (out / "curves.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(report["curves"])


class _Resources(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.refs: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "srcset", "data", "poster", "action") and value:
                self.refs.append((tag, name, value))


def test_html_is_self_contained(written: tuple[pathlib.Path, dict]) -> None:
    out, report = written
    page = (out / "report.html").read_text()
    parser = _Resources()
    parser.feed(page)
    assert not {"script", "link", "iframe", "object", "embed"} & set(parser.tags)
    assert "@import" not in page and "url(" not in page
    images = [value for tag, name, value in parser.refs if tag == "img"]
    assert len(images) >= 4 and len(images) == len(parser.refs)  # nothing but inline images refers anywhere
    for value in images:
        assert value.startswith("data:image/png;base64,")
        assert base64.b64decode(value.split(",", 1)[1]).startswith(PNG)
    assert report["headline"]["sentence"] in page.replace("&gt;", ">")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium on this machine (apt-get install chromium)")
def test_html_opens_in_headless_chromium(written: tuple[pathlib.Path, dict], tmp_path: pathlib.Path) -> None:
    out, report = written
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          f"--user-data-dir={tmp_path}", "--dump-dom", (out / "report.html").resolve().as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Capacity report: 3 models on H20" in dom.stdout
    assert dom.stdout.count("data:image/png;base64,") >= 4
