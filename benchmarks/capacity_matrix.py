"""The capacity scenario matrix: fewest GPUs per policy and the floor, over fleets x arrival processes.

Each cell is one `modelpool capacity` study (the same search, in process) of a fleet under one arrival process,
with real length distributions (ShareGPT pairs, or the production trace's own tokens), at a fixed total rate:

    fleets    shipped (47 models, 1.5B-72B on H20), small (12 x 0.5B-1B: many small), large (two 7B and a 4B:
              few large), mixed (llama / qwen2 / qwen3 shapes, 1B-4B) - the scenario fleets of sims.scenarios
    arrivals  poisson (per model), onoff (per-model bursts of ~4 s, ~8 s silences), azure-conv (a production
              trace's timings, rate-scaled; needs `modelpool traces fetch azure-conv` or $MODELPOOL_TRACES)

It prints one table: GPUs per policy, the floor no policy gets under (prefill load + the best-batched decode
load, sims.capacity_eval.ClassInfo.floor_instances) and whether token-level needs no more than every other
policy (of those run: `--policies token-level` runs that column alone, to recheck it after a policy
change against the others' recorded columns). `--json PATH` writes the rows. CPU-heavy: `--duration 120`
while iterating; the recorded run uses 300 s.

    PYTHONPATH=. python benchmarks/capacity_matrix.py --duration 300 --json benchmarks/out/capacity_matrix.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sims.capacity import Goal, InlineEvaluator  # noqa: E402
from sims.capacity_eval import Context, class_infos, evaluate, run_pool  # noqa: E402
from sims.capacity_study import StudyConfig, study  # noqa: E402
from sims.scenarios import FLEETS, Arrivals, Scenario, shipped_fleet  # noqa: E402

POLICIES = ("dedicated", "request-level", "spatial", "token-level")
# fleet -> (GPU type, total req/s): each fleet at a load that needs a few GPUs pooled
FLEET_LOADS = {"shipped": ("h20", 0.0), "small": ("h100", 40.0), "large": ("h100", 12.0), "mixed": ("h100", 20.0)}
ARRIVALS = {"poisson": Arrivals("poisson"), "onoff": Arrivals("onoff", on_s=4.0, off_s=8.0),
            "azure-conv": Arrivals("trace", trace="azure-conv", start_s=600.0)}


def fleet_of(name: str, gpu: str):  # noqa: ANN201 - a scheduler.fleet.Fleet
    if name == "shipped":
        return shipped_fleet()
    return FLEETS[name].fleet(gpu, num_gpus=8)


def cell(fleet_name: str, arrivals: str, duration_s: float, seed: int, target: float,
         policies: tuple[str, ...] = POLICIES) -> dict:
    gpu, rate = FLEET_LOADS[fleet_name]
    fleet = fleet_of(fleet_name, gpu)
    if rate == 0.0:  # the shipped fleet at its own traffic hints
        rate = sum(m.traffic.rate_rps for m in fleet.models if m.traffic)
    lengths = "trace" if ARRIVALS[arrivals].process == "trace" else "sharegpt"
    scenario = Scenario(f"{fleet_name}-{arrivals}", fleet_name, ARRIVALS[arrivals], lengths)
    workload = scenario.workload(rate, duration_s, seed)
    goal = Goal(target)
    ctx = Context(fleet, workload, None, stop_below=target)
    started = time.perf_counter()
    result = study(ctx, StudyConfig(policies, (gpu,), goal, None), InlineEvaluator(lambda p: evaluate(ctx, p)),
                   lambda jobs: [run_pool(ctx, *job) for job in jobs])
    floor = sum(info.floor_instances * info.tp for info in class_infos(ctx, gpu).values())
    row = {"fleet": fleet_name, "arrivals": arrivals, "gpu": gpu, "rate_rps": round(rate, 3),
           "requests": len(workload), "floor": floor, "wall_s": round(time.perf_counter() - started, 1)}
    for policy in policies:
        answer = result.answer(policy)
        row[policy] = answer.gpus if answer is not None and answer.met else None
        if answer is not None and answer.met and policy == "token-level":
            row["token-level layout"] = " ".join(layout.label() for layout in answer.layouts)
    if "token-level" in policies:
        others = [row[p] for p in policies if p != "token-level" and row[p] is not None]
        row["token-level <= others"] = row["token-level"] is not None and all(row["token-level"] <= n for n in others)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of workload per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.99, help="per-request SLO attainment target")
    parser.add_argument("--fleets", default=",".join(FLEET_LOADS))
    parser.add_argument("--arrivals", default=",".join(ARRIVALS))
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated; one policy's column alone (e.g. token-level after a policy change)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    policies = tuple(p for p in POLICIES if p in args.policies.split(","))
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown or not policies:
        parser.error(f"--policies: unknown {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    tl = "token-level" in policies
    rows = []
    header = f"{'fleet':8} {'arrivals':11} {'GPU':5} {'req/s':>6} " + " ".join(f"{p:>13}" for p in policies) + \
        f" {'floor':>6}" + (f" {'TL/floor':>8}  TL<=all" if tl else "")
    print(header)
    for fleet_name in args.fleets.split(","):
        for arrivals in args.arrivals.split(","):
            try:
                row = cell(fleet_name, arrivals, args.duration, args.seed, args.target, policies)
            except Exception as exc:  # noqa: BLE001 - a missing trace file skips its cells, named
                print(f"{fleet_name:8} {arrivals:11} skipped: {exc}")
                continue
            rows.append(row)
            line = f"{fleet_name:8} {arrivals:11} {row['gpu']:5} {row['rate_rps']:6.1f} " \
                + " ".join(f"{row[p] if row[p] is not None else 'unmet':>13}" for p in policies) + f" {row['floor']:6d}"
            if tl:
                ratio = row["token-level"] / row["floor"] if row["token-level"] else math.nan
                line += f" {ratio:8.2f}  {'yes' if row['token-level <= others'] else 'NO'}"
            print(line, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"duration_s": args.duration, "seed": args.seed, "target": args.target,
                                         "policies": list(policies), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
