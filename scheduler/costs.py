"""What a policy needs to know about models and instances, and the cost seam.

`ModelProfile` and `InstanceSpec` are the scheduler's compact view of a fleet;
`CostModel` is what a policy uses to predict step, switch and KV-move times,
and what the instance model (scheduler.instance) charges a turn and a KV move
(sims.costmodel's roofline subclasses it; what only the simulator's executor
asks - host time, shared links and GPUs - is sims.costmodel.SimCosts).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from mypy_extensions import mypyc_attr

from scheduler.fleet import GB, Fleet

Role = Literal["mixed", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    tp: int
    weight_bytes: float  # whole model, all TP shards together
    kv_bytes_per_token: int  # all shards together
    max_context: int
    ttft_slo_s: float
    tpot_slo_s: float
    rate_rps: float = 0.0  # traffic hint, 0 when unknown
    kv_block_tokens: int = 1  # KV is held in blocks of this many tokens: a request takes whole blocks
    # planned load hints (0 when unknown): token-level sizes its KV/weights split from them (token_weights)
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    load_rps: float = 0.0  # the workload's own rate where known (a replay); else rate_rps plans
    # operator controls (the fleet file's pin, preload, idle_ttl_s, priority; token-level honours them)
    pinned: bool = False
    preload: bool = False
    idle_ttl_s: float | None = None
    priority: int = 0  # 1 high, 0 normal, -1 low


def kv_need_tokens(model: ModelProfile, num_tokens: int) -> int:
    """The KV tokens a request of `num_tokens` (prompt + output) holds: its context's, in whole blocks."""
    tokens = min(num_tokens, model.max_context)
    block = model.kv_block_tokens
    return tokens if block <= 1 else -(-tokens // block) * block


def padded_prefill_tokens(n: int) -> int:
    """The tokens a prefill of `n` runs at in an engine that pads them (the torch engine on CUDA): `n` rounded up
    to an eighth of its power of two (at least 16), at most 12.5% more. cuBLAS picks a kernel for every new
    matrix shape, on the host: on the H200 ~0.1-0.2 ms a GEMM, ~10 ms a 28-layer prefill at a length it had
    not run (a live pool's prompts are nearly all new lengths); padded, a few dozen shapes cover every length
    and the engine's warm-up runs them all. The cost model charges the padded count where the profile says
    the engine pads (prefill_padded)."""
    step = max(16, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One schedulable instance: `tp` GPUs that run one model shard-set at a time."""

    instance_id: str
    tp: int
    memory_bytes: float  # usable device memory over its tp GPUs
    role: Role = "mixed"
    # device KV bytes of an engine that keeps its KV in a region of its own, as the engine reports it (the live
    # pool: `pool.served.plan_kv`); None: the memory the resident weights leave (a simulated GPU)
    kv_bytes: float | None = None
    # host KV bytes its engine holds for requests swapped out of the device (the live pool: `plan_kv`, from the
    # engine's report); None: host memory does not bound it (a simulated node's host KV is large)
    host_kv_bytes: float | None = None
    # device bytes for model weights in such an engine, as it reports them; None: its memory less its KV
    weight_bytes: float | None = None


def kv_capacity(spec: InstanceSpec, weight_bytes: float) -> float:
    """The device KV an instance plans with when its resident weights take `weight_bytes`."""
    return spec.kv_bytes if spec.kv_bytes is not None else spec.memory_bytes - weight_bytes


@mypyc_attr(allow_interpreted_subclasses=True)
class CostModel:
    """The cost seam: what a policy asks to predict step, switch and KV-move times (and the instance model: a
    turn's steps, a KV move's overhead). Implementations subclass it and override the four abstract methods (a
    base class rather than a Protocol: in the compiled build the policies' calls into a compiled cost model are
    then native calls)."""

    def prefill_s(self, model: str, num_tokens: int, num_requests: int = 1) -> float:
        """Time to prefill `num_tokens` prompt tokens over `num_requests` prompts."""
        raise NotImplementedError

    def decode_step_s(self, model: str, batch_size: int, context_tokens: int) -> float:
        """Time of one decode step for `batch_size` requests holding `context_tokens` in total."""
        raise NotImplementedError

    def switch_s(self, model: str) -> float:
        """Time to bring `model`'s weights from the host cache onto an instance."""
        raise NotImplementedError

    def kv_move_s(self, model: str, num_tokens: int) -> float:
        """Time to move `num_tokens` tokens of KV between host and device."""
        raise NotImplementedError

    def mixed_step_s(self, model: str, batch_size: int, context_tokens: int, chunk_tokens: int,
                     chunk_prompts: int = 1) -> float:
        """One Sarathi-style iteration of one model: a decode step of `batch_size` requests holding
        `context_tokens`, and `chunk_tokens` prompt tokens of `chunk_prompts` prompts computed with it. The
        one rule for what a mixed step costs (the policies size chunks by it, the simulator charges it). Here
        the two apart; a cost model that knows its terms overrides it so the weights are read once."""
        return self.decode_step_s(model, batch_size, context_tokens) + self.prefill_s(model, chunk_tokens,
                                                                                     chunk_prompts)

    def mixed_iteration_s(self, decoding: dict[str, list[int]], chunks: dict[str, list[int]]) -> float:
        """One mixed iteration over several models: per model in `decoding` ([batch size, context tokens]), in
        that order, its mixed_step_s with its prompt chunks from `chunks` ([tokens, prompts]; none when it has no
        entry); then each model with chunks only, its prefill_s. The one rule for what an iteration costs: the
        token-level policy sizes chunks by it, the simulator charges it (the sum's order is part of it)."""
        total = 0.0
        for model, (size, context) in decoding.items():
            tokens, prompts = chunks.get(model, (0, 0))
            total += self.mixed_step_s(model, size, context, tokens, prompts)
        for model, (tokens, prompts) in chunks.items():
            if model not in decoding:
                total += self.prefill_s(model, tokens, prompts)
        return total

    def kv_move_overhead_s(self, model: str) -> float:
        """Time one KV move (a SwapOut or SwapIn of several requests, a prefill's KV to host) takes on top of
        its requests' kv_move_s: the engine issues a move's copies together. None here."""
        return 0.0

    def decode_turn_s(self, model: str, batch_size: int, context_tokens: int, num_steps: int) -> float:
        """Time of `num_steps` decode steps, each adding one token per request (context grows by `batch_size`
        a step). Step by step here; a cost model with a closed form overrides it (the simulator's hot path)."""
        total = 0.0
        for step in range(num_steps):
            total += self.decode_step_s(model, batch_size, context_tokens + step * batch_size)
        return total


PRIORITY = {"high": 1, "normal": 0, "low": -1}


def with_controls(profile: ModelProfile, controls: ModelProfile) -> ModelProfile:
    """`profile` with the operator controls of `controls` (a live pool's profile from its weights folder, given
    the fleet file's pin, preload, idle TTL and priority)."""
    return dataclasses.replace(profile, pinned=controls.pinned, preload=controls.preload,
                               idle_ttl_s=controls.idle_ttl_s, priority=controls.priority)


def model_profiles(fleet: Fleet) -> dict[str, ModelProfile]:
    """The scheduler's view of every model in the fleet."""
    out: dict[str, ModelProfile] = {}
    for entry in fleet.models:
        slo = fleet.slo(entry)
        out[entry.name] = ModelProfile(
            name=entry.name, tp=entry.tp, weight_bytes=entry.arch.weight_bytes,
            kv_bytes_per_token=entry.arch.kv_bytes_per_token, max_context=entry.arch.max_context,
            ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s,
            rate_rps=entry.traffic.rate_rps if entry.traffic else 0.0,
            pinned=entry.pin, preload=entry.preload, idle_ttl_s=entry.idle_ttl_s,
            priority=PRIORITY[entry.priority],
        )
    return out


def make_instances(
    fleet: Fleet, num_gpus: int | None = None, *, split: bool = False,
    prefill_fraction: float | None = None, gpus_by_tp: dict[int, int] | None = None, per_model: bool = False,
) -> list[InstanceSpec]:
    """Cut the pool's GPUs into instances, one TP class per distinct model TP.

    GPUs go to TP classes in proportion to their models' traffic (weights
    when no traffic is given), at least one instance per class. With `split`
    each class is divided into prefill and decode instances (token-level);
    with `per_model` every model gets at least one instance (dedicated).
    """
    total = num_gpus or fleet.pool.num_gpus
    per_gpu = fleet.gpu().memory_gb * GB * fleet.pool.gpu_memory_utilization
    if gpus_by_tp is None:
        gpus_by_tp = _gpus_per_tp_class(fleet, total, minimum=2 if split else 1, per_model=per_model)
    fraction = fleet.pool.prefill_fraction if prefill_fraction is None else prefill_fraction
    out: list[InstanceSpec] = []
    for tp, gpus in sorted(gpus_by_tp.items()):
        count = gpus // tp
        roles: list[Role] = ["mixed"] * count
        if split:
            num_prefill = min(max(1, round(count * fraction)), count - 1) if count > 1 else 0
            roles = ["prefill"] * num_prefill + ["decode"] * (count - num_prefill)  # type: ignore[assignment]
        for index, role in enumerate(roles):
            out.append(InstanceSpec(f"tp{tp}-{index}", tp, per_gpu * tp, role))
    return out


def _gpus_per_tp_class(fleet: Fleet, total: int, minimum: int, per_model: bool = False) -> dict[int, int]:
    weight: dict[int, float] = {}
    models: dict[int, int] = {}
    for entry in fleet.models:
        share = entry.traffic.rate_rps if entry.traffic else 0.0
        weight[entry.tp] = weight.get(entry.tp, 0.0) + share * entry.tp + 1e-9 * entry.arch.weight_bytes / GB
        models[entry.tp] = models.get(entry.tp, 0) + 1
    need = {tp: tp * max(minimum, models[tp] if per_model else 0) for tp in weight}
    if sum(need.values()) > total:
        what = "one instance per model" if per_model else f"{minimum} instance(s) of each TP class {sorted(need)}"
        raise ValueError(f"{total} GPUs cannot hold {what} (need {sum(need.values())})")
    spare = total - sum(need.values())
    norm = sum(weight.values())
    out = dict(need)
    for tp in sorted(weight, key=lambda t: -weight[t]):
        extra = math.floor(spare * weight[tp] / norm / tp) * tp
        out[tp] += extra
    smallest = min(weight)  # what rounding left goes to the smallest TP class
    out[smallest] += (total - sum(out.values())) // smallest * smallest
    return out
