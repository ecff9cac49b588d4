"""How long one scheduling decision takes: schedule() (+ the on_event calls feeding it)
with ~64 running requests over 10 models, for each policy.

    python benchmarks/schedule_cost.py [--out benchmarks/out/schedule_cost.json]

Target (issue 2): <= 100 microseconds per decision on the 2-core dev machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import InstanceSpec, ModelProfile, Request, make_scheduler  # noqa: E402
from sims.simulator import Simulator  # noqa: E402
from tests.factories import LinearCosts  # noqa: E402

SETUPS = {
    "dedicated": ["mixed"] * 10,
    "request-level": ["mixed"] * 8,
    "spatial": ["mixed"] * 4,
    "token-level": ["prefill"] * 3 + ["decode"] * 5,
}


class Timed:
    """Wraps a scheduler and times each call (the simulator calls it exactly as the pool would)."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.schedule_ns: list[int] = []
        self.event_ns = 0
        self.running: list[int] = []

    def submit(self, request, now):
        self.inner.submit(request, now)

    def on_event(self, event, now):
        t = time.perf_counter_ns()
        self.inner.on_event(event, now)
        self.event_ns += time.perf_counter_ns() - t

    def schedule(self, now):
        t = time.perf_counter_ns()
        plan = self.inner.schedule(now)
        self.schedule_ns.append(time.perf_counter_ns() - t)
        self.running.append(sum(1 for r in self.inner.requests.values() if r.status.value in ("running", "swapped")))
        return plan


def run(policy: str, num_requests: int, seed: int) -> dict:
    models = {f"m{i}": ModelProfile(f"m{i}", 1, 14e9, 57344, 32768, 10.0, 0.1, 0.5) for i in range(10)}
    instances = [InstanceSpec(f"i{k}", 1, 80e9, role) for k, role in enumerate(SETUPS[policy])]  # type: ignore[arg-type]
    costs = LinearCosts(step_s=0.02, switch_s=0.3)
    rng = random.Random(seed)
    t, requests = 0.0, []
    for k in range(num_requests):  # ~64 in flight: rate * mean service time
        t += rng.expovariate(4.0)
        requests.append(Request(f"r{k}", f"m{rng.randrange(10)}", t, rng.randint(50, 1500), rng.randint(200, 600)))
    timed = Timed(make_scheduler(policy, models, instances, costs))
    sim = Simulator(timed, costs, requests, kv_bytes_per_token={m: 57344 for m in models})
    sim.run()
    ns = timed.schedule_ns
    decisions = len(ns)
    per_decision_us = (sum(ns) + timed.event_ns) / decisions / 1000
    return {
        "policy": policy, "decisions": decisions, "mean_running": statistics.mean(timed.running),
        "max_running": max(timed.running), "schedule_p50_us": statistics.median(ns) / 1000,
        "schedule_p99_us": sorted(ns)[int(0.99 * decisions)] / 1000,
        "per_decision_us_incl_events": per_decision_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/schedule_cost.json"))
    args = parser.parse_args()
    rows = [run(policy, args.requests, args.seed) for policy in SETUPS]
    print(f"{'policy':14} {'decisions':>9} {'running mean/max':>17} {'p50 us':>8} {'p99 us':>8} {'mean us (+events)':>18}")
    for r in rows:
        print(f"{r['policy']:14} {r['decisions']:9d} {r['mean_running']:8.1f}/{r['max_running']:<8d} "
              f"{r['schedule_p50_us']:8.1f} {r['schedule_p99_us']:8.1f} {r['per_decision_us_incl_events']:18.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": date.today().isoformat(), "machine": platform.node(),
                                    "python": platform.python_version(), "command": " ".join(sys.argv),
                                    "target_us": 100, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
