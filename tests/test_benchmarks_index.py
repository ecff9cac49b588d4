"""BENCHMARKS.md is generated from benchmarks/index/*.json by benchmarks/render.py: nobody edits it by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import render  # noqa: E402


def test_benchmarks_md_is_what_the_index_renders() -> None:
    assert (ROOT / "BENCHMARKS.md").read_text() == render.render(), \
        "BENCHMARKS.md differs from benchmarks/index: run python benchmarks/render.py"
    assert render.main(["--check"]) == 0


def test_every_result_names_date_machine_commit_and_command() -> None:
    areas = [render.load_area(p) for p in sorted((ROOT / "benchmarks" / "index").glob("*.json"))]
    assert len(areas) >= 7 and all(area["results"] for area in areas)
    for area in areas:
        for result in area["results"]:
            assert all(str(result[k]).strip() for k in ("date", "machine", "commit", "command")), result["title"]


def _area(tmp_path: Path, result: dict) -> Path:
    base = {"title": "t", "date": "2026-12-06", "machine": "m", "commit": "abc1234", "command": "c",
            "columns": ["a", "b"], "rows": [[1, 2]]}
    (tmp_path / "x.json").write_text(json.dumps({"title": "X", "order": 1, "summary": "s",
                                                 "results": [{**base, **result}]}))
    return tmp_path


def test_render_names_the_file_and_field_of_a_bad_result(tmp_path: Path) -> None:
    assert "| 1 | 2 |" in render.render(_area(tmp_path, {}))
    with pytest.raises(ValueError, match=r"x\.json: results\[0\]: missing or empty field 'commit'"):
        render.render(_area(tmp_path, {"commit": ""}))
    with pytest.raises(ValueError, match=r"x\.json: results\[0\]\.rows\[0\]: 3 cells for 2 columns"):
        render.render(_area(tmp_path, {"rows": [[1, 2, 3]]}))
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ValueError, match=r"x\.json: not JSON \(line 1"):
        render.render(tmp_path)


def test_raw_results_stay_out_of_git() -> None:
    """Benchmark outputs go to benchmarks/out/ (ignored); the tracked tree stays small enough to ship (a GPU run
    carries it, 64 MiB at most) and to clone in seconds."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    names = [n for n in out.stdout.split("\0") if n and (ROOT / n).is_file()]
    assert not [n for n in names if n.startswith(("benchmarks/results/", "benchmarks/out/"))]
    total = sum((ROOT / n).stat().st_size for n in names)
    biggest = sorted(names, key=lambda n: (ROOT / n).stat().st_size)[-3:]
    assert total < 5_000_000, f"{total:,} bytes tracked; the largest: {biggest}"
    check = subprocess.run(["git", "check-ignore", "-q", "benchmarks/out/x.json"], cwd=ROOT)
    assert check.returncode == 0, "benchmarks/out/ must be ignored"
