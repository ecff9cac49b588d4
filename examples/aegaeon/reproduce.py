"""Reproduce Aegaeon's own evaluation (SOSP'25, section 7) in the simulator: how many models 16 H800s sustain.

Setup (the paper's): 16 H800 GPUs; M models in a 6:2:2 mix of Qwen2.5-7B, Yi-1.5-9B and
Llama-2-13B; each model has Poisson arrivals at 0.1 req/s with ShareGPT lengths; SLO TTFT 10 s
and TPOT 100 ms, and the 0.5x SLO (5 s / 50 ms). For each policy the script finds the largest M
whose attainment meets 90% under Aegaeon's metric and 99% under the per-request one, searching M
the way `modelpool capacity` searches GPUs (bracket x2, bisect to 2 models, verify the two counts
above the answer, since attainment is not monotone). Every simulation is a Ray task.

Instances on the 16 GPUs: dedicated, one model per GPU (so at most 16 models); request-level and
spatial, 16 instances; "token-level 6P+10D", the artifact's 3 prefill + 5 decode per 8-GPU node;
"token-level", the best of 2, 3, 4 or 6 prefill instances (the rest decode) at each model count, as
`modelpool capacity` chooses the split (on H800 prefill is cheap, so the artifact's split starves decode).

    python examples/aegaeon/reproduce.py                    # ~10-20 min on 2 cores; writes results/
    python examples/aegaeon/reproduce.py --workers 8 --duration 600
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from modelpool.config import load_fleet  # noqa: E402
from scheduler.fleet import Fleet, Slo  # noqa: E402
from sims.capacity import InlineEvaluator, run_searches  # noqa: E402

POLICIES = ("dedicated", "request-level", "spatial", "token-level 6P+10D", "token-level")
SPLITS = (2, 3, 4, 6)  # prefill instances token-level tries (the rest decode); the artifact's is 6 of 16
TARGETS = (("aegaeon", 0.90), ("per-request", 0.99))
SLO_SCALES = (1.0, 0.5)
MIX = (("qwen2.5-7b", 0.6), ("yi-1.5-9b", 0.2), ("llama-2-13b", 0.2))
RATE_RPS = 0.1


@dataclass(frozen=True, slots=True)
class Trial:
    """One simulation: a policy serving `models` models on the 16 GPUs, SLOs scaled by `slo_scale`."""

    policy: str
    models: int
    slo_scale: float


@dataclass(frozen=True, slots=True)
class TrialOutcome:
    point: Trial
    per_request: float
    aegaeon: float
    p99_ttft_ms: float
    p99_tpot_ms: float
    wall_s: float
    error: str = ""
    splits: str = ""  # token-level: the prefill/decode split behind each figure

    def score(self, metric: str) -> float:
        return self.aegaeon if metric == "aegaeon" else self.per_request


def scaled_fleet(base: Fleet, num_models: int, slo_scale: float) -> Fleet:
    """`num_models` models in the 6:2:2 mix, each at 0.1 req/s, SLOs times `slo_scale`."""
    counts = [round(num_models * share) for _, share in MIX[:-1]]
    counts.append(num_models - sum(counts))
    template = {m.arch_name: m for m in base.models}
    slo = base.pool.default_slo
    models = [template[arch].model_copy(update={"name": f"{arch}-{k}",
                                                "slo": Slo(ttft_s=slo.ttft_s * slo_scale, tpot_s=slo.tpot_s * slo_scale)})
              for (arch, _), count in zip(MIX, counts) for k in range(count)]
    return base.model_copy(update={"models": models})


def run_trial(base: Fleet, trial: Trial, duration_s: float, seed: int) -> TrialOutcome:
    from sims.capacity_eval import Context, Layout, Point, evaluate
    from sims.run import fleet_workload_spec
    from sims.traces import load_workload

    started = time.perf_counter()
    fleet = scaled_fleet(base, trial.models, trial.slo_scale)
    names = [m.name for m in fleet.models]
    workload = load_workload(fleet_workload_spec(fleet, duration_s), names, seed=seed)
    gpus = fleet.pool.num_gpus
    ctx = Context(fleet, workload)
    if trial.policy == "dedicated":
        if trial.models > gpus:
            return TrialOutcome(trial, 0.0, 0.0, math.nan, math.nan, 0.0, f"{trial.models} models > {gpus} GPUs")
        layouts = [Layout(1, replicas=tuple(sorted((n, 1) for n in names)))]
    elif trial.policy.startswith("token-level"):
        artifact = round(gpus * fleet.pool.prefill_fraction)
        splits = (artifact,) if trial.policy != "token-level" else SPLITS
        layouts = [Layout(1, prefill=p, decode=gpus - p) for p in splits]
    else:
        layouts = [Layout(1, mixed=gpus)]
    outcomes = [evaluate(ctx, Point(fleet.pool.gpu, trial.policy.split()[0], layout)) for layout in layouts]
    best_std = max(outcomes, key=lambda o: o.attainment)
    best_aeg = max(outcomes, key=lambda o: o.aegaeon_attainment)
    splits_text = ""
    if trial.policy.startswith("token-level"):
        splits_text = (f"per-request best at {best_std.point.layout.prefill}P, "
                       f"Aegaeon best at {best_aeg.point.layout.prefill}P")
    return TrialOutcome(trial, best_std.attainment, best_aeg.aegaeon_attainment, best_std.p99_ttft_ms,
                        best_std.p99_tpot_ms, time.perf_counter() - started, best_std.error, splits_text)


def most_models(policy: str, slo_scale: float, metric: str, target: float, notes: list[str],
                first: int = 8, cap: int = 512, window: int = 2, step: int = 2) -> Generator[
                    list[Trial], Mapping[Trial, TrialOutcome], int]:
    """The largest model count (a multiple of `step`) that meets the target: double, bisect, verify above."""
    known: dict[int, bool] = {}

    def passes(m: int) -> Generator[list[Trial], Mapping[Trial, TrialOutcome], bool]:
        if m not in known:
            trial = Trial(policy, m, slo_scale)
            outcome = (yield [trial])[trial]
            known[m] = not outcome.error and outcome.score(metric) >= target
        return known[m]

    m, last_pass = first, 0
    while (yield from passes(m)):
        last_pass = m
        if m >= cap:
            return m
        m = min(cap, m * 2)
    if last_pass == 0:
        return 0 if not (yield from passes(step)) else step  # fewer than `first`
    low, high = last_pass, m  # low passes, high fails
    while high - low > step:
        mid = (low + high) // 2 // step * step
        if (yield from passes(mid)):
            low = mid
        else:
            high = mid
    while True:  # verify: a larger count may pass although one between them failed
        higher = None
        for above in range(low + 2 * step, low + (window + 2) * step, step):
            if above <= cap and (yield from passes(above)):
                higher = above
        if higher is None:
            return low
        notes.append(f"{policy} {metric} @ {slo_scale}x SLO: {higher} models pass although {low + step} did not")
        low = higher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=Path, default=HERE / "models.yaml")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of traffic per simulation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="local Ray workers (0: in this process)")
    parser.add_argument("--address", default=None, help="an existing Ray cluster")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    base = load_fleet(args.fleet)
    policies = [p for p in POLICIES if p in args.policies.split(",")]
    if not policies:
        parser.error(f"--policies: choose from {', '.join(POLICIES)}")
    notes: list[str] = []
    searches = {(p, s, metric): most_models(p, s, metric, target, notes, cap=16 if p == "dedicated" else 512)
                for p in policies for s in SLO_SCALES for metric, target in TARGETS}
    started = time.perf_counter()
    if args.workers == 0:
        evaluator: Any = InlineEvaluator(lambda t: _log(run_trial(base, t, args.duration, args.seed)))
        answers, stats = run_searches(searches, evaluator)  # type: ignore[arg-type]
    else:
        import ray

        env = {"env_vars": {"OMP_NUM_THREADS": "1"}}  # Ray's token auth stays on (see README, Security)
        if args.address:
            ray.init(address=args.address, log_to_driver=False, runtime_env=env)
        else:
            ray.init(num_cpus=args.workers or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                     runtime_env=env, _node_ip_address="127.0.0.1")
        answers, stats = run_searches(searches, _RayTrials(ray, base, args.duration, args.seed))  # type: ignore[arg-type]
        ray.shutdown()
    wall = time.perf_counter() - started
    write_results(args.out, answers, base, args, notes, stats.evaluated, wall)


def _log(outcome: TrialOutcome) -> TrialOutcome:
    t = outcome.point
    print(f"  {t.policy:13s} {t.models:4d} models {t.slo_scale:g}x SLO: per-request {outcome.per_request:.3f} "
          f"Aegaeon {outcome.aegaeon:.3f} ({outcome.wall_s:.1f} s) {outcome.splits} {outcome.error}", flush=True)
    return outcome


class _RayTrials:
    def __init__(self, ray: Any, base: Fleet, duration: float, seed: int) -> None:
        self.ray, self.pending = ray, {}
        self.task = ray.remote(num_cpus=1)(run_trial)
        self.base, self.duration, self.seed = ray.put(base), duration, seed

    def submit(self, trial: Trial) -> None:
        self.pending[self.task.remote(self.base, trial, self.duration, self.seed)] = trial

    def wait(self) -> list[TrialOutcome]:
        ready, _ = self.ray.wait(list(self.pending), num_returns=1)
        self.pending.pop(ready[0])
        return [_log(self.ray.get(ready[0]))]


def write_results(out: Path, answers: Mapping[Any, Any], base: Fleet, args: argparse.Namespace, notes: list[str],
                  simulations: int, wall_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    gpus = base.pool.num_gpus
    rows = [{"policy": p, "slo_scale": s, "metric": metric, "target": target, "models": answers[(p, s, metric)],
             "models_per_gpu": round(answers[(p, s, metric)] / gpus, 2)}
            for p in POLICIES for s in SLO_SCALES for metric, target in TARGETS if (p, s, metric) in answers]
    (out / "models_sustained.json").write_text(json.dumps(
        {"gpus": gpus, "gpu": base.pool.gpu, "rate_rps_per_model": RATE_RPS, "mix": dict(MIX), "duration_s": args.duration,
         "seed": args.seed, "simulations": simulations, "wall_s": round(wall_s, 1), "rows": rows, "notes": notes}, indent=2))
    lines = [f"| policy | {' | '.join(f'{m} {t:.0%}, {s:g}x SLO' for s in SLO_SCALES for m, t in TARGETS)} |",
             "|---|" + "---|" * (len(SLO_SCALES) * len(TARGETS))]
    for p in POLICIES:
        cells = []
        for s in SLO_SCALES:
            for metric, _ in TARGETS:
                n = answers.get((p, s, metric))
                cells.append("-" if n is None else f"{n} ({n / gpus:.1f}/GPU)")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (out / "models_sustained.md").write_text(table + "\n")
    print(table)
    print(f"{simulations} simulations, {wall_s:.0f} s; wrote {out / 'models_sustained.json'}")
    for note in notes:
        print("note:", note)


if __name__ == "__main__":
    main()
