"""One capacity point: a policy on one TP class of a fleet, cut into given instances, simulated.

Policies place a model only on instances of its tensor-parallel size, so a
fleet splits into independent TP classes: a class's models, its share of the
workload and its instances never meet another class's. The capacity search
therefore simulates one class at a time (`evaluate`), and the report's final
figures come from the whole pool with every class at its answer (`run_pool`).
Both run in Ray workers: their inputs (`Context`, `Point`) are plain picklable
values and so are their results.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from scheduler import InstanceSpec, make_scheduler, model_profiles
from scheduler.fleet import GB, Fleet, ModelEntry, Slo, fleet_problems
from sims.costmodel import RooflineCostModel
from sims.metrics import summarize
from sims.profiles import CalibrationProfile
from sims.run import requests_from, weight_limits, with_load_hints
from sims.simulator import RequestRecord, Simulator
from sims.workload import Workload


@dataclass(frozen=True, slots=True)
class Layout:
    """How one TP class's GPUs are cut: instances by role, or (dedicated) replicas per model."""

    tp: int
    prefill: int = 0
    decode: int = 0
    mixed: int = 0  # instances that do everything (every instance of the non-split policies)
    replicas: tuple[tuple[str, int], ...] = ()  # dedicated: (model, instances), sorted by model

    @property
    def num_instances(self) -> int:
        return self.prefill + self.decode + self.mixed + sum(n for _, n in self.replicas)

    @property
    def gpus(self) -> int:
        return self.tp * self.num_instances

    def label(self) -> str:
        if self.replicas:
            return f"{self.num_instances} x TP{self.tp} ({sum(n > 1 for _, n in self.replicas)} models replicated)"
        parts = [f"{n}{kind}" for n, kind in ((self.prefill, "P"), (self.decode, "D"), (self.mixed, "M")) if n]
        return f"TP{self.tp}: " + "+".join(parts or ["0"])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tp": self.tp, "gpus": self.gpus, "instances": self.num_instances}
        if self.replicas:
            out["replicas"] = dict(self.replicas)
        else:
            out.update(prefill=self.prefill, decode=self.decode, mixed=self.mixed)
        return out


@dataclass(frozen=True, slots=True)
class Point:
    """What one simulation evaluates: a policy on a GPU type, one class layout, an SLO scenario."""

    gpu: str
    policy: str
    layout: Layout
    slo_scale: tuple[float, float] = (1.0, 1.0)  # (TTFT, TPOT) factors on every model's SLO: what-ifs

    @property
    def tp(self) -> int:
        return self.layout.tp


@dataclass(frozen=True, slots=True)
class Outcome:
    """A point's figures, enough to steer the search and draw the attainment curves."""

    point: Point
    attainment: float  # per-request (vLLM goodput rule)
    aegaeon_attainment: float
    num_requests: int
    ttft_ok: float  # share of requests within the TTFT SLO (steers the prefill/decode split)
    tpot_ok: float
    p99_ttft_ms: float
    p99_tpot_ms: float
    gpu_busy_share: float
    per_model: tuple[tuple[str, float, float, int], ...] = ()  # (model, per-request, Aegaeon, requests)
    wall_s: float = 0.0
    error: str = ""  # the layout cannot run (the policy refused it); counts as a miss
    stopped_at: float | None = None  # simulated time the run was cut at: attainment is then an upper bound
    fatal: bool = False  # requests were refused for want of device memory: more instances like these cannot help

    def score(self, metric: str) -> float:
        return self.aegaeon_attainment if metric == "aegaeon" else self.attainment

    def model_scores(self, metric: str) -> dict[str, float]:
        return {name: (aeg if metric == "aegaeon" else std) for name, std, aeg, _ in self.per_model}


@dataclass(frozen=True, slots=True)
class ClassInfo:
    """What a search knows about a TP class before simulating it."""

    tp: int
    models: tuple[str, ...]
    num_requests: int
    prefill_load: float  # instance-seconds of prefill per second, at this TP (a lower bound on instances)
    model_prefill_load: tuple[tuple[str, float], ...] = ()  # the same per model
    decode_floor_load: float = 0.0  # instance-seconds of decode per second at best (see `decode_floor_load`)

    @property
    def floor_instances(self) -> int:
        """No policy can serve the class on fewer instances under the cost model (see `decode_floor_load`)."""
        return max(1, math.ceil(self.prefill_load + self.decode_floor_load - 1e-9))


@dataclass(frozen=True)
class Context:
    """Everything a worker needs to simulate any point: the fleet, the workload, the calibration."""

    fleet: Fleet
    workload: Workload
    profile: CalibrationProfile | None = None
    policy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per policy, scheduler options
    stop_below: float | None = None  # per-request target: stop a class run once it is sure to miss it

    @cached_property
    def class_of(self) -> dict[str, int]:
        return {m.name: m.tp for m in self.fleet.models}

    @cached_property
    def _workloads(self) -> dict[int, Workload]:
        return {tp: class_workload(self.workload, [m.name for m in self.fleet.models if m.tp == tp])
                for tp in sorted(set(self.class_of.values()))}

    def class_workload(self, tp: int) -> Workload:
        return self._workloads[tp]

    def fleet_for(self, gpu: str, tp: int | None = None, slo_scale: tuple[float, float] = (1.0, 1.0)) -> Fleet:
        """The fleet on GPU type `gpu`, only TP class `tp` (all when None), SLOs scaled."""
        models = [m for m in self.fleet.models if tp is None or m.tp == tp]
        if slo_scale != (1.0, 1.0):
            models = [_scale_slo(self.fleet, m, slo_scale) for m in models]
        pool = self.fleet.pool.model_copy(update={"gpu": gpu})
        return self.fleet.model_copy(update={"models": models, "pool": pool})

    def costs(self, gpu: str) -> RooflineCostModel:
        cache = self.__dict__.setdefault("_costs", {})
        if gpu not in cache:
            cache[gpu] = RooflineCostModel(self.fleet, gpu=gpu, profile=self.profile)
        return cache[gpu]


def gpu_problems(fleet: Fleet, gpu: str) -> list[str]:
    """Why `fleet` cannot run on GPU type `gpu` at its models' TP sizes (empty when it can)."""
    pool = fleet.pool.model_copy(update={"gpu": gpu})
    return [f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in fleet_problems(pool, fleet.gpus, list(enumerate(fleet.models)))]


def _scale_slo(fleet: Fleet, entry: ModelEntry, scale: tuple[float, float]) -> ModelEntry:
    slo = fleet.slo(entry)
    return entry.model_copy(update={"slo": Slo(ttft_s=slo.ttft_s * scale[0], tpot_s=slo.tpot_s * scale[1])})


def class_workload(workload: Workload, names: list[str]) -> Workload:
    """The requests of `names` only (same arrival times, same window)."""
    index = {name: k for k, name in enumerate(names)}
    code = np.array([index.get(name, -1) for name in workload.models], dtype=np.int64)
    mapped = code[workload.model_index] if len(workload) else np.zeros(0, dtype=np.int64)
    keep = mapped >= 0
    return Workload.from_columns(workload.arrival_s[keep], mapped[keep], workload.input_tokens[keep],
                                 workload.output_tokens[keep], names, workload.source, workload.duration_s,
                                 notes=workload.notes)


def build_instances(fleet: Fleet, layout: Layout) -> list[InstanceSpec]:
    """Instance specs for `layout` on the fleet's GPU: prefill ones first, then decode, then mixed."""
    per_gpu = fleet.gpu().memory_gb * GB * fleet.pool.gpu_memory_utilization
    roles = ["prefill"] * layout.prefill + ["decode"] * layout.decode + ["mixed"] * layout.mixed
    roles += ["mixed"] * sum(n for _, n in layout.replicas)
    return [InstanceSpec(f"tp{layout.tp}-{k}", layout.tp, per_gpu * layout.tp, role)  # type: ignore[arg-type]
            for k, role in enumerate(roles)]


@dataclass
class _Run:
    records: dict[str, RequestRecord]
    metrics: dict[str, Any]
    instances: list[InstanceSpec]
    devices: Mapping[str, Any]
    stopped: tuple[float, tuple[int, int]] | None = None  # (simulated time, (TTFT, TPOT) sure misses)


_CHECK_EVERY_S = 30.0


def _sure_misses(records: Mapping[str, RequestRecord], slo: Mapping[str, tuple[float, float]],
                 now: float) -> tuple[int, int]:
    """Requests that cannot meet the per-request SLO whatever happens after `now`: (by TTFT, by TPOT)."""
    ttft = tpot = 0
    for r in records.values():
        ttft_slo, tpot_slo = slo[r.model]
        if r.failed:
            ttft += 1
        elif r.first_token_at is None:
            ttft += now - r.arrival_at > ttft_slo
        elif r.first_token_at - r.arrival_at > ttft_slo:
            ttft += 1
        elif r.output_tokens > 1:
            end = r.finished_at if r.finished_at is not None else now
            tpot += (end - r.first_token_at) / (r.output_tokens - 1) > tpot_slo
    return ttft, tpot


def _simulate(ctx: Context, fleet: Fleet, workload: Workload, policy: str, layouts: list[Layout],
              stop_below: float | None = None) -> _Run:
    costs = ctx.costs(fleet.pool.gpu)
    profiles = with_load_hints(model_profiles(fleet), workload)
    instances = [spec for layout in layouts for spec in build_instances(fleet, layout)]
    options = dict(ctx.policy_options.get(policy, {}))
    replicas = {name: n for layout in layouts for name, n in layout.replicas}
    if policy == "dedicated":
        options["replicas"] = replicas
    scheduler = make_scheduler(policy, profiles, instances, costs, max_batch_size=fleet.pool.max_batch_size,
                               max_prefill_tokens=fleet.pool.max_prefill_tokens, **options)
    budgets, sizes = weight_limits(scheduler, profiles)
    sim = Simulator(scheduler, costs, requests_from(workload, fleet, [0]), weight_capacity=budgets, weight_bytes=sizes,
                    kv_bytes_per_token={name: p.kv_bytes_per_token for name, p in profiles.items()},
                    links=costs.host_links(instances))
    if stop_below is None:
        records = sim.run()
    else:
        slo = {name: (p.ttft_slo_s, p.tpot_slo_s) for name, p in profiles.items()}
        allowed = math.floor((1.0 - stop_below) * len(workload))
        t = 0.0
        while t < workload.duration_s:
            t += _CHECK_EVERY_S
            records = sim.run(until=t)
            misses = _sure_misses(records, slo, t)
            if misses[0] + misses[1] > allowed:
                return _Run(records, {}, instances, sim.devices, stopped=(t, misses))
        records = sim.run()
    gpus = sum(spec.tp for spec in instances)
    makespan = max(workload.duration_s, max((r.finished_at or 0.0) for r in records.values()) if records else 0.0)
    metrics = summarize(records.values(), {n: (p.ttft_slo_s, p.tpot_slo_s) for n, p in profiles.items()},
                        duration_s=workload.duration_s, devices=sim.devices, num_gpus=gpus,
                        gpus_per_instance={s.instance_id: s.tp for s in instances}, makespan_s=makespan)
    return _Run(records, metrics, instances, sim.devices)


def evaluate(ctx: Context, point: Point) -> Outcome:
    """Simulate one class layout; a layout the policy refuses is an outcome with `error` set."""
    started = time.perf_counter()
    fleet = ctx.fleet_for(point.gpu, point.tp, point.slo_scale)
    workload = ctx.class_workload(point.tp)
    if len(workload) == 0:
        return Outcome(point, 1.0, 1.0, 0, 1.0, 1.0, 0.0, 0.0, 0.0)
    try:
        stop = ctx.stop_below if point.policy != "dedicated" else None  # dedicated is judged per model: run it all
        run = _simulate(ctx, fleet, workload, point.policy, [point.layout], stop)
    except ValueError as exc:
        return Outcome(point, 0.0, 0.0, len(workload), 0.0, 0.0, 0.0, 0.0, 0.0, error=str(exc),
                       wall_s=time.perf_counter() - started)
    # token-level sizes every instance's KV room from its TP class alone (memory less two model slots), so
    # a request refused for room is refused at any instance count; spatial's room depends on the placement
    refused = next((r.failed for r in run.records.values() if "no instance" in r.failed), "")
    refused = refused if point.policy == "token-level" else ""
    error = f"requests refused: {refused}" if refused else ""
    if run.stopped is not None:
        at, (ttft_miss, tpot_miss) = run.stopped
        n = len(workload)
        return Outcome(point, 1.0 - (ttft_miss + tpot_miss) / n, math.nan, n, 1.0 - ttft_miss / n, 1.0 - tpot_miss / n,
                       math.nan, math.nan, math.nan, wall_s=time.perf_counter() - started, stopped_at=at,
                       error=error, fatal=bool(refused))
    m = run.metrics
    ok = _slo_shares(run.records, fleet)
    per_model = tuple((name, fig["slo_attainment"], fig["aegaeon_slo_attainment"], fig["num_requests"])
                      for name, fig in sorted(m["per_model"].items()))
    return Outcome(point, m["slo_attainment"], m["aegaeon_slo_attainment"], m["num_requests"], ok[0], ok[1],
                   m["p99_ttft_ms"], m["p99_tpot_ms"], m.get("gpu_busy_share", 0.0), per_model,
                   wall_s=time.perf_counter() - started, error=error, fatal=bool(refused))


def _slo_shares(records: Mapping[str, RequestRecord], fleet: Fleet) -> tuple[float, float]:
    """Shares of requests within their TTFT SLO and within their TPOT SLO (unfinished ones miss both)."""
    slo = {m.name: fleet.slo(m) for m in fleet.models}
    ttft_ok = tpot_ok = 0
    for r in records.values():
        if r.failed or r.finished_at is None or r.first_token_at is None:
            continue
        s = slo[r.model]
        ttft_ok += r.first_token_at - r.arrival_at <= s.ttft_s
        tpot_ok += r.generated <= 1 or (r.finished_at - r.first_token_at) / (r.generated - 1) <= s.tpot_s
    n = max(1, len(records))
    return ttft_ok / n, tpot_ok / n


@dataclass(frozen=True)
class PoolRun:
    """The whole pool with every class at its answer: the report's figures for one policy."""

    gpu: str
    policy: str
    layouts: tuple[Layout, ...]
    metrics: dict[str, Any]
    ttft_s: np.ndarray  # per completed request
    tpot_s: np.ndarray  # per completed request with more than one token
    instances: tuple[dict[str, Any], ...]  # per instance: id, tp, role, busy share, switches
    wall_s: float


def run_pool(ctx: Context, gpu: str, policy: str, layouts: tuple[Layout, ...],
             slo_scale: tuple[float, float] = (1.0, 1.0)) -> PoolRun:
    started = time.perf_counter()
    fleet = ctx.fleet_for(gpu, None, slo_scale)
    run = _simulate(ctx, fleet, ctx.workload, policy, list(layouts))
    ttft, tpot = [], []
    for r in run.records.values():
        if r.failed or r.finished_at is None or r.first_token_at is None:
            continue
        ttft.append(r.first_token_at - r.arrival_at)
        if r.generated > 1:
            tpot.append((r.finished_at - r.first_token_at) / (r.generated - 1))
    span = max(run.metrics["duration"], 1e-9)
    instances = []
    for spec in run.instances:
        dev = run.devices.get(spec.instance_id)
        instances.append({"instance_id": spec.instance_id, "tp": spec.tp, "role": spec.role,
                          "busy_share": round(dev.busy_s / span, 4) if dev else 0.0,
                          "num_switches": dev.num_switches if dev else 0})
    return PoolRun(gpu, policy, layouts, run.metrics, np.sort(np.array(ttft)), np.sort(np.array(tpot)),
                   tuple(instances), time.perf_counter() - started)


def class_infos(ctx: Context, gpu: str) -> dict[int, ClassInfo]:
    """Per TP class: its models, requests, prefill load and decode floor on `gpu` (the searches' lower bounds)."""
    costs = ctx.costs(gpu)
    out: dict[int, ClassInfo] = {}
    duration = max(ctx.workload.duration_s, 1e-9)
    for tp in sorted(set(ctx.class_of.values())):
        entries = [m for m in ctx.fleet.models if m.tp == tp]
        names = tuple(m.name for m in entries)
        work = ctx.class_workload(tp)
        context = {m.name: m.arch.max_context for m in entries}
        load = dict.fromkeys(names, 0.0)
        for model_index, prompt in zip(work.model_index.tolist(), work.input_tokens.tolist()):
            name = work.models[model_index]
            load[name] += costs.prefill_s(name, min(prompt, context[name]))
        per_model = tuple((name, seconds / duration) for name, seconds in load.items())
        tpot = {m.name: ctx.fleet.slo(m).tpot_s for m in entries}
        out[tp] = ClassInfo(tp, names, len(work), sum(load.values()) / duration, per_model,
                            decode_floor_load(work, costs, tpot, context) / duration)
    return out


def decode_floor_load(work: Workload, costs: RooflineCostModel, tpot_s: Mapping[str, float],
                      max_context: Mapping[str, int]) -> float:
    """Device-seconds of decode the class's requests need at the very least: every request decodes at exactly
    its TPOT SLO (the slowest pace allowed, which makes requests overlap most) and each decode step batches
    every active request of its model (the most a step can share its weight read). No switches, no KV moves,
    no queueing. Added to the prefill load and rounded up, it is a floor no policy gets under (up to the
    per-request target's allowed misses)."""
    total = 0.0
    for index, name in enumerate(work.models):
        if name not in tpot_s:
            continue
        mine = work.model_index == index
        if not mine.any():
            continue
        tpot, cap = tpot_s[name], max_context[name]
        prompt = np.minimum(work.input_tokens[mine], cap).astype(np.int64)
        output = work.output_tokens[mine].astype(np.int64)
        start = work.arrival_s[mine]
        mean_context = prompt + output // 2
        changes = sorted([(t, 1, c) for t, c in zip(start.tolist(), mean_context.tolist())]
                         + [(t, -1, c) for t, c in zip((start + output * tpot).tolist(), mean_context.tolist())])
        active = tokens = 0
        last = 0.0
        for t, sign, ctx_tokens in changes:
            if active:
                total += (t - last) / tpot * costs.decode_step_s(name, active, tokens)
            active, tokens, last = active + sign, tokens + sign * ctx_tokens, t
    return total
