"""What token-level's turn floor (`min_turn_tpot`) changes: SLO results, latencies and simulator work.

The shipped 47-model fleet's own traffic (as benchmarks/sim_speed.py builds
it) under token-level, at each pool size, with the floor off (0: the quota
formula alone) and on (1 TPOT SLO period, the default). Prints a table and
writes JSON.

    OMP_NUM_THREADS=1 python benchmarks/turn_floor.py [--requests 20000] [--gpus 24,32] [--floors 0,1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modelpool.config import load_fleet  # noqa: E402
from sims.run import fleet_workload_spec, simulate  # noqa: E402
from sims.traces import load_workload  # noqa: E402

COLUMNS = [("gpus", "GPUs"), ("min_turn_tpot", "floor"), ("slo_attainment", "SLO (per-request)"),
           ("aegaeon_slo_attainment", "SLO (Aegaeon)"), ("mean_tpot_ms", "mean TPOT ms"), ("p99_tpot_ms", "p99 TPOT ms"),
           ("p99_itl_ms", "p99 ITL ms"), ("p99_ttft_ms", "p99 TTFT ms"), ("num_switches", "switches"),
           ("events_per_request", "events/req"), ("loop_cpu_s", "loop CPU s")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--gpus", default="24,32", help="pool sizes, comma separated")
    parser.add_argument("--floors", default="0,1", help="min_turn_tpot values, comma separated")
    parser.add_argument("--fleet", default=str(ROOT / "models.yaml"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "turn_floor.json"))
    args = parser.parse_args()

    fleet = load_fleet(Path(args.fleet))
    total_rate = sum(m.traffic.rate_rps for m in fleet.models if m.traffic)
    workload = load_workload(fleet_workload_spec(fleet, args.requests / total_rate), [m.name for m in fleet.models],
                             seed=0)
    rows = []
    for gpus in (int(g) for g in args.gpus.split(",")):
        for floor in (float(f) for f in args.floors.split(",")):
            result = simulate(fleet, workload, "token-level", num_gpus=gpus, min_turn_tpot=floor)
            m = result.metrics
            rows.append({"gpus": gpus, "min_turn_tpot": floor, "requests": len(workload),
                         **{key: m[key] for key, _ in COLUMNS if key in m},
                         "events_per_request": result.num_events / len(workload), "plans": result.num_plans,
                         "loop_cpu_s": result.sim_cpu_s})
            row = rows[-1]
            print(" | ".join(f"{label} {_fmt(row.get(key))}" for key, label in COLUMNS), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "machine": platform.platform(), "python": platform.python_version(),
        "command": " ".join(sys.argv), "requests": len(workload), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if value < 1.5 else f"{value:.1f}"
    return str(value)


if __name__ == "__main__":
    main()
