"""How fast the simulator replays the shipped 47-model fleet under a policy (issue 3, item 6).

For each size the workload is the fleet's own traffic (Poisson at every model's
rate hint, ShareGPT lengths; 10 req/s in all) over as many seconds as give
that many requests, on a pool large enough to keep the policy stable. Each size
runs in a child process pinned to one core (numpy single-threaded), so its
peak RSS is its own. Reported: simulated requests/s (requests / wall time of
the event loop, and including metrics), decode iterations/s (sum of StepDone
num_steps over decode events: a closed-form turn of n steps counts n),
events and plans, and the run's SLO attainment as a sanity check. Rates are
given per wall second and per CPU second of the event loop: on a shared
machine the CPU figure is the steadier one. `compiled` says whether the
run used the mypyc build (setup.py). `--compare-compiled` builds it in a
temporary copy of the tree and runs every size with both builds, one after
the other, and prints the ratio: on a shared machine, quote ratios measured
side by side (`--repeat N` alternates the builds N times and takes the ratio
of the median CPU times).

    OMP_NUM_THREADS=1 python benchmarks/sim_speed.py [--sizes 10000,100000,1000000] [--gpus 32]
        [--compare-compiled [--repeat 3]]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one(size: int, gpus: int, policy: str, fleet_path: str) -> dict[str, object]:
    """Run one size in this process and return its figures."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from modelpool.config import load_fleet
    from sims.run import compiled, fleet_workload_spec, simulate
    from sims.traces import load_workload

    fleet = load_fleet(Path(fleet_path))
    total_rate = sum(m.traffic.rate_rps for m in fleet.models if m.traffic)
    started = time.perf_counter()
    workload = load_workload(fleet_workload_spec(fleet, size / total_rate), [m.name for m in fleet.models], seed=0)
    load_s = time.perf_counter() - started
    result = simulate(fleet, workload, policy, num_gpus=gpus)
    m = result.metrics
    num = len(workload)
    return {
        "requests": num, "traffic_s": round(workload.duration_s, 1), "policy": policy, "num_gpus": result.num_gpus,
        "compiled": compiled(),
        "workload_s": round(load_s, 3), "sim_s": round(result.sim_wall_s, 3), "sim_cpu_s": round(result.sim_cpu_s, 3),
        "metrics_s": round(result.metrics_wall_s, 3),
        "requests_per_s": round(num / result.sim_wall_s, 1), "requests_per_cpu_s": round(num / result.sim_cpu_s, 1),
        "requests_per_s_with_metrics": round(num / (result.sim_wall_s + result.metrics_wall_s), 1),
        "decode_steps": result.num_decode_steps,
        "decode_steps_per_s": round(result.num_decode_steps / result.sim_wall_s, 1),
        "decode_steps_per_cpu_s": round(result.num_decode_steps / result.sim_cpu_s, 1),
        "events": result.num_events, "plans": result.num_plans,
        "events_per_request": round(result.num_events / num, 2),
        "output_tokens": m["total_output_tokens"], "completed": m["completed"], "failed": m["failed"],
        "slo_attainment": round(m["slo_attainment"], 4), "aegaeon_slo_attainment": round(m["aegaeon_slo_attainment"], 4),
        "gpu_busy_share": round(m.get("gpu_busy_share", 0.0), 4),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="request counts, comma separated")
    parser.add_argument("--gpus", type=int, default=32, help="pool size (the shipped fleet is stable from ~24)")
    parser.add_argument("--policy", default="token-level", help="policies, comma separated")
    parser.add_argument("--fleet", default=str(ROOT / "models.yaml"))
    parser.add_argument("--out", help="JSON report (default benchmarks/out/sim_speed.json, "
                                          "benchmarks/out/sim_speed_compiled.json with --compare-compiled)")
    parser.add_argument("--compare-compiled", action="store_true",
                        help="build the mypyc modules in a temporary copy of the tree; run each size with both builds")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each size (and build)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one size, print JSON
    parser.add_argument("--tree", help=argparse.SUPPRESS)  # internal: import the packages from this tree
    args = parser.parse_args()
    if args.one:
        if args.tree:
            sys.path.insert(0, args.tree)
        print(json.dumps(one(args.one, args.gpus, args.policy, args.fleet)))
        return
    out_path = args.out or str(ROOT / "benchmarks/out" /
                               ("sim_speed_compiled.json" if args.compare_compiled else "sim_speed.json"))
    commit = _commit()  # before anything else: the build takes a minute, the report lands under benchmarks/
    with tempfile.TemporaryDirectory(prefix="sim_speed-") as tmp:
        trees = [str(ROOT)]
        if args.compare_compiled:
            print("building the mypyc modules (about a minute) ...", flush=True)
            trees.append(str(runpy.run_path(str(ROOT / "setup.py"))["compiled_copy"](Path(tmp))))
        _measure(args, trees, out_path, commit)


def _measure(args: argparse.Namespace, trees: list[str], out_path: str, commit: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    rows = []
    header = (f"{'policy':>13} {'compiled':>8} {'requests':>9} {'loop wall s':>11} {'loop CPU s':>10} {'req/s':>7} "
              f"{'req/CPU s':>9} {'+metrics req/s':>14} {'steps/CPU s':>11} {'events/req':>10} {'SLO':>6} {'peak GiB':>8}")
    print(header)
    for policy, size in [(p, int(s)) for p in args.policy.split(",") for s in args.sizes.split(",")]:
        runs: list[list[dict[str, Any]]] = [[] for _ in trees]  # per tree
        for _, (k, tree) in itertools.product(range(args.repeat), enumerate(trees)):
            out = subprocess.run([sys.executable, __file__, "--one", str(size), "--gpus", str(args.gpus),
                                  "--policy", policy, "--fleet", args.fleet, "--tree", tree],
                                 cwd=ROOT, env=env, capture_output=True, text=True)  # cwd: finds ../shared/traces
            if out.returncode:
                sys.exit(f"{policy} at {size} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs[k].append(row)
            rows.append(row)
            _write(out_path, rows, commit)  # after every row: a later failure keeps what was measured
            print(f"{policy:>13} {'yes' if row['compiled'] else 'no':>8} {row['requests']:>9,} {row['sim_s']:>11.1f} "
                  f"{row['sim_cpu_s']:>10.1f} {row['requests_per_s']:>7,.0f} {row['requests_per_cpu_s']:>9,.0f} "
                  f"{row['requests_per_s_with_metrics']:>14,.0f} {row['decode_steps_per_cpu_s']:>11,.0f} "
                  f"{row['events_per_request']:>10.1f} {row['slo_attainment']:>6.1%} {row['peak_rss_gib']:>8.2f}",
                  flush=True)
        if len(trees) == 2:
            pure, compiled = runs
            if len({(r["events"], r["output_tokens"]) for r in pure + compiled}) > 1:
                sys.exit(f"{policy} at {size}: the compiled build simulated something else")
            cpu, wall = (statistics.median(r[key] for r in pure) / statistics.median(r[key] for r in compiled)
                         for key in ("sim_cpu_s", "sim_s"))
            compiled[-1]["cpu_speedup"] = round(cpu, 2)  # the medians' ratio, on the last compiled row
            _write(out_path, rows, commit)
            print(f"{'':>13} the compiled build: {cpu:.2f}x faster (median loop CPU s), {wall:.2f}x (wall s)", flush=True)
    print(f"wrote {out_path}")


def _write(path: str, rows: list[dict[str, object]], commit: str) -> None:
    report = {"date": datetime.date.today().isoformat(), "machine": _machine(), "commit": commit,
              "command": "OMP_NUM_THREADS=1 python benchmarks/sim_speed.py " + " ".join(sys.argv[1:]),
              "one_core": hasattr(os, "sched_setaffinity"), "rows": rows}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
