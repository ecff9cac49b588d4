"""benchmarks/published_figures.py: runs, writes its JSON, and every row names its source (not how good the ratios are)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

from scheduler.fleet import GPUS
from sims.profiles import BASES, TERM_NAMES, shipped

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "published_figures.py"


def _load():
    spec = importlib.util.spec_from_file_location("published_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_published_figures_writes_one_sourced_row_per_figure(tmp_path, capsys):
    module = _load()
    out = tmp_path / "published.json"
    module.main(["--out", str(out)])
    result = json.loads(out.read_text())
    assert {"date", "command", "gpus", "summary", "rows"} <= set(result)
    rows = result["rows"]
    assert len(rows) == len(module.ROWS) >= 10 and result["summary"]["rows"] == len(rows)
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["source"].startswith("https://"), r["id"]
        assert r["gpu"] in GPUS and r["gpu"] in result["gpus"]
        assert r["quantity"] in ("tpot", "ttft", "e2e", "switch") and r["mode"] in ("cuda-graphs", "eager")
        assert r["profile"] in shipped() and r["profile"] == module.PROFILE_FOR_MODE[r["mode"]]
        for key in ("published_s", "predicted_s", "ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["id"], key)
        assert r["ratio"] == r["predicted_s"] / r["published_s"]
        assert set(r["terms"]) == set(BASES) and sorted(sum(r["terms"].values(), [])) == sorted(TERM_NAMES)
    assert {"h20", "h100", "a100-80gb"} <= {r["gpu"] for r in rows}  # GPUs we cannot run
    assert {"cuda-graphs", "eager"} == {r["mode"] for r in rows}
    assert "pred/pub" in capsys.readouterr().out
