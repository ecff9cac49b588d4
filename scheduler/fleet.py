"""The fleet: GPU types, model architectures and the pool, as pydantic v2 schema.

This module only describes and checks a fleet; reading models.yaml (I/O, line
numbers) lives in `modelpool.config`. Catalogues of well-known GPUs and
architectures carry published figures so a fleet entry can say `arch: qwen2.5-7b`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler.catalog import ARCHS, GPUS as _GPU_FIGURES

GB = 1e9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "int8": 1}

PosFloat = Annotated[float, Field(gt=0)]
PosInt = Annotated[int, Field(gt=0)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuSpec(_Frozen):
    """One GPU type: the figures the cost model and the price report need."""

    memory_gb: PosFloat = Field(description="Device memory in GB (1e9 bytes), as on the datasheet.")
    hbm_tb_s: PosFloat = Field(description="HBM bandwidth in TB/s (datasheet).")
    bf16_tflops: PosFloat = Field(description="Dense BF16 tensor throughput in TFLOPS (datasheet).")
    h2d_gb_s: PosFloat = Field(description="Nominal host-to-device bandwidth per direction in GB/s (PCIe).")
    nvlink_gb_s: PosFloat = Field(description="NVLink bandwidth per GPU in GB/s (used for tensor-parallel all-reduce).")
    usd_per_hour: PosFloat = Field(description="Price of one GPU-hour in USD (rental estimate unless stated).")
    source: str = Field(default="", description="Where the figures come from.")


class Arch(_Frozen):
    """A decoder-only transformer, in the terms of a Hugging Face config.json."""

    family: str = Field(default="llama", description="Model family (llama, qwen2, qwen3, qwen3_moe, mistral, yi ...).")
    num_layers: PosInt = Field(description="Number of transformer layers (num_hidden_layers).")
    hidden_size: PosInt = Field(description="Model width (hidden_size).")
    num_heads: PosInt = Field(description="Attention query heads (num_attention_heads).")
    num_kv_heads: PosInt = Field(description="Key/value heads (num_key_value_heads); < num_heads means GQA.")
    head_dim: PosInt | None = Field(default=None, description="Per-head width; defaults to hidden_size / num_heads.")
    intermediate_size: PosInt = Field(description="Dense MLP width; for MoE the width of one expert.")
    vocab_size: PosInt = Field(description="Vocabulary size.")
    tie_embeddings: bool = Field(default=False, description="Input and output embeddings share weights.")
    qkv_bias: bool = Field(default=False, description="Q/K/V projections carry biases (Qwen2).")
    num_experts: Annotated[int, Field(ge=0)] = Field(default=0, description="Routed experts per MoE layer (0 = dense).")
    experts_per_token: Annotated[int, Field(ge=0)] = Field(default=0, description="Experts each token is routed to (top-k).")
    total_params: PosFloat | None = Field(default=None, description="Published parameter count; computed from the shape when absent.")
    dtype: Literal["bfloat16", "float16", "float32", "fp8", "int8"] = Field(default="bfloat16", description="Weight and KV dtype.")
    max_context: PosInt = Field(default=32768, description="Maximum context length in tokens.")

    @model_validator(mode="after")
    def _check_moe(self) -> Arch:
        if (self.num_experts == 0) != (self.experts_per_token == 0):
            raise ValueError(f"num_experts ({self.num_experts}) and experts_per_token ({self.experts_per_token}) must both be 0 (dense) or both > 0 (MoE)")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} > num_experts {self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        return self

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attn_params_per_layer(self) -> int:
        q_out, kv_out = self.num_heads * self.dim, self.num_kv_heads * self.dim
        bias = (q_out + 2 * kv_out) if self.qkv_bias else 0
        return self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size + bias

    @property
    def expert_params(self) -> int:
        """Parameters of one gated MLP (one expert, or the dense MLP)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def computed_params(self) -> int:
        experts = max(self.num_experts, 1)
        router = self.hidden_size * self.num_experts
        per_layer = self.attn_params_per_layer + experts * self.expert_params + router + 2 * self.hidden_size
        return self.num_layers * per_layer + self.embedding_params + self.hidden_size

    @property
    def params(self) -> float:
        return self.total_params or float(self.computed_params)

    @property
    def active_params(self) -> float:
        """Parameters one token touches (all of them for a dense model)."""
        if not self.is_moe:
            return self.params
        unused = (self.num_experts - self.experts_per_token) * self.expert_params * self.num_layers
        return self.params - unused

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.dim * self.dtype_bytes


GPUS: dict[str, GpuSpec] = {name: GpuSpec.model_validate(figures) for name, figures in _GPU_FIGURES.items()}


class Slo(_Frozen):
    """Latency objectives of one model."""

    ttft_s: PosFloat = Field(default=10.0, description="Time-to-first-token objective in seconds.")
    tpot_s: PosFloat = Field(default=0.1, description="Mean time-per-output-token objective in seconds.")


class Traffic(_Frozen):
    """A hint for the simulator's synthetic workload (ignored by the live pool)."""

    rate_rps: Annotated[float, Field(ge=0)] = Field(description="Mean arrival rate in requests per second.")
    cv: PosFloat = Field(default=1.0, description="Coefficient of variation of inter-arrival times (1 = Poisson).")


class ModelEntry(_Frozen):
    """One served model."""

    name: str = Field(min_length=1, max_length=200, description="The id clients use in the `model` field.")
    arch: Arch = Field(description="A catalogue key (e.g. `qwen2.5-7b`), an inline architecture, or (in models.yaml) a local folder with config.json.")
    arch_name: str = Field(default="", description="The catalogue key or folder the architecture came from (filled in by the loader).")
    tp: PosInt = Field(default=1, description="Tensor-parallel size: GPUs one instance of this model spans.")
    slo: Slo | None = Field(default=None, description="SLOs; the pool's default_slo when absent.")
    weights: str | None = Field(default=None, description="Local folder with safetensors weights for the live pool.")
    traffic: Traffic | None = Field(default=None, description="Traffic hint for the simulator.")
    pin: bool = Field(default=False, description="token-level: keep this model's weights resident on every "
                      "instance of its TP class from the start, never evicted (its switches cost nothing).")
    preload: bool = Field(default=False, description="token-level: copy this model's weights onto every instance of "
                          "its TP class at start (where they fit); evicted like any other later.")
    idle_ttl_s: PosFloat | None = Field(default=None, description="token-level: once no request for this model has "
                                        "arrived for this many seconds, it is not kept resident (freed at an "
                                        "instance's next weight change, not prefetched).")
    priority: Literal["high", "normal", "low"] = Field(
        default="normal", description="Scheduling class: a high-priority model's requests go ahead of normal ones "
                                      "that arrived up to half a TTFT SLO before them (low: behind), in prefill "
                                      "dispatch and decode turns (token-level), within the SLOs.")

    @model_validator(mode="after")
    def _check_controls(self) -> ModelEntry:
        if self.pin and self.idle_ttl_s is not None:
            raise ValueError(f"model {self.name!r}: pin and idle_ttl_s ({self.idle_ttl_s}) contradict each other: "
                             "a pinned model is never freed")
        return self

    @field_validator("arch", mode="before")
    @classmethod
    def _arch_from_catalogue(cls, value: object) -> object:
        if isinstance(value, str):
            key = value.strip().lower()
            if key not in ARCHS:
                close = sorted(k for k in ARCHS if k.split("-")[0] == key.split("-")[0])
                hint = f"; known {key.split('-')[0]} archs: {', '.join(close)}" if close else f"; known archs: {', '.join(sorted(ARCHS))}"
                raise ValueError(f"unknown arch {value!r}{hint}")
            return ARCHS[key]
        return value

    @model_validator(mode="before")
    @classmethod
    def _remember_arch_name(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("arch"), str) and not data.get("arch_name"):
            return {**data, "arch_name": data["arch"]}
        return data


class PoolSpec(_Frozen):
    """The shared pool the models run on."""

    gpu: str = Field(default="h20", description="GPU type: a key of the GPU catalogue or of the file's `gpus`.")
    num_gpus: PosInt = Field(default=8, description="GPUs in the pool.")
    prefill_fraction: Annotated[float, Field(gt=0, lt=1)] = Field(default=0.375, description="Share of token-level instances that prefill (the Aegaeon artifact runs 3 prefill + 5 decode per 8-GPU node).")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = Field(default=0.9, description="Share of device memory the pool may use.")
    host_kv_gb: PosFloat = Field(default=256.0, description="Host memory for swapped-out KV caches per node in GB.")
    gpus_per_node: PosInt = Field(default=8, description="GPUs per host (bounds tensor parallelism).")
    gpus_per_host_link: Annotated[int, Field(ge=0)] = Field(
        default=0, description="GPUs behind one host-to-device PCIe link, for the simulator: copies (weight switches, "
                               "prefetches, KV moves) that overlap on a link split its bandwidth. 1: every GPU has its "
                               "own link, shared by the instances on it and by one instance's overlapping copies; 2 or "
                               "more: that many consecutive GPUs share one (a PCIe switch's uplink). 0: copies are "
                               "never contended (each at the full link rate).")
    max_batch_size: PosInt = Field(default=256, description="Most requests decoded in one batch.")
    max_prefill_tokens: PosInt = Field(default=8192, description="Most prompt tokens prefilled in one step.")
    default_slo: Slo = Field(default_factory=Slo, description="SLOs for models that set none.")

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: object) -> object:
        if isinstance(data, dict) and "host_cache_gb" in data:
            raise ValueError(f"host_cache_gb ({data['host_cache_gb']!r}) is no longer read: nothing bounded the host "
                             "model cache by it (every served model's weights are held in host memory, and the "
                             "simulator charges no cache misses); remove the key")
        return data


class FleetProblem(ValueError):
    """Problems that need the whole fleet to see; each names its place (loc)."""

    def __init__(self, problems: list[tuple[tuple[str | int, ...], str]]):
        self.problems = problems
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems))


class Fleet(_Frozen):
    """models.yaml: the GPU catalogue additions, the models and the pool."""

    gpus: dict[str, GpuSpec] = Field(default_factory=dict, description="Extra or overriding GPU types, by lower-case name.")
    pool: PoolSpec = Field(default_factory=PoolSpec, description="The shared pool.")
    models: list[ModelEntry] = Field(min_length=1, description="The served models.")

    @model_validator(mode="after")
    def _check_whole(self) -> Fleet:
        problems = fleet_problems(self.pool, self.gpus, list(enumerate(self.models)))
        if problems:
            raise FleetProblem(problems)
        return self

    def gpu(self, name: str | None = None) -> GpuSpec:
        key = (name or self.pool.gpu).lower()
        if key in self.gpus:
            return self.gpus[key]
        return GPUS[key]

    def slo(self, model: ModelEntry) -> Slo:
        return model.slo or self.pool.default_slo

    def model(self, name: str) -> ModelEntry:
        for entry in self.models:
            if entry.name == name:
                return entry
        raise KeyError(name)


def fleet_problems(pool: PoolSpec, gpus: dict[str, GpuSpec],
                   models: list[tuple[int, ModelEntry]]) -> list[tuple[tuple[str | int, ...], str]]:
    """Checks that need more than one field: GPU known, names unique, TP fits.

    `models` pairs each entry with its index in the file, so a caller can run
    the checks over the entries that passed field validation.
    """
    problems: list[tuple[tuple[str | int, ...], str]] = []
    gpu_key = pool.gpu.lower()
    catalogue = {**GPUS, **gpus}
    if gpu_key not in catalogue:
        problems.append((("pool", "gpu"), f"unknown GPU {pool.gpu!r}; known: {', '.join(sorted(catalogue))}"))
        return problems
    if pool.gpus_per_host_link > pool.gpus_per_node:
        problems.append((("pool", "gpus_per_host_link"), f"{pool.gpus_per_host_link} GPUs per host link exceeds "
                         f"pool.gpus_per_node {pool.gpus_per_node}: a PCIe link does not span hosts"))
    usable = catalogue[gpu_key].memory_gb * GB * pool.gpu_memory_utilization
    seen: dict[str, int] = {}
    for index, entry in models:
        if entry.name in seen:
            problems.append((("models", index, "name"), f"duplicate model name {entry.name!r} (first at models[{seen[entry.name]}])"))
        seen.setdefault(entry.name, index)
        if entry.tp > pool.gpus_per_node:
            problems.append((("models", index, "tp"), f"tp {entry.tp} exceeds pool.gpus_per_node {pool.gpus_per_node}"))
        elif entry.tp > pool.num_gpus:
            problems.append((("models", index, "tp"), f"tp {entry.tp} exceeds pool.num_gpus {pool.num_gpus}"))
        per_gpu = entry.arch.weight_bytes / entry.tp
        if per_gpu > 0.9 * usable:
            need = math.ceil(entry.arch.weight_bytes / (0.9 * usable))
            problems.append((("models", index, "tp"),
                             f"tp {entry.tp} does not fit {entry.name!r} on {gpu_key}: {per_gpu / GB:.1f} GB of weights per GPU "
                             f"leaves too little of {usable / GB:.1f} GB usable for KV; use tp >= {need}"))
    return problems


def arch_from_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Map a Hugging Face config.json onto the Arch fields."""
    kind = str(cfg.get("model_type", "llama"))
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return {
        "family": kind,
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_heads": cfg["num_attention_heads"],
        "num_kv_heads": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        "head_dim": cfg.get("head_dim"),
        "intermediate_size": cfg.get("moe_intermediate_size") if experts else cfg["intermediate_size"],
        "vocab_size": cfg["vocab_size"],
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qkv_bias": kind == "qwen2" or bool(cfg.get("attention_bias", False)),
        "num_experts": experts,
        "experts_per_token": int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        "dtype": dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16",
        "max_context": cfg.get("max_position_embeddings", 32768),
    }


def hf_shape(arch: Arch) -> dict[str, Any]:
    """`arch`'s shape as the Hugging Face config keys every family's config class takes (what
    arch_from_hf_config reads back); family-specific keys (head_dim, attention_bias, rope ...) are the caller's."""
    return {"hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
            "intermediate_size": arch.intermediate_size, "vocab_size": arch.vocab_size,
            "tie_word_embeddings": arch.tie_embeddings}


def catalogue_arch(key: str) -> Arch:
    """The catalogue's architecture `key` (e.g. 'qwen2.5-7b')."""
    if key not in ARCHS:
        raise ValueError(f"unknown arch {key!r}; known archs: {', '.join(sorted(ARCHS))}")
    return Arch.model_validate(ARCHS[key])
