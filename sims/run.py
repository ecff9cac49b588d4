"""One simulation: a fleet, a workload, a policy and a GPU count in; records and metrics out.

This is where the fleet becomes the scheduler's view (profiles, instances),
the workload becomes `Request`s, and the cost model is shared by the
scheduler (to predict step times) and the executor (to time them).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from scheduler import InstanceSpec, ModelProfile, Request, make_instances, make_scheduler, model_profiles
from scheduler.fleet import Fleet
from scheduler.instance import staging_instances
from sims.costmodel import RooflineCostModel
from sims.links import gpus_of
from sims.metrics import summarize
from sims.simulator import RequestRecord, Simulator
from sims.workload import Workload, request_id


@dataclass
class SimResult:
    policy: str
    num_gpus: int
    instances: list[InstanceSpec]
    records: dict[str, RequestRecord]
    metrics: dict[str, Any]
    num_truncated: int = 0
    notes: list[str] = field(default_factory=list)
    num_plans: int = 0
    num_events: int = 0
    num_decode_steps: int = 0  # decode iterations run (a turn of n steps counts n)
    sim_wall_s: float = 0.0  # the event loop
    sim_cpu_s: float = 0.0  # the event loop's CPU time (steadier than wall time on a shared machine)
    metrics_wall_s: float = 0.0  # summarize()
    # each instance's time as the simulator spent it, every instance of the layout: busy, decode steps delivered and
    # their seconds, switches and their seconds, KV bytes moved (a live run's engine calls are the other side:
    # gpu_pool_sim.py)
    per_instance: dict[str, dict[str, float]] = field(default_factory=dict)
    # each instance's switches by model: the seconds each one held the instance (a prefetched model's, what was
    # left of its copy) - the live side: gpu_pool_calls.switch_times
    switches_by_model: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # each instance's decode steps by model and batch size: how many, their seconds (the live side: the engine's
    # decode_by_model timings, gpu_pool.py's decode_timings_by_model)
    decode_by_shape: dict[str, dict[tuple[str, int], list[float]]] = field(default_factory=dict)


def compiled() -> bool:
    """Whether the simulator runs from the opt-in mypyc build (setup.py), ~6x faster under token-level
    (6.4-6.9x: BENCHMARKS.md, "Simulator speed")."""
    import sims.simulator

    return sims.simulator.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def fleet_workload_spec(fleet: Fleet, duration_s: float = 600.0, lengths: str = "sharegpt") -> str:
    """The default workload: Poisson arrivals at each model's traffic hint, ShareGPT lengths."""
    rates = ":".join(f"{(m.traffic.rate_rps if m.traffic else 0.0):.6g}" for m in fleet.models)
    return f"poisson;rate={rates};lengths={lengths};duration={duration_s:g}"


def min_gpus(fleet: Fleet, policy: str) -> int:
    """The fewest GPUs `make_instances` can cut for `policy`: one instance per model (dedicated), two per TP class
    (token-level: a prefill and a decode instance), else one per TP class."""
    if policy == "dedicated":
        return sum(m.tp for m in fleet.models)
    return sum(tp * (2 if policy == "token-level" else 1) for tp in {m.tp for m in fleet.models})


def pool_size(fleet: Fleet, policy: str, num_gpus: int | None) -> tuple[int, str | None]:
    """GPUs to simulate and, when the fleet's pool.num_gpus is too small for the policy, a note saying so.

    A count given explicitly is kept as it is (too small, the simulation's error names what it needs).
    """
    if num_gpus is not None:
        return num_gpus, None
    need = min_gpus(fleet, policy)
    if need <= fleet.pool.num_gpus:
        return fleet.pool.num_gpus, None
    what = "one instance per model" if policy == "dedicated" else "its smallest layout"
    return need, (f"{policy} needs {need} GPUs for {what}; the fleet's pool.num_gpus is {fleet.pool.num_gpus}: "
                  f"simulating {need} (--gpus N to choose; `modelpool capacity` finds the count that meets the SLO)")


def build_instances(fleet: Fleet, policy: str, num_gpus: int | None = None,
                    prefill_fraction: float | None = None, gpus_by_tp: dict[int, int] | None = None) -> list[InstanceSpec]:
    return make_instances(fleet, num_gpus, split=policy == "token-level", prefill_fraction=prefill_fraction,
                          gpus_by_tp=gpus_by_tp, per_model=policy == "dedicated")


def with_load_hints(profiles: Mapping[str, ModelProfile], workload: Workload) -> dict[str, ModelProfile]:
    """The profiles with the workload's own load per model (rate, mean prompt and output tokens): what a policy
    that plans its memory from the expected load (token-level) plans with when the workload is known."""
    duration = max(workload.duration_s, 1e-9)
    out = dict(profiles)
    index = workload.model_index
    for k, name in enumerate(workload.models):
        if name not in out:
            continue
        mine = index == k
        count = int(mine.sum())
        if count:
            out[name] = dataclasses.replace(out[name], load_rps=count / duration,
                                            mean_prompt_tokens=float(workload.input_tokens[mine].mean()),
                                            mean_output_tokens=float(workload.output_tokens[mine].mean()))
    return out


def weight_limits(scheduler: object, profiles: Mapping[str, ModelProfile]) -> tuple[dict[str, float] | None,
                                                                                   dict[str, float]]:
    """Per instance, the weight budget the policy planned (None when it plans none), and each model's bytes:
    the simulator refuses a Switch or Prefetch whose held weights exceed it."""
    budgets = getattr(scheduler, "weight_budgets", None)
    return (dict(budgets) if budgets else None), {name: p.weight_bytes for name, p in profiles.items()}


def requests_from(workload: Workload, fleet: Fleet, counter: list[int]) -> Iterator[Request]:
    """Trace rows as scheduler requests; prompts that overflow a model's context are truncated (counted)."""
    context = {m.name: m.arch.max_context for m in fleet.models}
    names = workload.models
    limits = [context.get(name) for name in names]
    columns = zip(workload.arrival_s.tolist(), workload.model_index.tolist(),
                  workload.input_tokens.tolist(), workload.output_tokens.tolist())
    for row, (arrival_at, index, prompt, output) in enumerate(columns):  # the columns, not TraceRequest rows: 1M rows
        limit = limits[index]
        if limit is not None and prompt + output > limit:
            counter[0] += 1
            output = min(output, limit // 2)
            prompt = max(1, limit - output)
        yield Request(request_id(row), names[index], arrival_at, prompt, output)


def simulate(fleet: Fleet, workload: Workload, policy: str, *, num_gpus: int | None = None,
             prefill_fraction: float | None = None, gpus_by_tp: dict[int, int] | None = None,
             costs: RooflineCostModel | None = None, plan_log: IO[str] | None = None,
             progress: Callable[[float], None] | None = None, instances: list[InstanceSpec] | None = None,
             gpu_of: Mapping[str, int] | None = None, plan_costs: RooflineCostModel | None = None,
             shared_weights: bool = False, **options: Any) -> SimResult:
    """`instances` replaces the cut of the fleet's GPUs (a live pool's layout), and `gpu_of` places
    instances on GPUs by index (instances on one GPU share its host link, sims.links, and its compute,
    sims.gpu_share). `plan_costs`: what the scheduler plans with where it is not what the steps cost (`costs`) -
    a live pool that served with one profile, replayed with one fitted to it since (default: `costs`).
    `shared_weights`: the instances of a GPU map one weights region (`modelpool serve`'s torch engines where every
    model fits once: modelpool.gpu_memory): a model copied in by one is on the device for the others."""
    costs = costs or RooflineCostModel(fleet)
    profiles = with_load_hints(model_profiles(fleet), workload)
    instances = instances or build_instances(fleet, policy, num_gpus, prefill_fraction, gpus_by_tp)
    # like the live pool, the scheduler forgets requests once they end (same plans; the records keep what happened):
    # its request table stays the size of what is in flight, not of the whole trace
    options.setdefault("keep_ended", False)
    scheduler = make_scheduler(policy, profiles, instances, plan_costs or costs, max_batch_size=fleet.pool.max_batch_size,
                               max_prefill_tokens=fleet.pool.max_prefill_tokens, **options)
    truncated = [0]
    budgets, sizes = weight_limits(scheduler, profiles)
    sim = Simulator(scheduler, costs, requests_from(workload, fleet, truncated), weight_capacity=budgets,
                    weight_bytes=sizes,
                    kv_bytes_per_token={name: p.kv_bytes_per_token for name, p in profiles.items()}, plan_log=plan_log,
                    links=costs.host_links(instances, gpu_of), gpus=costs.gpu_shares(instances, gpu_of),
                    staging=staging_instances({s.instance_id: s.role for s in instances}, gpus_of(instances, gpu_of)),
                    weight_regions=({iid: used[0] for iid, used in gpus_of(instances, gpu_of).items() if len(used) == 1}
                                    if shared_weights else None))  # (a tensor-parallel rank keeps its own)
    started, cpu_started = time.perf_counter(), time.process_time()
    records = sim.run(progress=progress)
    sim_wall_s, sim_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    gpus = len({gpu for used in gpus_of(instances, gpu_of).values() for gpu in used})
    duration = max(workload.duration_s, max((r.finished_at or 0.0) for r in records.values()) if records else 0.0)
    metrics = summarize(records.values(), {n: (p.ttft_slo_s, p.tpot_slo_s) for n, p in profiles.items()},
                        duration_s=workload.duration_s, devices=sim.devices, num_gpus=gpus,
                        gpus_per_instance={s.instance_id: s.tp for s in instances}, makespan_s=duration)
    notes = [f"{truncated[0]} prompt(s) truncated to the model's context window"] if truncated[0] else []
    per_instance = {}
    for spec in instances:  # every instance of the layout: one never given work gets a device of zeros here
        dev = sim.device(spec.instance_id)
        per_instance[spec.instance_id] = {"busy_s": dev.busy_s, "decode_steps": dev.decode_steps,
                                          "decode_s": dev.decode_s, "num_switches": dev.num_switches,
                                          "switch_s": dev.switch_s, "prefill_s": dev.prefill_s, "kv_s": dev.kv_s,
                                          "kv_moved_bytes": dev.kv_moved_bytes}
    return SimResult(policy, gpus, instances, records, metrics, truncated[0], notes, sim.num_plans, sim.num_events,
                     sim.num_decode_steps, sim_wall_s, sim_cpu_s, time.perf_counter() - started - sim_wall_s,
                     per_instance, {spec.instance_id: dict(sim.device(spec.instance_id).switch_s_by_model)
                                    for spec in instances},
                     {spec.instance_id: dict(sim.device(spec.instance_id).decode_by_shape) for spec in instances})
