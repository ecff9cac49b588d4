"""How instances share a GPU: which GPU each goes on, and how one GPU's memory is split between them.

Decided before anything starts (`modelpool.deploy` sizes every engine from it): instances round-robin over
the GPUs; a GPU's usable memory holds the fleet's weights (once, in a region its instances map, or two slots
per instance), each staging instance's hand-off arena, and its instances' KV, each with GPU_HEADROOM_BYTES
for activations.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pool.served import ServedModel

MiB, GiB = 1 << 20, 1 << 30
GPU_HEADROOM_BYTES = 2 * GiB  # activations, CUDA graphs, allocator slack
# prefill steps' worth of KV a staging instance's hand-off arena holds: at 4 (1.9 GB for the 7B shape), 2% of the
# hand-offs at 22 req/s on the H200 found it full while the decoder was in a switch and went through host memory
# (export ~100 ms, import ~150 ms of block-by-block host writes: the longest imports of the run)
HANDOFF_BATCHES = 8
# host KV each GPU instance pins at start (at most its max_host_kv_bytes): pinning a 1 GiB slab mid-run held the
# H200's decode instance ~0.3 s, and at 22 req/s it swapped up to 2.9 GB into host memory
HOST_KV_PREALLOC_BYTES = 4 << 30


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
