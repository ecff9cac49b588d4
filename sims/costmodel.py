"""Roofline cost model: predicted prefill, decode-step, switch and KV-move times.

Per (model, GPU) a step takes the larger of its compute time and its memory
time, each at an efficiency a calibration profile measured (sims.profiles),
plus overheads. A scheduler.costs.CostModel. Assumptions:

- A step streams every weight it touches once from HBM (weights do not fit
  in L2). An untied input-embedding table is gathered (a few rows), not
  streamed; the lm_head (tied or not) is streamed.
- FLOPs: 2 per parameter per token in the GEMMs; logits only for the last
  token of each prompt (as serving engines do); attention 4 * heads * head_dim
  per (query, key) pair per layer (QK^T and PV), causal prefill counts half the
  pairs. The prompts of one prefill are taken as equal length (num_tokens /
  num_requests; the least attention work for that total).
- MoE: a step of B tokens streams the expected number of distinct experts,
  E * (1 - (1 - k/E)^B) per layer (uniform, independent routing); FLOPs use
  active parameters.
- Tensor parallel: weights, FLOPs and KV split evenly over tp GPUs (KV heads
  replicate when tp > num_kv_heads, as in vLLM); each layer adds 2 ring
  all-reduces of tokens * hidden activations over NVLink, not overlapped.
- Without CUDA graphs the GPU runs behind the host: a step lasts at least
  num_layers * launch_s_per_layer.
- Switch: each GPU copies its own shard from pinned host memory over its own
  PCIe link, all in parallel. Norms, rotary, sampling, activation traffic are
  left to the fitted fixed terms: decode_fixed_s a step, decode_layer_s a layer
  of it, decode_request_s a request of its batch.
- The live pool's host time (measured on an idle pool with a zero-time
  engine) adds host_call_s (+ host_token_s per request: each delivers a token)
  to every engine call, after the GPU time and the launch floor: the host
  waits for each step's tokens.
- Shared budgets, no fitted contention: with pool.gpus_per_host_link >= 1,
  `host_links` gives the simulator the links its instances copy over
  (sims.links): a link moves its bytes at the one rate eff_pcie measured,
  copies served in the order they start (a DMA engine's queue); else every
  copy runs at the full link rate. Where the placement puts several
  instances on one GPU, `gpu_shares` splits its time among those busy
  (sims.gpu_share at slowdown SHARED_GPU_SLOWDOWN: k busy each get 1/k),
  except where the profile measured how two instances' processes slow each
  other (the share terms, `share_pairs`, `decode_pairs`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from mypy_extensions import mypyc_attr

from scheduler.costs import CostModel, InstanceSpec, padded_prefill_tokens
from scheduler.fleet import GPUS, Arch, Fleet, GpuSpec
from sims.gpu_share import GpuTimeSharing, decode_share_table, gpu_peers, share_table
from sims.links import HostLinks, link_spans
from sims.profiles import CalibrationProfile, ProfileTerms, load_profile, shape_key

Bound = Literal["memory", "compute", "launch"]
# Instances on one GPU share its budget: while k are busy each runs at 2 / (k * this) = 1/k of its rate alone
# (a rule, not a fitted term: the GPU's FLOPs and bytes are split without gain or loss).
SHARED_GPU_SLOWDOWN = 2.0
Line = tuple[float, float]  # (a, b): the value at step s is a + b * s
TurnLines = tuple[Line, Line, Line]  # a decode turn's memory, compute and (flat) floor lines


def expected_experts_touched(num_experts: int, experts_per_token: int, num_tokens: float) -> float:
    """Expected distinct experts per layer that `num_tokens` tokens route to (uniform top-k)."""
    if num_experts == 0 or num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - math.pow(1.0 - experts_per_token / num_experts, num_tokens))


@dataclass(frozen=True, slots=True)
class ModelConstants:
    """Per-GPU costs of one model on one GPU type: everything a step needs but its shape."""

    tp: int
    num_layers: int
    num_experts: int
    experts_per_token: int
    weight_bytes: float  # whole model, all shards
    kv_bytes_per_token_gpu: float  # per GPU (replicated KV heads counted)
    stream_static_s: float  # read the always-touched weights once (per GPU)
    stream_expert_s: float  # read one expert in every layer (per GPU)
    kv_read_s_per_token: float
    kv_write_s_per_token: float
    gemm_s_per_token: float  # all GEMMs but the lm_head, at eff_compute
    lm_head_s_per_row: float
    attn_s_per_pair: float  # one (query, key) pair over all layers
    allreduce_fixed_s: float  # latency of a step's all-reduces (0 at tp 1)
    allreduce_s_per_token: float
    prefill_overhead_s: float
    prefill_request_s: float  # per prompt
    host_call_s: float  # the live pool's host time per engine call, after the GPU time
    host_token_s: float  # and per token it delivers (a prefill's prompts, a decode step's requests)
    prefill_padded: bool  # the GEMMs run at scheduler.costs.padded_prefill_tokens rows
    decode_fixed_s: float  # with the per-layer term and the live pool's host time per step
    decode_request_s: float  # GPU and the live pool's host time per request of a step's batch
    prefill_floor_s: float  # host launch floor (0 with CUDA graphs)
    decode_floor_s: float
    switch_s: float
    h2d_s_per_byte: float
    kv_s_per_byte: float  # KV moves (at eff_kv_move)
    kv_move_fixed_s: float  # per move (kv_move_overhead_s)
    kv_copy_s_per_byte: float  # KV copied within the device: read and written at eff_mem of HBM


def model_constants(arch: Arch, tp: int, gpu: GpuSpec, terms: ProfileTerms) -> ModelConstants:
    """Precompute the per-step costs of `arch` at tensor-parallel size `tp` on `gpu`."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    dtype = arch.dtype_bytes
    hbm, flops = gpu.hbm_tb_s * 1e12, gpu.bf16_tflops * 1e12
    lm_head = arch.vocab_size * arch.hidden_size
    input_table = 0 if arch.tie_embeddings else lm_head
    all_experts = arch.num_experts * arch.num_layers * arch.expert_params
    kv_shard = math.ceil(arch.num_kv_heads / tp) / arch.num_kv_heads  # share of KV bytes on one GPU
    kv_gpu = arch.kv_bytes_per_token * kv_shard
    allreduce_bytes = 2.0 * (tp - 1) / tp * arch.hidden_size * dtype  # per token, per all-reduce
    layers = arch.num_layers
    return ModelConstants(
        tp=tp, num_layers=layers, num_experts=arch.num_experts, experts_per_token=arch.experts_per_token,
        weight_bytes=arch.weight_bytes, kv_bytes_per_token_gpu=kv_gpu,
        stream_static_s=(arch.params - all_experts - input_table) * dtype / tp / (hbm * terms.eff_mem),
        stream_expert_s=layers * arch.expert_params * dtype / tp / (hbm * terms.eff_mem),
        kv_read_s_per_token=kv_gpu / (hbm * terms.eff_kv),
        kv_write_s_per_token=kv_gpu / (hbm * terms.eff_mem),
        gemm_s_per_token=2.0 * (arch.active_params - input_table - lm_head) / tp / (flops * terms.eff_compute),
        lm_head_s_per_row=2.0 * lm_head / tp / (flops * terms.eff_compute),
        attn_s_per_pair=4.0 * layers * arch.num_heads * arch.dim / tp / (flops * terms.eff_compute),
        allreduce_fixed_s=2 * layers * terms.allreduce_latency_s if tp > 1 else 0.0,
        allreduce_s_per_token=2 * layers * allreduce_bytes / (gpu.nvlink_gb_s * 1e9 * terms.eff_nvlink),
        prefill_overhead_s=terms.prefill_fixed_s + layers * terms.prefill_layer_s,
        prefill_request_s=terms.prefill_request_s,
        host_call_s=terms.host_call_s,
        host_token_s=terms.host_token_s,
        prefill_padded=terms.prefill_padded,
        decode_fixed_s=terms.decode_fixed_s + layers * terms.decode_layer_s + terms.host_call_s,
        decode_request_s=terms.decode_request_s + terms.host_token_s,
        prefill_floor_s=0.0 if terms.prefill_cuda_graphs else layers * terms.launch_s_per_layer,
        decode_floor_s=0.0 if terms.decode_cuda_graphs else layers * terms.launch_s_per_layer,
        switch_s=arch.weight_bytes / tp / (gpu.h2d_gb_s * 1e9 * terms.eff_pcie) + terms.switch_fixed_s,
        h2d_s_per_byte=1.0 / (gpu.h2d_gb_s * 1e9 * terms.eff_pcie),
        kv_s_per_byte=1.0 / (gpu.h2d_gb_s * 1e9 * (terms.eff_kv_move or terms.eff_pcie)),
        kv_move_fixed_s=terms.kv_move_fixed_s,
        kv_copy_s_per_byte=2.0 / (hbm * terms.eff_mem),
    )


class CopyLinks(Protocol):
    """The host links of one simulation's instances: when a copy ends, given the copies that share its link."""

    def copy_end_at(self, instance_id: str, to_device: bool, start_at: float, alone_s: float, now: float) -> float:
        """The end of a copy on `instance_id`'s link(s) (`to_device`: host to device) that takes `alone_s`
        alone and starts at `start_at` (>= `now`, the simulated time of the call)."""
        ...


class GpuShares(Protocol):
    """The GPUs of one simulation's instances, where several share one: when a step's device work ends, given
    the work its peers on that GPU have in flight."""

    def work_end_at(self, instance_id: str, start_at: float, alone_s: float, now: float,
                    kind: str = "prefill", models: Sequence[str] = (), tokens: int = 0) -> float:
        """The end of device work of `instance_id` that takes `alone_s` alone and starts at `start_at`
        (>= `now`, the simulated time of the call); `kind` "decode" (a decode turn) or "prefill" (a prefill or a
        mixed iteration): a GPU's peers slow a decode step and a prefill differently; `models`: the models the
        work runs and `tokens` its prompt tokens (a peer's work slows it by their size, its own and the prompt's
        length)."""
        ...

    def cut(self, instance_id: str, at: float) -> None:
        """`instance_id`'s work booked to run past `at` ends at `at` (a Stop cut its decode turn short)."""
        ...


@mypyc_attr(allow_interpreted_subclasses=True)
class SimCosts(CostModel):
    """What the simulator's executor asks beyond what policies do: the live pool's host time on the way in and
    out, KV copied within a GPU, and the shared host links and GPUs of one simulation. The defaults charge
    nothing more and share nothing; RooflineCostModel overrides them."""

    def kv_device_copy_s(self, model: str, num_tokens: int) -> float:
        """Time to copy `num_tokens` tokens of KV within device memory (a hand-off staged on one GPU). Here
        what a host move takes: a cost model that knows the device's memory bandwidth overrides it."""
        return self.kv_move_s(model, num_tokens)

    def call_host_s(self, model: str, num_rows: int = 1) -> float:
        """The host part of one engine call of `model` over `num_rows` rows (a prefill's prompts, a decode step's
        requests): time after the GPU's work in the live pool, not device work, so it shares no GPU with other
        instances. None here."""
        return 0.0

    def request_admit_s(self) -> float:
        """Time from a request's arrival to its scheduler having it (a live pool's gateway and loop). None here."""
        return 0.0

    def request_prompt_token_s(self) -> float:
        """Time a live pool's way in adds per prompt token (the gateway parsing the prompt). None here."""
        return 0.0

    def token_deliver_s(self) -> float:
        """Time from a step producing a token to its client having it (a live pool's way out). None here."""
        return 0.0

    def kv_call_host_s(self) -> float:
        """Host time a live pool adds to each KV move (SwapOut, SwapIn) after the move itself. None here."""
        return 0.0

    def decode_ahead(self) -> bool:
        """Whether the engine queues each decode step's successor before the host has its tokens (a live torch
        engine on CUDA): a turn not continued by a Decode of the same requests leaves one more step on the
        device, which the instance's next work waits for. No here."""
        return False

    def host_links(self, instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> CopyLinks | None:
        """Fresh state of the host links `instances` copy over, for one simulation (`gpu_of`: instances placed
        by hand, by first GPU index). None (here): every copy has a link of its own."""
        return None

    def gpu_shares(self, instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> GpuShares | None:
        """Fresh state of the GPUs `instances` run on where several share one, for one simulation (`gpu_of` as
        in host_links). None (here): every instance has its GPUs' compute to itself."""
        return None


def kv_device_move_s(costs: SimCosts, moves: Sequence[tuple[str, int]]) -> float:
    """One KV move of (model, tokens) pairs within the device (a staged hand-off's gather, or its scatter into
    the importer's blocks): each request's `kv_device_copy_s`, plus the one overhead of a KV move."""
    if not moves:
        return 0.0
    return sum(costs.kv_device_copy_s(model, tokens) for model, tokens in moves) + costs.kv_move_overhead_s(moves[0][0])


@dataclass(frozen=True, slots=True)
class _DecodeShape:
    """One model at one batch size: step time = max(mem_a + mem_b * context, flop_a + flop_b * context,
    floor_s) + fixed_s (plain floats: read on every step-time prediction)."""

    mem_a: float
    mem_b: float
    flop_a: float
    flop_b: float
    floor_s: float
    fixed_s: float


class RooflineCostModel(SimCosts):
    """Roofline step, switch and KV-move times for every model of a fleet on one GPU type.

    Times are in seconds. `context_tokens` counts the KV tokens of the whole batch.
    Per-model constants are built once; decode shapes are cached per (model, batch).
    """

    def __init__(self, fleet: Fleet | Mapping[str, tuple[Arch, int]], gpu: str | GpuSpec | None = None,
                 profile: CalibrationProfile | None = None, gpu_name: str = "",
                 gpus_per_host_link: int | None = None) -> None:
        """`fleet`'s models on `gpu` (a GPU type of the fleet or the catalogue; the pool's by default), or, from
        `for_models`, models by name -> (arch, tp) on `gpu`, a catalogue key or a spec named `gpu_name`.
        `gpus_per_host_link` as the pool setting (None: the fleet's pool setting; 0 without a fleet)."""
        self.profile = profile or _default_profile()
        if isinstance(fleet, Fleet):
            models = {entry.name: (entry.arch, entry.tp) for entry in fleet.models}
            gpu = gpu or fleet.pool.gpu
            spec = gpu if isinstance(gpu, GpuSpec) else device_spec(gpu, self.profile, fleet.gpus)
            if gpus_per_host_link is None:
                gpus_per_host_link = fleet.pool.gpus_per_host_link
        elif gpu is None:
            raise TypeError("a cost model without a fleet needs a GPU")
        else:
            models = dict(fleet)
            spec = gpu if isinstance(gpu, GpuSpec) else device_spec(gpu, self.profile)
        self.gpu_name, self.gpu = (gpu if isinstance(gpu, str) else gpu_name).lower(), spec
        self.terms = self.profile.terms_for(self.gpu_name)
        self._models = {name: model_constants(arch, tp, spec, self.terms) for name, (arch, tp) in models.items()}
        scales = self.profile.prefill_scales(self.gpu_name)  # a shape calibrate timed here: its own points
        self._prefill_scale = {name: scales[shape_key(arch)] for name, (arch, tp) in models.items()
                               if tp == 1 and shape_key(arch) in scales}
        self.gpus_per_host_link = gpus_per_host_link or 0
        self._shapes: dict[str, list[_DecodeShape | None]] = {}  # model -> shape by batch size, built on demand

    @classmethod
    def for_models(cls, models: Mapping[str, tuple[Arch, int]], gpu: str | GpuSpec,
                   profile: CalibrationProfile | None = None, gpu_name: str = "",
                   gpus_per_host_link: int | None = None) -> RooflineCostModel:
        """A cost model without a fleet: `models` maps names to (arch, tp); `gpu` a catalogue key or a spec."""
        return cls(models, gpu, profile, gpu_name, gpus_per_host_link)

    def constants(self, model: str) -> ModelConstants:
        return self._models[model]

    # ---- CostModel -------------------------------------------------------------------------------
    def prefill_s(self, model: str, num_tokens: int, num_requests: int = 1) -> float:
        """max(compute, memory) + all-reduces + overheads, at least the launch floor without graphs; times the
        shape's own scale at this many prompts and tokens where calibrate timed it on this GPU
        (CalibrationProfile.shape_scales, ShapeScale.at)."""
        if num_tokens <= 0:
            return 0.0
        c = self._models[model]
        requests = max(1, min(num_requests, num_tokens))
        run = padded_prefill_tokens(num_tokens) if c.prefill_padded else num_tokens  # the GEMMs' rows
        compute = (run * c.gemm_s_per_token + requests * c.lm_head_s_per_row
                   + c.attn_s_per_pair * num_tokens * num_tokens / (2.0 * requests))
        experts = expected_experts_touched(c.num_experts, c.experts_per_token, num_tokens)
        memory = c.stream_static_s + experts * c.stream_expert_s + run * c.kv_write_s_per_token
        gpu = (max(compute, memory) + c.allreduce_fixed_s + run * c.allreduce_s_per_token + c.prefill_overhead_s
               + requests * c.prefill_request_s)
        seconds = max(gpu, c.prefill_floor_s) + c.host_call_s + requests * c.host_token_s
        scale = self._prefill_scale.get(model)
        return seconds if scale is None else seconds * scale.at(num_tokens, requests)

    def decode_step_s(self, model: str, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        shape = self._shape(model, batch_size)
        top = shape.mem_a + shape.mem_b * context_tokens
        compute = shape.flop_a + shape.flop_b * context_tokens
        if compute > top:  # max() by hand: plain floats, compiled
            top = compute
        if shape.floor_s > top:
            top = shape.floor_s
        return top + shape.fixed_s

    def mixed_step_s(self, model: str, batch_size: int, context_tokens: int, chunk_tokens: int,
                     chunk_prompts: int = 1) -> float:
        """A decode step and a prompt chunk in one forward pass: the weights are streamed once (the decode
        step's memory line), the chunk adds its GEMM, logits and attention FLOPs, its KV writes, its all-reduce
        traffic and the per-prompt terms; the larger of the two lines, the launch floor, the step's fixed terms."""
        if chunk_tokens <= 0:
            return self.decode_step_s(model, batch_size, context_tokens)
        if batch_size <= 0:
            return self.prefill_s(model, chunk_tokens, chunk_prompts)
        c = self._models[model]
        shape = self._shape(model, batch_size)
        prompts = max(1, min(chunk_prompts, chunk_tokens))
        run = padded_prefill_tokens(chunk_tokens) if c.prefill_padded else chunk_tokens
        more_experts = (expected_experts_touched(c.num_experts, c.experts_per_token, batch_size + run)
                        - expected_experts_touched(c.num_experts, c.experts_per_token, batch_size))
        shared = run * c.allreduce_s_per_token
        memory = (shape.mem_a + shape.mem_b * context_tokens + run * c.kv_write_s_per_token
                  + more_experts * c.stream_expert_s + shared)
        compute = (shape.flop_a + shape.flop_b * context_tokens + run * c.gemm_s_per_token
                   + prompts * c.lm_head_s_per_row + c.attn_s_per_pair * chunk_tokens * chunk_tokens / (2.0 * prompts)
                   + shared)
        top = max(memory, compute, shape.floor_s, c.prefill_floor_s)
        return top + shape.fixed_s + prompts * (c.prefill_request_s + c.host_token_s)

    def switch_s(self, model: str) -> float:
        return self._models[model].switch_s

    def kv_move_s(self, model: str, num_tokens: int) -> float:
        c = self._models[model]
        return num_tokens * c.kv_bytes_per_token_gpu * c.kv_s_per_byte

    def kv_device_copy_s(self, model: str, num_tokens: int) -> float:
        c = self._models[model]
        return num_tokens * c.kv_bytes_per_token_gpu * c.kv_copy_s_per_byte

    def kv_move_overhead_s(self, model: str) -> float:
        return self._models[model].kv_move_fixed_s

    def host_links(self, instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> CopyLinks | None:
        """The instances' host links (sims.links) when the pool shares them (gpus_per_host_link >= 1), else None:
        a link's bytes at its one measured rate, copies in the order they start."""
        if self.gpus_per_host_link < 1:
            return None
        return HostLinks(link_spans(instances, self.gpus_per_host_link, gpu_of))

    def call_host_s(self, model: str, num_rows: int = 1) -> float:
        c = self._models[model]
        return c.host_call_s + num_rows * c.host_token_s

    def request_admit_s(self) -> float:
        return self.terms.request_admit_s

    def request_prompt_token_s(self) -> float:
        return self.terms.request_prompt_token_s

    def token_deliver_s(self) -> float:
        return self.terms.token_deliver_s

    def kv_call_host_s(self) -> float:
        return self.terms.kv_call_host_s

    def decode_ahead(self) -> bool:
        return self.terms.decode_ahead

    def gpu_shares(self, instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> GpuShares | None:
        """The instances' time-slicing (sims.gpu_share) where some share a GPU, else None."""
        peers = gpu_peers(instances, gpu_of)
        if not peers:
            return None
        return GpuTimeSharing(peers, SHARED_GPU_SLOWDOWN, decode_slowdown=self.terms.share_decode_slowdown,
                              prefill_slowdown=self.terms.share_prefill_slowdown,
                              table=share_table(self.profile.share_pairs),
                              model_bytes={name: c.weight_bytes / c.tp for name, c in self._models.items()},
                              decode_table=decode_share_table(self.profile.decode_pairs))

    # ---- turns: many steps at once ---------------------------------------------------------------
    def decode_turn_s(self, model: str, batch_size: int, context_tokens: int, num_steps: int) -> float:
        """Time of `num_steps` decode steps, each adding one token per request (context grows by
        `batch_size` a step). Closed form: the sum of a convex piecewise-linear series."""
        if num_steps <= 0 or batch_size <= 0:
            return 0.0
        lines, fixed_s = self._turn_lines(model, batch_size, context_tokens)
        (mem_a, mem_b), (flop_a, flop_b), (floor_s, _) = lines
        top = _top(mem_a, mem_b, flop_a, flop_b, floor_s, 0)
        if top == _top(mem_a, mem_b, flop_a, flop_b, floor_s, num_steps - 1):
            # one line tops both ends, hence (lines are linear) all steps; picked by hand, not lines[top]
            # (compiled, indexing the tuple by a variable boxes all of it)
            a, b = (mem_a, mem_b) if top == 0 else (flop_a, flop_b) if top == 1 else (floor_s, 0.0)
            return num_steps * (a + fixed_s + b * (num_steps - 1) / 2.0)
        return sum(_segment_sum(a + fixed_s, b, start, end) for start, end, a, b in _envelope(lines, num_steps))

    def steps_within_s(self, model: str, batch_size: int, context_tokens: int, seconds: float) -> int:
        """The most whole steps whose decode_turn_s fits in `seconds` (inverts decode_turn_s)."""
        if batch_size <= 0 or not seconds > 0:
            return 0
        if not math.isfinite(seconds):
            raise ValueError(f"seconds must be finite, got {seconds}")
        lines, fixed_s = self._turn_lines(model, batch_size, context_tokens)
        # steps never get cheaper (slopes >= 0), so the first step's time bounds the count
        horizon = math.ceil(seconds / (max(a for a, _ in lines) + fixed_s)) + 1
        left, steps = seconds, horizon
        for start, end, a, b in _envelope(lines, horizon):
            cost = _segment_sum(a + fixed_s, b, start, end)
            if cost <= left:
                left -= cost
                continue
            steps = start + _max_terms(a + fixed_s + b * start, b, left)
            break
        # the closed forms may disagree in the last ulp: settle on decode_turn_s itself
        while self.decode_turn_s(model, batch_size, context_tokens, steps + 1) <= seconds:
            steps += 1
        while steps > 0 and self.decode_turn_s(model, batch_size, context_tokens, steps) > seconds:
            steps -= 1
        return steps

    def decode_bound(self, model: str, batch_size: int, context_tokens: int) -> Bound:
        """Which term sets the step time: HBM traffic, FLOPs or the host launch floor."""
        shape = self._shape(model, batch_size)
        memory = shape.mem_a + shape.mem_b * context_tokens
        compute = shape.flop_a + shape.flop_b * context_tokens
        if shape.floor_s > max(memory, compute):
            return "launch"
        return "compute" if compute > memory else "memory"

    # ---- internals -------------------------------------------------------------------------------
    def _shape(self, model: str, batch_size: int) -> _DecodeShape:
        shapes = self._shapes.get(model)
        if shapes is not None and batch_size < len(shapes):
            shape = shapes[batch_size]
            if shape is not None:
                return shape
        return self._decode_shape(model, batch_size)

    def _decode_shape(self, model: str, batch_size: int) -> _DecodeShape:
        c = self._models[model]
        experts = expected_experts_touched(c.num_experts, c.experts_per_token, batch_size)
        overhead = c.allreduce_fixed_s + batch_size * c.allreduce_s_per_token
        memory_a = c.stream_static_s + experts * c.stream_expert_s + batch_size * c.kv_write_s_per_token
        compute_a = batch_size * (c.gemm_s_per_token + c.lm_head_s_per_row)
        shape = _DecodeShape(mem_a=memory_a + overhead, mem_b=c.kv_read_s_per_token,
                             flop_a=compute_a + overhead, flop_b=c.attn_s_per_pair,
                             floor_s=c.decode_floor_s, fixed_s=c.decode_fixed_s + batch_size * c.decode_request_s)
        shapes = self._shapes.setdefault(model, [])
        if len(shapes) <= batch_size:
            shapes.extend([None] * (batch_size + 1 - len(shapes)))
        shapes[batch_size] = shape
        return shape

    def _turn_lines(self, model: str, batch_size: int, context_tokens: int) -> tuple[TurnLines, float]:
        """The step-time lines in the step index s of a turn (context = context_tokens + batch * s)."""
        shape = self._shape(model, batch_size)
        lines = ((shape.mem_a + shape.mem_b * context_tokens, shape.mem_b * batch_size),
                 (shape.flop_a + shape.flop_b * context_tokens, shape.flop_b * batch_size), (shape.floor_s, 0.0))
        return lines, shape.fixed_s


def device_spec(gpu: str, profile: CalibrationProfile, gpus: Mapping[str, GpuSpec] | None = None) -> GpuSpec:
    """The figures of GPU type `gpu` the profile's efficiencies apply to: the device's own, measured, where the
    profile was calibrated on a device the catalogue does not describe (a CPU) and `gpu` is that device; else the
    fleet's `gpus` entry, else the catalogue's."""
    key = gpu.lower()
    run = profile.calibration
    if profile.device_spec is not None and run is not None and run.gpu == key:
        return profile.device_spec
    if gpus and key in gpus:
        return gpus[key]
    if key not in GPUS:
        measured = f" (profile {profile.name} was measured on {run.gpu})" if run is not None else ""
        raise KeyError(f"unknown GPU {gpu!r}: not in the GPU catalogue ({', '.join(sorted(GPUS))}) nor the fleet's "
                       f"gpus{measured}")
    return GPUS[key]


@functools.cache
def _default_profile() -> CalibrationProfile:
    return load_profile("default")


def _top(a0: float, b0: float, a1: float, b1: float, a2: float, step: int) -> int:
    """Index of the turn line on top at `step` among memory (a0, b0), compute (a1, b1) and the flat floor
    (a2, 0.0); ties go to the steeper line, which stays on top after. Plain floats: once per decode turn."""
    best, value, slope = 0, a0 + b0 * step, b0
    candidate = a1 + b1 * step
    if candidate > value or (candidate == value and b1 > slope):
        best, value, slope = 1, candidate, b1
    candidate = a2 + 0.0 * step
    if candidate > value or (candidate == value and 0.0 > slope):
        best = 2
    return best


def _envelope(lines: TurnLines, num_steps: int) -> list[tuple[int, int, float, float]]:
    """The upper envelope of `lines` over integer steps [0, num_steps) as (start, end, a, b)
    segments. The envelope is convex, so a segment ends where a steeper line first overtakes;
    lines are few (3), so this is O(1)."""
    (mem_a, mem_b), (flop_a, flop_b), (floor_s, _) = lines
    segments: list[tuple[int, int, float, float]] = []
    step = 0
    while step < num_steps:
        a, b = lines[_top(mem_a, mem_b, flop_a, flop_b, floor_s, step)]
        crossings = [math.ceil((a - a_j) / (b_j - b)) for a_j, b_j in lines if b_j > b]
        end = min(num_steps, max(step + 1, min(crossings))) if crossings else num_steps
        segments.append((step, end, a, b))
        step = end
    return segments


def _segment_sum(a: float, b: float, start: int, end: int) -> float:
    """The sum of a + b * s over s in [start, end)."""
    return (end - start) * (a + b * (start + end - 1) / 2.0)


def _max_terms(first: float, slope: float, budget: float) -> int:
    """Largest m >= 0 with sum_{i<m} (first + slope * i) <= budget (first > 0, slope >= 0)."""
    if first <= 0:
        raise ValueError(f"step time must be positive, got {first}")
    if budget <= 0:
        return 0
    # slope/2 m^2 + (first - slope/2) m - budget = 0; this form of the root avoids cancellation
    p = first - slope / 2.0
    return max(0, math.floor(2.0 * budget / (p + math.sqrt(p * p + 2.0 * slope * budget))))
