"""The models a pool serves: each one's folder and scheduler profile, how clients see it, and its tokenizer.

`served_model` reads a local folder's config.json into the `ModelProfile` the
scheduler plans with; `slot_instances` sizes instances to hold the models, and
`plan_kv` gives them (and the profiles) the KV their engines report;
`model_infos` gives what the gateway tells clients (the longest request each
model takes, its vocabulary), and `load_tokenizer` the gateway's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pool.engines.base import KvCapacity
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
                   prefix: str = "slot", tp: int = 1, weights_bytes: int | None = None) -> list[InstanceSpec]:
    """Instances on CPU slots (or single GPUs; `tp` of either each) whose engines hold `kv_bytes` of KV and
    `weights_bytes` of model memory (None: two model slots of the largest model), over all their ranks.

    The KV the scheduler plans with is not this configured figure but what
    each engine reports once started (`plan_kv`, in `LivePool.start`).
    """
    memory = kv_bytes + (weights_bytes if weights_bytes is not None else 2 * max(m.profile.weight_bytes for m in models))
    return [InstanceSpec(f"{prefix}{k}", tp, memory, (roles[k] if roles else "mixed"))  # type: ignore[arg-type]
            for k in range(num)]


def plan_kv(instances: Sequence[InstanceSpec], profiles: Mapping[str, ModelProfile],
            reports: Mapping[str, KvCapacity]) -> tuple[list[InstanceSpec], dict[str, ModelProfile]]:
    """The instances and model profiles the scheduler plans with, given each instance's engine report.

    The scheduler counts a request's KV as `kv_bytes_per_token` times its
    tokens in whole blocks (`kv_block_tokens`) against one budget per
    instance (`InstanceSpec.kv_bytes`). The budget is the least any model's
    report allows, `tokens * kv_bytes_per_token`, so every mix of requests the
    scheduler admits is one the engine promised to hold (`KvCapacity`); the
    block is the largest any instance reports for the model. The host KV
    budget (`host_kv_bytes`, for what swapped-out requests hold) is counted
    the same way from the report's `host_tokens`. Where the engine reports the device memory it holds weights
    in (`weight_bytes`) and each model's bytes there, those are the weight budget (`InstanceSpec.weight_bytes`)
    and the model sizes the scheduler plans resident sets with: a set it plans is one the engine holds.
    """
    planned = []
    for spec in instances:
        report = reports.get(spec.instance_id)
        if report is None:
            raise ValueError(f"instance {spec.instance_id!r}: its engine reported no KV capacity")
        missing = sorted(set(profiles) - set(report.tokens))
        if missing:
            raise ValueError(f"instance {spec.instance_id!r}: its engine reports no KV for {missing} "
                             f"(it has {sorted(report.tokens)})")
        budget = min(report.tokens[name] * max(1, p.kv_bytes_per_token) for name, p in profiles.items())
        host = None if report.host_tokens is None else float(min(
            report.host_tokens.get(name, 0) * max(1, p.kv_bytes_per_token) for name, p in profiles.items()))
        weights = None if report.weight_bytes is None else float(report.weight_bytes)
        planned.append(dataclasses.replace(spec, kv_bytes=float(budget), host_kv_bytes=host, weight_bytes=weights))
    blocks = {name: max(reports[s.instance_id].block_tokens[name] for s in instances) for name in profiles}
    sizes = {name: max((float(r.model_bytes[name]) for r in reports.values() if r.model_bytes and name in r.model_bytes),
                       default=p.weight_bytes) for name, p in profiles.items()}
    return planned, {name: dataclasses.replace(p, kv_block_tokens=blocks[name], weight_bytes=sizes[name])
                     for name, p in profiles.items()}


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
        tokens = int(scheduler.kv_room(model.name) // profile.kv_bytes_per_token)
        length = min(length, tokens // profile.kv_block_tokens * profile.kv_block_tokens)
    cfg = _read_config(model.path)
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if isinstance(window, int) and window > 0:
        length = min(length, window)
    return max(0, length)
