"""The models a pool serves: each one's folder and scheduler profile, how clients see it, and its tokenizer.

`served_model` reads a local folder's config.json into the `ModelProfile` the
scheduler plans with; `slot_instances` sizes instances to hold the models;
`model_infos` gives what the gateway tells clients (the longest request each
model takes, its vocabulary), and `load_tokenizer` the gateway's tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler import InstanceSpec, ModelProfile, Scheduler
from scheduler.fleet import Arch, arch_from_hf_config


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: Path
    profile: ModelProfile


def served_model(name: str, path: Path, *, ttft_s: float = 10.0, tpot_s: float = 0.1, tp: int = 1,
                 dtype: str | None = None) -> ServedModel:
    """A local model folder as the scheduler sees it (sizes from its config.json)."""
    config = json.loads((Path(path) / "config.json").read_text())
    fields = arch_from_hf_config(config)
    if dtype:
        fields["dtype"] = dtype
    arch = Arch.model_validate(fields)
    profile = ModelProfile(name, tp, arch.weight_bytes, arch.kv_bytes_per_token, arch.max_context, ttft_s, tpot_s)
    return ServedModel(name, Path(path), profile)


def slot_instances(num: int, models: Sequence[ServedModel], kv_bytes: int, roles: Sequence[str] | None = None,
                   prefix: str = "slot") -> list[InstanceSpec]:
    """Instances on CPU slots (or single GPUs) whose engines hold `kv_bytes` of KV and two model slots.

    The scheduler is told 90% of the engine's KV so block rounding in the
    engine never meets a request the scheduler thought would fit.
    """
    biggest = max(m.profile.weight_bytes for m in models)
    memory = 0.9 * kv_bytes + 2 * biggest
    return [InstanceSpec(f"{prefix}{k}", 1, memory, (roles[k] if roles else "mixed"))  # type: ignore[arg-type]
            for k in range(num)]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A served model as clients see it."""

    name: str
    path: Path
    max_model_len: int  # prompt + output tokens one request may hold
    vocab_size: int


def model_infos(models: Mapping[str, ServedModel], scheduler: Scheduler | None) -> list[ModelInfo]:
    """Every model with the longest request it can take: its context, cut to what `scheduler` (None: not
    started) gives one request in KV and to a sliding window."""
    return [ModelInfo(name, m.path, _max_model_len(m, scheduler), _vocab_size(m.path)) for name, m in models.items()]


def load_tokenizer(path: Path, engine_kind: str) -> Any:
    """The tokenizer of the model folder at `path`; under the sim engine a placeholder when it has none."""
    if engine_kind == "sim":
        from pool.engines.sim_engine import load_tokenizer_or_placeholder

        return load_tokenizer_or_placeholder(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


def _vocab_size(path: Path) -> int:
    return int(_read_config(path).get("vocab_size") or 0)


def _max_model_len(model: ServedModel, scheduler: Scheduler | None) -> int:
    """The context, cut to the KV one instance can give a request and to a sliding window (unsupported)."""
    profile = model.profile
    length = profile.max_context
    if scheduler is not None and profile.kv_bytes_per_token > 0:
        length = min(length, int(scheduler.kv_room(model.name) // profile.kv_bytes_per_token))
    cfg = _read_config(model.path)
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if isinstance(window, int) and window > 0:
        length = min(length, window)
    return max(0, length)
