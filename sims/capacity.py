"""Capacity search: per policy and TP class, the fewest GPUs whose simulated SLO attainment meets a target.

Each search is a generator: it yields the points it needs next (see
`sims.capacity_eval.Point`) and is sent their outcomes, so one driver can
interleave every (GPU type, policy, TP class) search and keep a pool of
workers busy (`run_searches`; Ray in `modelpool.capacity`, in-process in tests).

- Pooled policies (request-level, spatial, token-level): attainment is not
  monotone in GPUs (a bigger pool re-routes and re-batches), so the count of
  instances is *bracketed* upwards from a load lower bound (x1.5 a step),
  *bisected*, then *verified*: the `window` counts just below the answer are
  simulated too, and a passing one becomes the answer (noted as
  non-monotone) and is verified in turn. A class passes when its attainment
  (per-request or Aegaeon's, over all its requests) meets the target. A run
  whose requests were refused for want of device memory ends the search:
  more instances of the same size cannot help (e.g. token-level's two model
  slots of a 72B model leave no KV room on 4 x H100).
- token-level also chooses the prefill/decode split at each count: it starts
  from the split that keeps prefill ~75% busy (or the last split that
  passed) and, on a miss, moves one instance toward the side whose SLO missed
  more (TTFT -> prefill, TPOT -> decode); all-"mixed" layouts are tried for
  counts up to 4 (first for 1-2 instances, after the splits for 3-4).
- dedicated: every model needs its own attainment to meet the target ("each
  model enough instances for its own peak load, at least one"). Models never
  share instances, so one simulation of a class scores every model: models
  below target get one more instance and the class is run again; then every
  replicated model gives one back at once and keeps it back if it still passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from sims.capacity_eval import ClassInfo, Layout, Outcome, Point

Search = Generator[list[Point], Mapping[Point, Outcome], "ClassAnswer"]
Check = Generator[list[Point], Mapping[Point, Outcome], bool]
METRICS = ("per-request", "aegaeon")
POLICY_ORDER = ("dedicated", "request-level", "spatial", "token-level")
PREFILL_BUSY = 0.75  # target prefill utilisation of token-level's first split guess
MIXED_UP_TO = 4  # token-level tries all-"mixed" layouts up to this many instances


@dataclass(frozen=True, slots=True)
class Goal:
    target: float
    metric: str = "per-request"  # or "aegaeon"
    window: int = 2  # counts below an answer that are simulated to verify it
    max_instances: int = 256  # per class; beyond it the target is reported unmet

    def passes(self, outcome: Outcome) -> bool:
        return not outcome.error and outcome.score(self.metric) >= self.target


@dataclass
class ClassAnswer:
    """A search's result for one TP class; `layout` is the best found even when the target was not met."""

    gpu: str
    policy: str
    tp: int
    layout: Layout
    outcome: Outcome | None
    met: bool
    tried: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _ask(point: Point, seen: list[Outcome]) -> Generator[list[Point], Mapping[Point, Outcome], Outcome]:
    results = yield [point]
    outcome = results[point]
    seen.append(outcome)
    return outcome


class _Hopeless(Exception):
    """A layout failed in a way more instances of the same kind cannot fix (requests refused for memory)."""


def _fewest(check: Callable[[int], Check], lo: int, goal: Goal, notes: list[str]) -> Generator[
        list[Point], Mapping[Point, Outcome], int | None]:
    """The fewest instances n >= lo for which check(n) passes: bracket, bisect, verify below.
    None when the count hits `goal.max_instances` or a check raises `_Hopeless`."""
    try:
        return (yield from _bracket_bisect_verify(check, lo, goal, notes))
    except _Hopeless as why:
        notes.append(f"stopped: {why}")
        return None


def _bracket_bisect_verify(check: Callable[[int], Check], lo: int, goal: Goal, notes: list[str]) -> Generator[
        list[Point], Mapping[Point, Outcome], int | None]:
    known: dict[int, bool] = {}

    def passes(n: int) -> Check:
        if n not in known:
            known[n] = yield from check(n)
        return known[n]

    n, last_fail = lo, lo - 1
    while not (yield from passes(n)):
        last_fail = n
        if n >= goal.max_instances:
            return None
        n = min(goal.max_instances, max(n + 1, math.ceil(n * 1.5)))
    hi = n
    while hi - last_fail > 1:
        mid = (last_fail + hi) // 2
        if (yield from passes(mid)):
            hi = mid
        else:
            last_fail = mid
    while True:  # verify: a count below the answer may pass although one between them failed
        lower = None
        for below in range(hi - 1, max(lo, hi - goal.window) - 1, -1):
            if (yield from passes(below)):
                lower = below
        if lower is None:
            return hi
        failed = [k for k in range(lower + 1, hi) if known.get(k) is False]
        notes.append(f"attainment is not monotone here: {lower} instances meet the target, "
                     f"{', '.join(map(str, failed)) or 'a count between'} did not")
        hi = lower


def _hopeless(outcome: Outcome) -> Outcome:
    if outcome.fatal:
        raise _Hopeless(outcome.error)
    return outcome


def search_pooled(info: ClassInfo, goal: Goal, gpu: str, policy: str,
                  slo_scale: tuple[float, float] = (1.0, 1.0)) -> Search:
    """request-level and spatial: the fewest instances of the class's TP size."""
    seen: list[Outcome] = []
    notes: list[str] = []

    def point(n: int) -> Point:
        return Point(gpu, policy, Layout(info.tp, mixed=n), slo_scale)

    def check(n: int) -> Check:
        return goal.passes(_hopeless((yield from _ask(point(n), seen))))

    lo = max(1, math.ceil(info.prefill_load))
    best = yield from _fewest(check, lo, goal, notes)
    return _answer(gpu, policy, info.tp, seen, goal, None if best is None else point(best), notes)


def search_token_level(info: ClassInfo, goal: Goal, gpu: str, slo_scale: tuple[float, float] = (1.0, 1.0)) -> Search:
    """The fewest instances, each count tried with a prefill/decode split steered by what missed."""
    seen: list[Outcome] = []
    notes: list[str] = []
    hint = [max(1, math.ceil(info.prefill_load / PREFILL_BUSY))]  # prefill instances; the last split that passed

    def point(prefill: int, decode: int, mixed: int = 0) -> Point:
        return Point(gpu, "token-level", Layout(info.tp, prefill, decode, mixed), slo_scale)

    def check(n: int) -> Check:
        if n <= 2 and goal.passes(_hopeless((yield from _ask(point(0, 0, n), seen)))):  # small: mixed first
            return True
        prefill, tried = min(max(1, hint[0]), n - 1), set[int]()
        while n > 1 and prefill not in tried and len(tried) < 3:
            tried.add(prefill)
            outcome = _hopeless((yield from _ask(point(prefill, n - prefill), seen)))
            if goal.passes(outcome):
                hint[0] = prefill
                return True
            more_prefill = (1 - outcome.ttft_ok) > (1 - outcome.tpot_ok)
            prefill = min(n - 1, prefill + 1) if more_prefill else max(1, prefill - 1)
        return 3 <= n <= MIXED_UP_TO and goal.passes(_hopeless((yield from _ask(point(0, 0, n), seen))))

    lo = max(1, math.ceil(info.prefill_load))
    count = yield from _fewest(check, lo, goal, notes)
    best = None
    if count is not None:
        best = min((o.point for o in seen if o.point.layout.num_instances == count and goal.passes(o)),
                   key=lambda p: (p.layout.mixed == 0, p.layout.prefill))
    return _answer(gpu, "token-level", info.tp, seen, goal, best, notes)


def search_dedicated(info: ClassInfo, goal: Goal, gpu: str, slo_scale: tuple[float, float] = (1.0, 1.0),
                     max_rounds: int = 8) -> Search:
    """Per model, the fewest instances that meet the target on its own traffic (at least one)."""
    seen: list[Outcome] = []
    notes: list[str] = []
    load = dict(info.model_prefill_load)
    replicas = {m: max(1, math.ceil(load.get(m, 0.0) / 0.85)) for m in info.models}
    stuck: set[str] = set()

    def point(reps: Mapping[str, int]) -> Point:
        return Point(gpu, "dedicated", Layout(info.tp, replicas=tuple(sorted(reps.items()))), slo_scale)

    def scores_of(outcome: Outcome) -> dict[str, float]:
        scores = outcome.model_scores(goal.metric)
        unknown = 0.0 if outcome.error or outcome.stopped_at is not None else 1.0  # a model without requests passes
        return {m: scores.get(m, unknown) for m in info.models}

    outcome = yield from _ask(point(replicas), seen)
    for _ in range(max_rounds - 1):
        scores = scores_of(outcome)
        grow = [m for m in info.models if scores[m] < goal.target and m not in stuck]
        if not grow:
            break
        for m in grow:
            replicas[m] += 1
        previous, outcome = scores, (yield from _ask(point(replicas), seen))
        for m in grow:
            if scores_of(outcome)[m] <= previous[m] + 1e-3:
                stuck.add(m)
                replicas[m] -= 1  # the extra instance did not help; it keeps the ones it had
                notes.append(f"{m}: {previous[m]:.1%} of its requests meet the SLO with {replicas[m]} instance(s); "
                             f"one more did not help")
        if any(m in stuck for m in grow):
            outcome = yield from _ask(point(replicas), seen)
    # give back one instance of every replicated model at once; keep it back where the model still passes
    fewer = {m: n - 1 if n > 1 else n for m, n in replicas.items()}
    if fewer != replicas:
        trial = yield from _ask(point(fewer), seen)
        ok = scores_of(trial)
        kept = {m: fewer[m] if ok[m] >= goal.target else replicas[m] for m in replicas}
        if kept == fewer:
            replicas, outcome = kept, trial
        elif kept != replicas:
            replicas, outcome = kept, (yield from _ask(point(kept), seen))
    met = not outcome.error and all(v >= goal.target for v in scores_of(outcome).values())
    if not met and not notes:
        notes.append(f"target {goal.target:.1%} not met for every model after {max_rounds} rounds")
    return ClassAnswer(gpu, "dedicated", info.tp, outcome.point.layout, outcome, met, seen, notes)


def _answer(gpu: str, policy: str, tp: int, seen: list[Outcome], goal: Goal, best: Point | None,
            notes: list[str]) -> ClassAnswer:
    if best is not None:
        outcome = next(o for o in seen if o.point == best)
        return ClassAnswer(gpu, policy, tp, best.layout, outcome, True, seen, notes)
    top = max(seen, key=lambda o: (o.score(goal.metric), -o.point.layout.gpus)) if seen else None
    if not any(note.startswith("stopped:") for note in notes):
        notes.append(f"target {goal.target:.1%} not met with up to {goal.max_instances} TP{tp} instances")
    layout = top.point.layout if top else Layout(tp)
    return ClassAnswer(gpu, policy, tp, layout, top, False, seen, notes)


def make_search(policy: str, info: ClassInfo, goal: Goal, gpu: str,
                slo_scale: tuple[float, float] = (1.0, 1.0)) -> Search:
    if policy == "dedicated":
        return search_dedicated(info, goal, gpu, slo_scale)
    if policy == "token-level":
        return search_token_level(info, goal, gpu, slo_scale)
    if policy in ("request-level", "spatial"):
        return search_pooled(info, goal, gpu, policy, slo_scale)
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICY_ORDER)}")


# ---- driving many searches over one pool of workers ------------------------------------------------------

class Evaluator(Protocol):
    """Runs points somewhere (in-process, Ray workers); `wait` returns at least one finished outcome."""

    def submit(self, point: Point) -> None: ...

    def wait(self) -> list[Outcome]: ...


class InlineEvaluator:
    """Evaluates each point in this process when waited for (tests, `--workers 0`)."""

    def __init__(self, evaluate: Callable[[Point], Outcome]) -> None:
        self.evaluate = evaluate
        self.pending: list[Point] = []

    def submit(self, point: Point) -> None:
        self.pending.append(point)

    def wait(self) -> list[Outcome]:
        return [self.evaluate(self.pending.pop(0))] if self.pending else []


@dataclass
class SearchStats:
    evaluated: int = 0
    requested: int = 0  # points the searches asked for, counting repeats
    submitted: int = 0

    @property
    def reused(self) -> int:
        """Asks served without a new simulation (another search or a verify step had it)."""
        return self.requested - self.submitted


def run_searches(searches: Mapping[Any, Search], evaluator: Evaluator,
                 on_progress: Callable[[SearchStats, Mapping[object, ClassAnswer]], None] | None = None,
                 cache: dict[Point, Outcome] | None = None) -> tuple[dict[Any, ClassAnswer], SearchStats]:
    """Drive every search to its answer, evaluating each distinct point once."""
    cache = {} if cache is None else cache
    stats = SearchStats()
    answers: dict[Any, ClassAnswer] = {}
    needs: dict[Any, list[Point]] = {}
    inflight: set[Point] = set()
    for key, search in searches.items():
        needs[key] = next(search)
        stats.requested += len(needs[key])
    while needs:
        for key in list(needs):
            while key in needs and all(p in cache for p in needs[key]):
                try:
                    needs[key] = searches[key].send({p: cache[p] for p in needs[key]})
                except StopIteration as done:
                    answers[key] = done.value
                    del needs[key]
                else:
                    stats.requested += len(needs[key])
        for point in dict.fromkeys(p for points in needs.values() for p in points):
            if point not in cache and point not in inflight:
                evaluator.submit(point)
                inflight.add(point)
                stats.submitted += 1
        if on_progress:
            on_progress(stats, answers)
        if not needs:
            break
        finished = evaluator.wait()
        if not finished:
            raise RuntimeError("evaluator returned nothing while points are pending")
        for outcome in finished:
            cache[outcome.point] = outcome
            inflight.discard(outcome.point)
            stats.evaluated += 1
    if on_progress:
        on_progress(stats, answers)
    return answers, stats
