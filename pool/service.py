"""The live pool: instances on Ray (or in-process), the controller loop on its own thread.

`LivePool.submit()` and `cancel()` are thread-safe and return at once; tokens
reach each request's `sink` from the loop thread (the gateway hops them onto
its event loop). The loop is the reconcile tick: drain submissions and
cancels -> collect finished engine calls -> `schedule(now)` -> carry the Plan
out; an exception in a tick is logged and the loop goes on.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pool.actor import EngineSpec, make_engine, start_actors
from pool.backends import InProcessBackend, RayBackend
from pool.clock import MonotonicClock
from pool.controller import Controller
from pool.engines.base import SamplingParams, TokenOut
from pool.runner import LiveRequest
from scheduler import CostModel, InstanceSpec, ModelProfile, make_scheduler
from scheduler.fleet import Arch, arch_from_hf_config

log = logging.getLogger("modelpool.pool")


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


class PoolClosed(RuntimeError):
    """The pool is not running (not started, stopping, or its loop died)."""


class LivePool:
    def __init__(self, models: Sequence[ServedModel], instances: Sequence[InstanceSpec], policy: str,
                 costs: CostModel, *, engine: EngineSpec | None = None, backend: str = "ray",
                 address: str | None = None, policy_options: Mapping[str, Any] | None = None,
                 plan_log: IO[str] | None = None, poll_s: float = 0.002) -> None:
        self.models = {m.name: m for m in models}
        self.instances = list(instances)
        self.policy = policy
        self.costs = costs
        self.engine = engine or EngineSpec()
        self.backend_kind = backend
        self.address = address
        self.policy_options = dict(policy_options or {})
        self.plan_log = plan_log
        self.poll_s = poll_s
        self.clock = MonotonicClock()
        self.controller: Controller | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._held: list[tuple[str, Any]] = []  # taken off the inbox while waiting, handled first
        self._thread: threading.Thread | None = None
        self._running = False
        self._status: dict[str, Any] = {}
        self._actors: dict[str, Any] = {}
        self.num_tick_errors = 0

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> LivePool:
        paths = {name: str(m.path) for name, m in self.models.items()}
        ids = [spec.instance_id for spec in self.instances]
        if self.backend_kind == "ray":
            import ray

            if not ray.is_initialized():
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                         ignore_reinit_error=True)
            gpus = float(ray.cluster_resources().get("GPU", 0))
            self._actors = start_actors({spec.instance_id: spec.tp for spec in self.instances}, self.engine, paths,
                                        use_gpus=gpus > 0)
            backend: Any = RayBackend(self._actors)
        else:
            engines = {}
            for iid in ids:
                engines[iid] = make_engine(self.engine)
                for name, path in paths.items():
                    engines[iid].load(name, Path(path))
            backend = InProcessBackend(engines)
        scheduler = make_scheduler(self.policy, {n: m.profile for n, m in self.models.items()}, self.instances,
                                   self.costs, **self.policy_options)
        self.controller = Controller(scheduler, backend, self.clock, ids, plan_log=self.plan_log)
        self._backend = backend
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="modelpool-controller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._running = False
        if self._thread is not None:
            self._inbox.put(("wake", None))
            self._thread.join(timeout=10)
        for actor in self._actors.values():
            import ray

            ray.kill(actor)
        self._actors = {}

    def __enter__(self) -> LivePool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- requests (thread-safe) -----------------------------------------------------------
    def submit(self, request_id: str, model: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
               sink: Callable[[TokenOut | BaseException], None]) -> None:
        if not self._running:
            raise PoolClosed("the pool is not running")
        if model not in self.models:
            raise KeyError(model)
        live = LiveRequest(request_id, model, list(prompt_token_ids), sampling, self.clock.now(), sink=sink)
        self._inbox.put(("submit", live))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def kill_instance(self, instance_id: str) -> None:
        """Fault injection: kill an instance's actor (its requests resume elsewhere)."""
        import ray

        ray.kill(self._actors[instance_id], no_restart=True)

    def status(self) -> dict[str, Any]:
        return dict(self._status)

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        assert self.controller is not None
        controller = self.controller
        while self._running:
            try:
                changed = self._drain(controller)
                for handle, result in self._backend.poll(0.0 if changed else self.poll_s):
                    changed |= controller.complete(handle, result)
                controller.tick()
                self._status = self._snapshot(controller)
                if not changed and not getattr(self._backend, "in_flight", 0):
                    self._wait_inbox()
            except Exception:  # one bad tick must not take the pool down
                self.num_tick_errors += 1
                log.exception("controller tick failed")
                time.sleep(self.poll_s)

    def _drain(self, controller: Controller) -> bool:
        changed = False
        while True:
            if self._held:
                kind, item = self._held.pop(0)
            else:
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    return changed
            changed = True
            if kind == "submit":
                item.arrival_at = self.clock.now()
                try:
                    controller.submit(item)
                except ValueError as exc:
                    item.sink(exc)
            elif kind == "cancel":
                controller.cancel(item)
            else:
                changed = False

    def _wait_inbox(self) -> None:
        try:
            self._held.append(self._inbox.get(timeout=0.05))
        except queue.Empty:
            return

    def _snapshot(self, controller: Controller) -> dict[str, Any]:
        sched: Any = controller.scheduler
        instances = {}
        for iid, inst in sched.instances.items():
            instances[iid] = {"role": inst.spec.role, "tp": inst.spec.tp, "active_model": inst.active,
                              "prefetched_model": inst.prefetched, "busy": bool(inst.inflight), "lost": inst.lost,
                              "kv_used_bytes": inst.kv_used_bytes, "kv_capacity_bytes": inst.kv_capacity_bytes,
                              "requests_on_device": len(inst.on_device)}
        return {"policy": self.policy, "instances": instances,
                "queues": {m: len(q) for m, q in sched.queues.items()},
                "requests_in_pool": len(controller.requests), "plans": controller.num_plans,
                "tick_errors": self.num_tick_errors}
