"""One Ray actor per instance: it owns a device (or a CPU slot) and the engine on it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pool.engines.base import Engine


@dataclass(frozen=True)
class EngineSpec:
    """Which engine an instance runs and how it is sized (picklable; the engine is built in the actor)."""

    kind: str = "torch"  # torch | vllm | sim
    options: Mapping[str, Any] = field(default_factory=dict)


def make_engine(spec: EngineSpec) -> Engine:
    if spec.kind == "torch":
        from pool.engines.torch_engine import TorchEngine, TorchEngineConfig

        return TorchEngine(TorchEngineConfig(**spec.options))
    if spec.kind == "vllm":
        from pool.engines import vllm_engine

        return vllm_engine.make_vllm_engine(spec.options)
    if spec.kind == "sim":
        from pool.engines.sim_engine import SimEngine

        return SimEngine(**spec.options)
    raise ValueError(f"unknown engine {spec.kind!r}; choose torch, vllm or sim")


class InstanceActor:
    """The engine behind one instance; `call` runs one engine method (calls run one at a time)."""

    def __init__(self, instance_id: str, spec: EngineSpec, models: Mapping[str, str], threads: int = 1,
                 max_tokens: int | None = None) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        try:
            import torch

            torch.set_num_threads(threads)
        except ImportError:
            pass
        self.instance_id = instance_id
        self.engine = make_engine(spec)
        for name, path in models.items():
            self.engine.load(name, Path(path))
        warm_up = getattr(self.engine, "warm_up", None)
        if warm_up is not None:  # decode graphs before serving: none is captured on the request path
            warm_up(max_tokens)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def ready(self) -> str:
        return self.instance_id


def start_actors(instances: Mapping[str, int], spec: EngineSpec, models: Mapping[str, str], *,
                 use_gpus: bool, threads: int = 1, timeout_s: float | None = None, gpu_share: float = 1.0,
                 max_tokens: int | None = None) -> dict[str, Any]:
    """One actor per instance id (value: its GPU count); returns once every engine has loaded its models.

    Past `timeout_s` (None: no limit) the actors started are killed and
    `TimeoutError` is raised: a restart must not wait for ever on a cluster
    that has no room left.

    An instance of several GPUs (tensor parallel) gets a placement group of
    that many GPU bundles packed on one node, and its actor holds them all;
    the engine then spreads the model over them (the vLLM engine does; the
    torch engine runs one device per instance and refuses TP > 1). A one-GPU
    instance asks for `gpu_share` of its GPU (0.5: two instances share one).
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if spec.kind == "torch" and any(tp > 1 for tp in instances.values()):
        raise ValueError("the torch engine runs one device per instance; serve tensor-parallel models with --engine vllm")
    remote = ray.remote(InstanceActor)
    actors = {}
    for instance_id, num_gpus in instances.items():
        options: dict[str, Any] = {"num_cpus": 1 if not use_gpus else 0.5, "max_restarts": 0,
                                   "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads),
                                                                "TOKENIZERS_PARALLELISM": "false"}}}
        if use_gpus:
            options["num_gpus"] = num_gpus if num_gpus > 1 else gpu_share
            if num_gpus > 1:
                group = placement_group([{"GPU": 1, "CPU": 0.5}] * num_gpus, strategy="STRICT_PACK")
                ray.get(group.ready())
                options["num_gpus"] = 1  # the actor's own bundle; the engine's workers take the rest
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        actors[instance_id] = remote.options(**options).remote(instance_id, spec, dict(models), threads, max_tokens)
    try:
        ray.get([actor.ready.remote() for actor in actors.values()], timeout=timeout_s)  # type: ignore[attr-defined]
    except ray.exceptions.GetTimeoutError:
        for actor in actors.values():
            ray.kill(actor)  # type: ignore[arg-type]
        raise TimeoutError(f"instances {sorted(actors)} did not start within {timeout_s} s") from None
    return actors
