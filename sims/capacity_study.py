"""A capacity study: every policy's search on every GPU type, what-ifs, and the final pool runs.

`study` drives the per-class searches (`sims.capacity`) over one evaluator,
sums each policy's classes into a pool answer, and runs the whole pool once
per policy at its answer (on the first GPU type) for the report's latency
distributions, per-model figures and utilisation. Where the work runs (Ray
tasks or this process) is the caller's choice: it passes the evaluator and a
function that runs a list of pool configurations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sims.capacity import POLICY_ORDER, ClassAnswer, Evaluator, Goal, Search, SearchStats, make_search, run_searches
from sims.capacity_eval import ClassInfo, Context, Layout, Outcome, Point, PoolRun, class_infos, gpu_problems

Scale = tuple[float, float]
NO_SCALE: Scale = (1.0, 1.0)
PoolJob = tuple[str, str, tuple[Layout, ...], Scale]  # gpu, policy, layouts, SLO scale


@dataclass(frozen=True)
class StudyConfig:
    policies: tuple[str, ...]
    gpus: tuple[str, ...]  # the first is the fleet's (the report's main figures)
    goal: Goal
    what_if_tpot: float | None = 2.0  # token-level again with every TPOT SLO times this (first GPU type); None: skip


@dataclass
class PoolAnswer:
    """One policy on one GPU type (and SLO scenario): its classes' answers summed."""

    gpu: str
    policy: str
    slo_scale: Scale
    classes: dict[int, ClassAnswer]

    @property
    def gpus(self) -> int:
        return sum(a.layout.gpus for a in self.classes.values())

    @property
    def met(self) -> bool:
        return all(a.met for a in self.classes.values())

    @property
    def layouts(self) -> tuple[Layout, ...]:
        return tuple(self.classes[tp].layout for tp in sorted(self.classes))

    def attainment(self, metric: str) -> float:
        """Request-weighted over the classes (classes are independent, so this is the pool's figure)."""
        total = sum(a.outcome.num_requests for a in self.classes.values() if a.outcome)
        if not total:
            return 1.0
        return sum(a.outcome.score(metric) * a.outcome.num_requests for a in self.classes.values() if a.outcome) / total

    @property
    def notes(self) -> list[str]:
        return [f"TP{tp}: {note}" for tp, a in sorted(self.classes.items()) for note in a.notes]


@dataclass
class StudyResult:
    config: StudyConfig
    infos: dict[str, dict[int, ClassInfo]]  # gpu -> tp -> class
    answers: dict[tuple[str, str, Scale], PoolAnswer]  # (gpu, policy, slo scale)
    pool_runs: dict[str, PoolRun]  # policy -> run on the first GPU type
    outcomes: dict[Point, Outcome]  # every point simulated
    stats: SearchStats
    skipped_gpus: dict[str, list[str]] = field(default_factory=dict)  # GPU type -> why the fleet cannot run there
    search_wall_s: float = 0.0
    pool_wall_s: float = 0.0

    @property
    def gpu(self) -> str:
        return self.config.gpus[0]

    def answer(self, policy: str, gpu: str | None = None, slo_scale: Scale = NO_SCALE) -> PoolAnswer | None:
        return self.answers.get((gpu or self.gpu, policy, slo_scale))


def study(ctx: Context, config: StudyConfig, evaluator: Evaluator,
          run_pools: Callable[[Sequence[PoolJob]], list[PoolRun]],
          on_progress: Callable[[SearchStats, Mapping[object, ClassAnswer]], None] | None = None) -> StudyResult:
    policies = tuple(p for p in POLICY_ORDER if p in config.policies)
    infos: dict[str, dict[int, ClassInfo]] = {}
    skipped: dict[str, list[str]] = {}
    searches: dict[tuple[str, str, Scale, int], Search] = {}
    for gpu in config.gpus:
        problems = gpu_problems(ctx.fleet, gpu)
        if problems:
            skipped[gpu] = problems
            continue
        infos[gpu] = class_infos(ctx, gpu)
        for policy in policies:
            for tp, info in infos[gpu].items():
                searches[(gpu, policy, NO_SCALE, tp)] = make_search(policy, info, config.goal, gpu)
    primary = config.gpus[0]
    if primary not in infos:
        raise ValueError(f"the fleet cannot run on {primary}: {'; '.join(skipped[primary])}")
    what_if: Scale | None = (1.0, config.what_if_tpot) if config.what_if_tpot and "token-level" in policies else None
    if what_if:
        for tp, info in infos[primary].items():
            searches[(primary, "token-level", what_if, tp)] = make_search("token-level", info, config.goal, primary, what_if)
    cache: dict[Point, Outcome] = {}
    started = time.perf_counter()
    found: dict[tuple[str, str, Scale, int], ClassAnswer]
    found, stats = run_searches(searches, evaluator, on_progress, cache)
    search_wall = time.perf_counter() - started
    answers: dict[tuple[str, str, Scale], PoolAnswer] = {}
    for (gpu, policy, scale, tp), answer in found.items():
        pool = answers.setdefault((gpu, policy, scale), PoolAnswer(gpu, policy, scale, {}))
        pool.classes[tp] = answer
    started = time.perf_counter()
    jobs: list[PoolJob] = [(primary, p, answers[(primary, p, NO_SCALE)].layouts, NO_SCALE) for p in policies]
    runs = run_pools(jobs)
    return StudyResult(config, infos, answers, {job[1]: run for job, run in zip(jobs, runs)}, cache, stats, skipped,
                       search_wall, time.perf_counter() - started)
