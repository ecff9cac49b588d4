"""One Ray actor per instance: it owns a device (or a CPU slot) and the engine on it."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pool.calls import EngineCall
from pool.engines.base import Engine
from pool.engines.timings import call_engine
from pool.heap import freeze_heap
from pool.placement import DEFAULT_TIMEOUT_S as DEFAULT_PLACEMENT_TIMEOUT_S
from pool.placement import Placements, rank_bundle


@dataclass(frozen=True)
class EngineSpec:
    """Which engine an instance runs and how it is sized (picklable; the engine is built in the actor)."""

    kind: str = "torch"  # torch | vllm | sim
    options: Mapping[str, Any] = field(default_factory=dict)


def make_engine(spec: EngineSpec, ranks: str = "processes") -> Engine:
    """The engine of `spec`; a torch engine of tp > 1 runs its other ranks as `ranks` (processes or ray)."""
    if spec.kind == "torch":
        from pool.engines.torch_engine import TorchEngine, TorchEngineConfig

        config = TorchEngineConfig(**spec.options)
        if config.tp > 1:
            from pool.engines.tp import TpEngine

            return TpEngine(config, ranks=ranks)
        return TorchEngine(config)
    if spec.kind == "vllm":
        from pool.engines import vllm_engine

        return vllm_engine.make_vllm_engine(spec.options)
    if spec.kind == "sim":
        from pool.engines.sim_engine import SimEngine

        return SimEngine(**spec.options)
    raise ValueError(f"unknown engine {spec.kind!r}; choose torch, vllm or sim")


BEAT_NAMESPACE = "modelpool-beats"  # Ray's internal key-value store: actor id -> its beat count


def beat_to_gcs(key: str, interval_s: float) -> None:
    """An actor's liveness thread (as `pool.procs` beats for a worker process): a count, one more every
    `interval_s`, under `key` in the cluster's key-value store, where the driver reads it from any node."""
    from ray.experimental import internal_kv

    count = 0
    while True:
        count += 1
        try:
            internal_kv._internal_kv_put(key, str(count), overwrite=True, namespace=BEAT_NAMESPACE)
        except Exception:  # noqa: BLE001 - the GCS briefly away: a missed beat, the driver judges
            pass
        time.sleep(interval_s)


class InstanceActor:
    """The engine behind one instance; `call` runs one engine call (calls run one at a time). With `beat_s`
    its process beats from a thread of its own (`beat_to_gcs`, keyed by its actor id)."""

    def __init__(self, instance_id: str, spec: EngineSpec, models: Mapping[str, str], threads: int = 1,
                 max_tokens: int | None = None, beat_s: float | None = None) -> None:
        if beat_s is not None:  # from the start: a slow load is alive too
            import threading

            import ray

            threading.Thread(target=beat_to_gcs, args=(ray.get_runtime_context().get_actor_id(), beat_s),
                             name="modelpool-beat", daemon=True).start()
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        try:
            import torch

            torch.set_num_threads(threads)
        except ImportError:
            pass
        self.instance_id = instance_id
        self.engine = make_engine(spec, ranks="ray")  # a TP instance's other ranks: actors in its placement group
        for name, path in models.items():
            self.engine.load(name, Path(path))
        self.engine.warm_up(max_tokens)  # decode graphs before serving: none is captured on the request path
        freeze_heap()  # start-up's objects out of the collector's way while serving

    def call(self, call: EngineCall) -> Any:
        return call_engine(self.engine, call)

    def ready(self) -> str:
        return self.instance_id

    def close(self) -> None:
        """Close the engine (a TP instance's rendezvous file goes with it) before the actor is killed."""
        self.engine.close()

    def node(self) -> str:
        """The id of the Ray node this instance runs on (`ray.nodes()`' NodeID)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


def start_actors(instances: Mapping[str, int], spec: EngineSpec, models: Mapping[str, str], *,
                 use_gpus: bool, threads: int = 1, timeout_s: float | None = None, gpu_share: float = 1.0,
                 max_tokens: int | None = None, placements: Placements | None = None,
                 placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S,
                 beat_s: float | None = None) -> dict[str, Any]:
    """One actor per instance id (value: its TP size); returns once every engine has loaded its models.

    Past `timeout_s` (None: no limit) the actors started are killed, their
    placement groups removed, and `TimeoutError` is raised: a restart must not
    wait for ever on a cluster that has no room left.

    An instance of TP size t > 1 gets a placement group of t bundles packed on
    one node (`pool.placement`), kept in `placements` (required then: the
    pool removes the group when the instance stops or restarts, and a group
    that cannot be placed within `placement_timeout_s` raises
    `PlacementTimeout`). Its actor sits in bundle 0, and the actors it starts
    (the engine's other ranks) are placed in the same group. The vLLM engine
    spreads the model over the group's GPUs; the torch engine's actor is its
    rank 0 and starts one rank actor in each other bundle (`pool.engines.tp`).
    A one-GPU instance asks for `gpu_share` of its GPU (0.5: two instances
    share one). With `beat_s` each actor beats (`InstanceActor`).
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if placements is None and any(tp > 1 for tp in instances.values()):
        raise ValueError("start_actors: tensor-parallel instances need `placements` to keep their placement groups")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    remote = ray.remote(InstanceActor)
    actors = {}
    try:
        for instance_id, tp in instances.items():
            rank = rank_bundle(use_gpus)
            options: dict[str, Any] = {"num_cpus": rank["CPU"], "max_restarts": 0,
                                       "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads),
                                                                    "TOKENIZERS_PARALLELISM": "false"}}}
            if use_gpus:
                options["num_gpus"] = gpu_share if tp == 1 else rank["GPU"]
            if tp > 1:
                assert placements is not None
                wait_s = placement_timeout_s if deadline is None else min(placement_timeout_s,
                                                                          max(0.0, deadline - time.monotonic()))
                group = placements.reserve(instance_id, tp, use_gpus=use_gpus, timeout_s=wait_s)
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
            engine = EngineSpec(spec.kind, {**spec.options, "tp": tp}) if spec.kind == "torch" and tp > 1 else spec
            actors[instance_id] = remote.options(**options).remote(instance_id, engine, dict(models), threads,
                                                                   max_tokens, beat_s)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ray.get([actor.ready.remote() for actor in actors.values()], timeout=left)  # type: ignore[attr-defined]
    except BaseException as exc:
        for actor in actors.values():
            ray.kill(actor)  # type: ignore[arg-type]
        for instance_id, tp in instances.items():
            if tp > 1 and placements is not None:
                placements.release(instance_id)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise TimeoutError(f"instances {sorted(actors)} did not start within {timeout_s} s") from None
        raise
    return actors
