"""The validation matrix's table for benchmarks/index/fidelity.json, from `modelpool validate` JSON files.

    python benchmarks/validate_index.py OUT/*.json --machine "lent H200" --command "bash benchmarks/validate_matrix.sh"

One row per (scenario, load): live / simulated and the error of each figure, in bold where it meets its
target (attainment within 3 points, TTFT/TPOT p50/p90, switches and weight copies within 15%), and the figures
that miss.
Replaces the matrix's earlier result in fidelity.json (git keeps it); then run benchmarks/render.py.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

INDEX = Path(__file__).resolve().parent / "index" / "fidelity.json"
TITLE = "Held-out validation matrix: `modelpool validate` on scenarios no term was measured on"
COLUMNS = ["scenario", "load", "req/s", "attain % live/sim (pt)", "TTFT p50 ms live/sim (err)",
           "TTFT p90 ms live/sim (err)", "TPOT p50 ms live/sim (err)", "TPOT p90 ms live/sim (err)",
           "switches live/sim (err)", "weight copies live/sim (err)", "misses"]
SHORT = {"slo_attainment": "attain", "ttft_p50_s": "TTFT p50", "ttft_p90_s": "TTFT p90", "tpot_p50_s": "TPOT p50",
         "tpot_p90_s": "TPOT p90", "switches": "switches", "weight_copies": "weight copies"}


def cell(row: dict[str, Any]) -> str:
    """`live/sim (error)`, bold when within target."""
    live, sim, error = row["live"], row["sim"], row["error"]
    if live is None or sim is None:
        return "-"
    if row["figure"] == "slo_attainment":
        text = f"{live * 100:.1f}/{sim * 100:.1f} ({error:+.1f})"
    elif row["figure"] in ("switches", "weight_copies"):
        text = f"{live}/{sim} ({_rel(error)})"
    else:
        digits = 1 if min(live, sim) < 0.1 else 0  # a TPOT of a few ms keeps its tenths
        text = f"{live * 1e3:.{digits}f}/{sim * 1e3:.{digits}f} ({_rel(error)})"
    return f"**{text}**" if row["ok"] else text


def _rel(error: float) -> str:
    return f"{error * 100:+.0f}%" if math.isfinite(error) else "inf"


def rows_of(report: dict[str, Any]) -> list[list[Any]]:
    out = []
    for load, part in report["loads"].items():
        by = {row["figure"]: row for row in part["errors"]}
        by.setdefault("weight_copies", {"figure": "weight_copies", "live": None, "sim": None})  # before session 22
        misses = ", ".join(SHORT[row["figure"]] for row in part["errors"] if not row["ok"]) or "none"
        out.append([report["scenario"], load, f"{part['rate_rps']:.2f}", *(cell(by[key]) for key in SHORT), misses])
    return out


def dump_area(area: dict[str, Any]) -> str:
    """The index file's layout: one line per key of a result, one per table row (small diffs when a result
    is replaced)."""
    dumps = lambda value: json.dumps(value, ensure_ascii=False)  # noqa: E731
    lines = ["{"] + [f" {dumps(key)}: {dumps(value)}," for key, value in area.items() if key != "results"]
    lines.append(' "results": [')
    for k, result in enumerate(area["results"]):
        lines.append("  {")
        items = list(result.items())
        for j, (key, value) in enumerate(items):
            end = "," if j < len(items) - 1 else ""
            if key == "rows":
                rows = [f"    {dumps(row)}" for row in value]
                lines += ['   "rows": [', ",\n".join(rows), f"   ]{end}"]
            else:
                lines.append(f"   {dumps(key)}: {dumps(value)}{end}")
        lines.append("  }" + ("," if k < len(area["results"]) - 1 else ""))
    return "\n".join(lines + [" ]", "}"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--machine", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--note", action="append", default=[])
    parser.add_argument("--index", type=Path, default=INDEX)
    args = parser.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.reports]
    rows = [row for report in reports for row in rows_of(report)]
    profiles = sorted({r["profile"] for r in reports})
    result = {"title": TITLE, "date": reports[0]["date"][:10], "machine": args.machine,
              "commit": reports[0]["commit"], "command": args.command, "columns": COLUMNS, "rows": rows,
              "notes": [f"Profile: {', '.join(profiles)}; nothing refitted to any scenario. Bold: within target "
                        "(attainment within 3 points; TTFT/TPOT p50/p90 and switches within 15%).",
                        *(f"{r['scenario']}: {r['description']}; knee (simulated, 90% attainment) "
                          f"{r['knee_rps']:.2f} req/s" if r.get("knee_rps") else f"{r['scenario']}: {r['description']}"
                          for r in reports), *args.note]}
    index = json.loads(args.index.read_text())
    index["results"] = [result, *(r for r in index["results"] if r["title"] != TITLE)]
    args.index.write_text(dump_area(index))
    print(f"{len(rows)} rows into {args.index}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
