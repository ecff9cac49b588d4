"""How long a workload gives a stable capacity answer: GPUs per policy across seeds and durations.

`modelpool capacity` sizes a pool on one draw of arrivals. With a short
duration, many models get a handful of requests and one unlucky request
moves the answer (issue 38). This runs the same search as the command
(sims.capacity_study, in this process) on the fleet's own traffic hints for
every duration and seed, and prints each policy's GPUs, the spread across
seeds, and how many models get fewer requests than a one-miss margin at the
target (`sims.report.min_requests_to_judge`).

    python benchmarks/capacity_stability.py                       # shipped fleet, 120/300/600 s, seeds 0-2
    python benchmarks/capacity_stability.py --durations 60 --seeds 2 --fleet tiny.yaml   # a quick look

The final whole-pool runs of the command (latency figures for the report)
are skipped: only the search's answers are compared. One process; on a
shared 2-core machine the default takes tens of minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modelpool.config import load_fleet  # noqa: E402
from sims.capacity import Goal, InlineEvaluator  # noqa: E402
from sims.capacity_eval import Context, evaluate  # noqa: E402
from sims.capacity_study import StudyConfig, study  # noqa: E402
from sims.profiles import load_profile  # noqa: E402
from sims.report import min_requests_to_judge  # noqa: E402
from sims.run import fleet_workload_spec  # noqa: E402
from sims.traces import load_workload  # noqa: E402


def answers(fleet_path: Path, duration_s: float, seed: int, policies: tuple[str, ...], target: float) -> dict:
    """One search: each policy's GPUs (and whether it met the target), the models too thin to judge, wall time."""
    fleet = load_fleet(fleet_path)
    names = [m.name for m in fleet.models]
    workload = load_workload(fleet_workload_spec(fleet, duration_s), names, seed=seed)
    ctx = Context(fleet, workload, load_profile("default"), stop_below=target)
    config = StudyConfig(policies, (fleet.pool.gpu.lower(),), Goal(target), None)
    started = time.perf_counter()
    result = study(ctx, config, InlineEvaluator(lambda point: evaluate(ctx, point)), lambda jobs: [None] * len(jobs))
    few = sum(count < min_requests_to_judge(target) for count in workload.model_counts().values())
    return {"duration_s": duration_s, "seed": seed, "requests": len(workload), "models": len(names), "few": few,
            "gpus": {p: result.answer(p).gpus for p in policies}, "met": {p: result.answer(p).met for p in policies},
            "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=Path, default=ROOT / "models.yaml")
    parser.add_argument("--durations", default="120,300,600", help="seconds of traffic, comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per duration")
    parser.add_argument("--policies", default="token-level,dedicated")
    parser.add_argument("--slo-target", type=float, default=0.99)
    parser.add_argument("--json", type=Path, default=None, help="also write every row here (benchmarks/out/...)")
    args = parser.parse_args()
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    durations = [float(d) for d in args.durations.split(",")]
    rows = []
    header = f"{'duration s':>10} {'seed':>4} {'requests':>8} {'models <' + str(min_requests_to_judge(args.slo_target)) + ' req':>14} " \
             + " ".join(f"{p:>14}" for p in policies) + f" {'wall s':>7}"
    print(header, flush=True)
    for duration_s in durations:
        for seed in range(args.seeds):
            row = answers(args.fleet, duration_s, seed, policies, args.slo_target)
            rows.append(row)
            cells = " ".join(f"{str(row['gpus'][p]) + ('' if row['met'][p] else '*'):>14}" for p in policies)
            print(f"{duration_s:>10g} {seed:>4} {row['requests']:>8} {str(row['few']) + '/' + str(row['models']):>14} "
                  f"{cells} {row['wall_s']:>7}", flush=True)
    print("\nGPUs across seeds (min-max; * = target not met under that seed):")
    print(f"{'duration s':>10} " + " ".join(f"{p:>14}" for p in policies))
    for duration_s in durations:
        mine = [r for r in rows if r["duration_s"] == duration_s]
        spans = []
        for p in policies:
            gpus = [r["gpus"][p] for r in mine]
            spans.append(f"{min(gpus)}" if min(gpus) == max(gpus) else f"{min(gpus)}-{max(gpus)}")
        print(f"{duration_s:>10g} " + " ".join(f"{s:>14}" for s in spans))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
