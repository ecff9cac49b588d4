"""The live pool: instances on Ray (or in-process), the controller loop on its own thread.

`LivePool.submit()` and `cancel()` are thread-safe and return at once; tokens
reach each request's `sink` from the loop thread (the gateway hops them onto
its event loop). The loop is the reconcile tick: drain submissions and
cancels -> collect finished engine calls -> `schedule(now)` -> carry the Plan
out; an exception in a tick is logged and the loop goes on.

A lost instance (its actor died, an engine call failed, one got no answer
within `call_timeout_s`, or it missed its heartbeat: `heartbeat_timeout_s`,
mid-call included on the processes and Ray backends) is restarted with a
fresh engine up to `max_restarts` times (`pool.restarts`); its requests wait
in the scheduler's queue and resume from prompt plus generated tokens, on
another instance or the restarted one. When no instance of a request's TP is
left or coming back, the request ends with a clean `RequestFailed`. `stop()`
ends every request still in the pool with `PoolClosed`, frees its KV in the
scheduler and kills the actors; `start()` may then run the pool again, and
`abort_all()` ends every request at once (a gateway shutting down).

Admission is bounded: `max_queued_per_model` requests of one model may wait
for their first token (`QueueFull` beyond that: HTTP 429) and
`max_requests` may be in the pool at once (`PoolBusy`: HTTP 503). The pool
counts every request it holds (queued, running) for the gateway's gauges,
tallies the Plans' model switches, and asks every engine for its `stats()`
every `stats_interval_s` through the same backend, so /pool/status and
/metrics read one snapshot the loop refreshes (every 2 s by default: a
stats() call is a call in the engine's own order, and a loaded torch engine's
took 10 ms of its decode steps' time on the H200, its timing summaries
included).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pool.actor import EngineSpec, make_engine, start_actors
from pool.placement import Placements
from pool.backends import InProcessBackend, RayBackend, ThreadBackend
from pool.procs import ProcessBackend, start_workers
from pool import calls
from pool.clock import MonotonicClock
from pool.config import PoolConfig
from pool.controller import Controller
from pool.engines.base import Engine, KvCapacity, SamplingParams, TokenOut
from pool.engines.tp_files import sweep_dead
from pool.errors import InstanceDied, PoolBusy, PoolClosed, QueueFull
from pool.inbox import Cancel, InboxMessage, Restored, Submit, Wake
from pool.restarts import Restarts
from pool.runner import LiveRequest
from pool.served import (ModelInfo, ServedModel, load_tokenizer, model_infos, plan_kv, served_model,
                         slot_instances)
from scheduler import (CostModel, InstanceSpec, Plan, SwapIn, SwapOut, Switch, make_scheduler, resident_after,
                       staging_instances)

# the served-model helpers lived here before pool.served; callers may still import them from pool.service
__all__ = ["LivePool", "ModelInfo", "PoolBusy", "PoolClosed", "QueueFull", "ServedModel", "served_model",
           "slot_instances"]

log = logging.getLogger("modelpool.pool")

TICK_FALLBACK_S = 0.05  # schedule() at least this often with nothing new (call timeouts, time-based decisions)
RETIRE_GRACE_S = 2.0  # a lost engine's process may close itself this long before it is killed
STATUS_INTERVAL_S = 0.01  # /pool/status is refreshed this often while the pool is busy


@dataclass(slots=True)
class _Tracked:
    model: str
    sink: Callable[[TokenOut | BaseException], None]
    started: bool = False  # its first token is out


class LivePool:
    """The pool serving `models` on `instances` under `policy` (`costs` its cost model), set up by `config`;
    `plan_log`, when given, gets every Plan as a JSON line."""

    def __init__(self, models: Sequence[ServedModel], instances: Sequence[InstanceSpec], policy: str,
                 costs: CostModel, config: PoolConfig | None = None, *, plan_log: IO[str] | None = None) -> None:
        self.config = config = config or PoolConfig()
        self.models = {m.name: m for m in models}
        self.instances = list(instances)
        self.planned_instances = self.instances  # as the scheduler sees them: with the KV the engines report (start)
        self.policy = policy
        self.costs = costs
        self.plan_log = plan_log
        # decode graphs are captured ahead for requests up to the longest context served (by every instance:
        # prefill instances decode the first tokens before a hand-off)
        self.max_tokens = max((m.profile.max_context for m in models), default=None)
        self.clock = MonotonicClock()
        self.controller: Controller | None = None
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._held: list[InboxMessage] = []  # taken off the inbox while waiting, handled first
        self._thread: threading.Thread | None = None
        self._running = False
        self._epoch = 0  # bumped by each start(): threads of an earlier run see they are stale
        self._status: dict[str, Any] = {}
        self._actors: dict[str, Any] = {}
        self.nodes: dict[str, str] = {}  # instance id -> the Ray node its actor runs on (Ray backend)
        self._use_gpus = False
        self._placements = Placements()  # this run's TP placement groups (a new set per start())
        self.restarts = self._restarts()
        self.num_tick_errors = 0
        # admission and accounting (the lock guards these; sinks run outside it)
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}
        self._queued: Counter[str] = Counter()
        self._running_by_model: Counter[str] = Counter()
        self.num_rejected: Counter[tuple[str, str]] = Counter()  # (model, reason) -> count
        # what the Plans and the engines report (written by the loop thread)
        self.num_switches: Counter[tuple[str, str]] = Counter()  # (instance, model) -> Switch actions planned
        # plans that changed the models an instance computes with (scheduler.instance.resident_after), and those
        self.num_model_switches = 0
        self._resident: dict[str, frozenset[str]] = {}
        self.num_kv_moves: Counter[str] = Counter()  # 'swap_out' / 'swap_in' -> requests moved
        self.recent_switches: deque[dict[str, Any]] = deque(maxlen=config.num_recent_switches)
        self.engine_stats: dict[str, dict[str, Any]] = {}
        self._stats_calls: dict[int, str] = {}  # backend handle -> instance of a stats() call in flight
        self._heartbeat_from: dict[str, float] = {}  # instance -> since when its stats() answer is due (idle)
        self.num_missed_heartbeats = 0
        self._stats_at = float("-inf")
        self._status_at = float("-inf")
        self._tick_at = float("-inf")
        self._infos: list[ModelInfo] = []
        self._tokenizers: dict[str, Any] = {}
        self._tokenizer_lock = threading.Lock()

    # ---- life cycle -------------------------------------------------------------------
    def start(self) -> LivePool:
        """Start (or, after `stop()`, restart) the instances and the loop; returns once every engine is up."""
        if self.ready:
            raise RuntimeError("the pool is running already")
        ids = [spec.instance_id for spec in self.instances]
        self._epoch += 1
        self._inbox, self._held, self._stats_calls, self.engine_stats = queue.SimpleQueue(), [], {}, {}
        self._heartbeat_from = {}
        self._stats_at = float("-inf")
        self._placements = Placements()
        self.restarts = self._restarts()
        backend = self._start_backend(ids)
        # the scheduler plans with the KV each engine reports, not the configured figure (block and slab rounding)
        self.planned_instances, profiles = plan_kv(self.instances, {n: m.profile for n, m in self.models.items()},
                                                   self._kv_reports(backend, ids))
        scheduler = make_scheduler(self.policy, profiles, self.planned_instances, self.costs,
                                   **{"keep_ended": False, **self.config.policy_options})  # hold live requests only
        self._infos = model_infos({n: dataclasses.replace(m, profile=profiles[n]) for n, m in self.models.items()},
                                  scheduler)
        self.controller = Controller(scheduler, backend, self.clock, ids, plan_log=self.plan_log,
                                     call_timeout_s=self.config.call_timeout_s)
        self._backend = backend
        self._running = True
        self._status = self._snapshot(self.controller)
        self._thread = threading.Thread(target=self._loop, args=(self._epoch,), name="modelpool-controller",
                                        daemon=True)
        self._thread.start()
        return self

    def _start_backend(self, ids: Sequence[str]) -> Any:
        """The config's backend with every instance's engine started (Ray actors, processes or engines here)."""
        if self.config.backend == "ray":
            import ray

            if not ray.is_initialized():
                # an embedded cluster counts a CPU per instance rank at least (a TP instance's ranks are actors)
                ranks = sum(spec.tp for spec in self.instances)
                cpus = None if self.config.address else max(os.cpu_count() or 1, ranks)
                ray.init(address=self.config.address, include_dashboard=False, log_to_driver=False,
                         ignore_reinit_error=True, num_cpus=cpus)
            self._use_gpus = float(ray.cluster_resources().get("GPU", 0)) > 0
            self._actors = start_actors({spec.instance_id: spec.tp for spec in self.instances}, self._ray_engine(),
                                        self._paths(), use_gpus=self._use_gpus, gpu_share=self.config.gpu_share,
                                        max_tokens=self.max_tokens, placements=self._placements,
                                        placement_timeout_s=self.config.placement_timeout_s,
                                        beat_s=self.config.heartbeat_interval_s)
            self.nodes = dict(zip(self._actors, ray.get([actor.node.remote() for actor in self._actors.values()])))
            return RayBackend(self._actors)
        if self.config.backend == "processes":
            return ProcessBackend(start_workers({iid: self._engine_spec(iid) for iid in ids}, self._paths(),
                                                max_tokens=self.max_tokens, beat_s=self.config.heartbeat_interval_s))
        engines = {iid: self._new_engine(iid) for iid in ids}
        return InProcessBackend(engines) if self.config.backend == "inprocess" else ThreadBackend(engines)

    def _kv_reports(self, backend: Any, ids: Sequence[str], timeout_s: float = 600.0) -> dict[str, KvCapacity]:
        """Every engine's `kv_capacity()`, asked through the backend before the loop runs."""
        handles = {backend.call(iid, calls.GetKvCapacity()): iid for iid in ids}
        reports: dict[str, KvCapacity] = {}
        deadline = time.monotonic() + timeout_s
        while handles:
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances {sorted(handles.values())} did not report their KV within {timeout_s} s")
            for handle, result in backend.poll(0.05):
                iid = handles.pop(handle, None)
                if iid is None:
                    continue
                if isinstance(result, BaseException):
                    raise RuntimeError(f"instance {iid}: kv_capacity() failed: {result!r}") from result
                reports[iid] = result
        return reports

    def stop(self) -> None:
        """Stop the loop and the instances; requests still in the pool end with `PoolClosed`, their KV freed."""
        with self._lock:  # a restart finishing now sees this under the same lock (`_rebuilt`)
            self._running = False
        self.restarts.close()
        if self._thread is not None:
            self._inbox.put(Wake())
            self._thread.join(timeout=10)
        close = getattr(getattr(self, "_backend", None), "close", None)
        if close is not None:
            close()
        with self._lock:
            actors, self._actors = list(self._actors.values()), {}
        if actors:
            import ray

            # engines closed first where they answer (a TP instance's files go with it), then the actors killed;
            # a lost actor's close fails at once, a hung one's is waited for 5 s at most
            ray.wait([actor.close.remote() for actor in actors], num_returns=len(actors), timeout=5)
            for actor in actors:
                ray.kill(actor)
        self._placements.close()  # the TP instances' groups (their actors are gone already)
        sweep_dead()  # the rendezvous files of TP instances killed earlier on this machine
        with self._lock:
            orphans = list(self._tracked.values())
            self._tracked.clear()
            self._queued.clear()
            self._running_by_model.clear()
        if self.controller is not None and (self._thread is None or not self._thread.is_alive()):
            self.controller.close("the pool stopped")
            self.engine_stats = {}  # those engines are gone
            self._status = self._snapshot(self.controller)
        for tracked in orphans:
            _call_sink(tracked.sink, PoolClosed("the pool stopped before the request finished"))

    def abort_all(self, reason: str) -> int:
        """End every request in the pool now with `PoolClosed(reason)` (their KV is freed at the next step
        boundary); returns how many there were. The pool keeps running."""
        with self._lock:
            ended = list(self._tracked.items())
            self._tracked.clear()
            self._queued.clear()
            self._running_by_model.clear()
        for request_id, tracked in ended:
            self._inbox.put(Cancel(request_id))
            _call_sink(tracked.sink, PoolClosed(reason))
        return len(ended)

    def __enter__(self) -> LivePool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def ready(self) -> bool:
        """True while the loop runs and takes requests."""
        return self._running and self._thread is not None and self._thread.is_alive()

    def unservable_models(self, *, now: bool) -> list[str]:
        """Models no instance can serve: with `now`, none is up this moment; else none is up or coming back (a
        restart under way or budget left to start one). Every model while the pool does not run."""
        if not self.ready or self.controller is None:
            return sorted(self.models)
        lost, restarts = set(self.controller.lost), self.restarts
        coming = {iid for iid in lost if iid in restarts.pending or restarts.budget_left(iid) > 0}
        out = []
        for name, model in self.models.items():
            roles = {spec.role for spec in self.instances if spec.tp == model.profile.tp
                     and (spec.instance_id not in lost or (not now and spec.instance_id in coming))}
            if not ({"prefill", "mixed"} & roles and {"decode", "mixed"} & roles):
                out.append(name)
        return out

    # ---- what is served ---------------------------------------------------------------------
    def model_infos(self) -> list[ModelInfo]:
        """Every served model with the longest request it can take (context, KV room, sliding window)."""
        if not self._infos:  # not started: the context alone
            return model_infos(self.models, None)
        return list(self._infos)

    def tokenizer(self, model: str) -> Any:
        """`model`'s tokenizer for this process (loaded once; the engines keep their own copies)."""
        with self._tokenizer_lock:
            if model not in self._tokenizers:
                if model not in self.models:
                    raise KeyError(model)
                self._tokenizers[model] = load_tokenizer(self.models[model].path, self.config.engine.kind)
            return self._tokenizers[model]

    # ---- requests (thread-safe) -----------------------------------------------------------
    def submit(self, request_id: str, model: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
               sink: Callable[[TokenOut | BaseException], None]) -> None:
        """Queue a request; `sink` gets every token (from the loop thread), or one exception.

        Raises PoolClosed, KeyError (unknown model), ValueError (duplicate
        id), PoolBusy or QueueFull at once; nothing is queued then.
        """
        with self._lock:
            if not self.ready:
                raise PoolClosed("the pool is not running")
            if model not in self.models:
                raise KeyError(model)
            if request_id in self._tracked:
                raise ValueError(f"request id {request_id!r} is already in the pool")
            if self.config.max_requests is not None and len(self._tracked) >= self.config.max_requests:
                self.num_rejected[(model, "pool_full")] += 1
                raise PoolBusy(f"the pool holds {len(self._tracked)} requests, its limit", self.config.retry_after_s)
            max_queued = self.config.max_queued_per_model
            if max_queued is not None and self._queued[model] >= max_queued:
                self.num_rejected[(model, "queue_full")] += 1
                raise QueueFull(model, f"{self._queued[model]} requests of {model!r} are waiting already, "
                                       "its queue limit", self.config.retry_after_s)
            self._tracked[request_id] = _Tracked(model, sink)
            self._queued[model] += 1
        live = LiveRequest(request_id, model, list(prompt_token_ids), sampling, self.clock.now(),
                           sink=lambda item: self._on_output(request_id, item))
        self._inbox.put(Submit(live))
        self._wake()

    def cancel(self, request_id: str) -> bool:
        """Abort a request: no more tokens reach its sink; its KV is freed at the next step boundary."""
        with self._lock:
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self._forget(tracked)
        self._inbox.put(Cancel(request_id))
        self._wake()
        return tracked is not None

    def _wake(self) -> None:
        """End the loop's wait for engine answers, where its backend can (threads, processes): a request that
        arrives while an engine call runs is planned now, not once that call answers or the poll times out (up to
        `poll_s`: on a busy pool every arrival waited for the next engine answer)."""
        wake = getattr(getattr(self, "_backend", None), "wake", None)
        if wake is not None:
            wake()

    def holds(self, request_id: str) -> bool:
        """True while the request is in the pool (submitted, not yet ended)."""
        with self._lock:
            return request_id in self._tracked

    def load(self) -> dict[str, tuple[int, int]]:
        """model -> (requests waiting for their first token, requests generating)."""
        with self._lock:
            return {name: (self._queued[name], self._running_by_model[name]) for name in self.models}

    def actors(self) -> dict[str, Any]:
        """instance id -> its Ray actor handle now (empty for the in-process backends and once stopped)."""
        with self._lock:
            return dict(self._actors)

    def kill_instance(self, instance_id: str) -> None:
        """Fault injection: kill an instance's actor, or in-process engine (its requests resume elsewhere, or
        there once restarted)."""
        if self.config.backend != "ray":
            self._backend.kill(instance_id)
            return
        import ray

        ray.kill(self._actors[instance_id], no_restart=True)

    # ---- restarts -------------------------------------------------------------------------
    def _paths(self) -> dict[str, str]:
        return {name: str(m.path) for name, m in self.models.items()}

    def _engine_spec(self, instance_id: str) -> EngineSpec:
        """The engine of one instance: the pool's, on the instance's device, at its tp (torch: ranks)."""
        engine = self.config.engine
        if engine.kind != "torch":
            return engine
        options = dict(engine.options)
        if self.config.devices.get(instance_id):
            options["device"] = self.config.devices[instance_id]
        if options.get("handoff_bytes") and instance_id not in self._staging():
            options["handoff_bytes"] = 0  # its hand-offs go through host memory (an arena on its GPU serves nobody)
        tp = next(spec.tp for spec in self.instances if spec.instance_id == instance_id)
        if tp > 1:
            options["tp"] = tp
        return EngineSpec(engine.kind, options)

    def _ray_engine(self) -> EngineSpec:
        """The one engine every Ray actor gets: Ray places the actors on GPUs itself, so they stage hand-offs in
        device memory only where the pool has a single GPU (where the staging rule holds whatever Ray does)."""
        engine = self.config.engine
        if not engine.options.get("handoff_bytes") or (len(set(self.config.devices.values())) <= 1 and self._staging()):
            return engine
        return EngineSpec(engine.kind, {**engine.options, "handoff_bytes": 0})

    def _staging(self) -> set[str]:
        """The instances whose engines stage hand-offs in device memory (scheduler.instance.staging_instances:
        prefill instances on the device of every decode instance), as the simulator charges them."""
        device = self.config.engine.options.get("device")
        return staging_instances({spec.instance_id: spec.role for spec in self.instances},
                                 {spec.instance_id: (self.config.devices.get(spec.instance_id, device),)
                                  for spec in self.instances})

    def _new_engine(self, instance_id: str) -> Engine:
        """An engine with every model loaded and its decode graphs captured (outside any backend call)."""
        engine = make_engine(self._engine_spec(instance_id))
        for name, path in self._paths().items():
            engine.load(name, Path(path))
        engine.warm_up(self.max_tokens)
        return engine

    def _rebuild(self, instance_id: str, placements: Placements) -> Any:
        """A fresh engine for `instance_id` (on a restart thread), built once the lost one has freed its
        device memory: a new worker (thread or process) or actor, the old one stopped or killed first (and a
        TP instance's placement group replaced in `placements`, its run's)."""
        if self.config.backend != "ray":
            retire = getattr(self._backend, "retire", None)
            # a short grace, then the kill: a lost engine's state is not trusted, and a hung one never answers
            # (waiting up to 60 s for it made a replacement after a hang take 81 s)
            if retire is not None and not retire(instance_id, timeout_s=min(RETIRE_GRACE_S, self.config.restart_timeout_s)):
                log.warning("instance %s: the lost engine is still in a call; its memory is not free yet", instance_id)
            if self.config.backend == "processes":
                return start_workers({instance_id: self._engine_spec(instance_id)}, self._paths(),
                                     max_tokens=self.max_tokens, timeout_s=self.config.restart_timeout_s,
                                     beat_s=self.config.heartbeat_interval_s)[instance_id]
            return self._new_engine(instance_id)
        import ray

        old = self._actors.get(instance_id)
        if old is not None:
            ray.kill(old, no_restart=True)  # an engine error leaves it alive; its device slot is needed
        tp = next(spec.tp for spec in self.instances if spec.instance_id == instance_id)
        actor = start_actors({instance_id: tp}, self._ray_engine(), self._paths(), use_gpus=self._use_gpus,
                             gpu_share=self.config.gpu_share, max_tokens=self.max_tokens,
                             timeout_s=self.config.restart_timeout_s, placements=placements,
                             placement_timeout_s=self.config.placement_timeout_s,
                             beat_s=self.config.heartbeat_interval_s)[instance_id]
        try:
            self.nodes[instance_id] = ray.get(actor.node.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - it answered ready() a moment ago; the loop finds out if it is gone
            log.warning("instance %s: could not ask its actor for its node", instance_id, exc_info=True)
        return actor

    def _restarts(self) -> Restarts:
        epoch, placements = self._epoch, self._placements
        return Restarts(lambda iid: self._rebuild(iid, placements),
                        lambda iid, replacement: self._rebuilt(iid, replacement, epoch), self.config.max_restarts,
                        window_s=self.config.restart_window_s)

    def _rebuilt(self, instance_id: str, replacement: Any, epoch: int) -> None:
        """A restart thread's outcome: to the loop of the run it was started for, or (stale) away."""
        is_actor = self.config.backend == "ray" and not isinstance(replacement, BaseException)
        with self._lock:
            current = self._running and epoch == self._epoch
            if current and is_actor:
                self._actors[instance_id] = replacement  # stop() kills it from here on
        if current:
            self._inbox.put(Restored(instance_id, replacement))
        elif is_actor:
            import ray

            ray.kill(replacement)

    def status(self) -> dict[str, Any]:
        return dict(self._status)

    def _on_output(self, request_id: str, item: TokenOut | BaseException) -> None:
        with self._lock:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                return  # cancelled (or ended) already: late tokens go nowhere
            ended = isinstance(item, BaseException) or item.finished
            if ended:
                del self._tracked[request_id]
                self._forget(tracked)
            elif not tracked.started:
                tracked.started = True
                self._queued[tracked.model] -= 1
                self._running_by_model[tracked.model] += 1
        _call_sink(tracked.sink, item)

    def _forget(self, tracked: _Tracked) -> None:
        counter = self._running_by_model if tracked.started else self._queued
        counter[tracked.model] -= 1

    # ---- the loop --------------------------------------------------------------------------
    def _loop(self, epoch: int) -> None:
        assert self.controller is not None
        controller, backend = self.controller, self._backend
        while self._running and epoch == self._epoch:
            try:
                changed = self._drain(controller)
                for handle, result in backend.poll(0.0 if changed else self.config.poll_s):
                    if handle in self._stats_calls:
                        changed |= self._got_stats(controller, self._stats_calls.pop(handle), result)
                    else:
                        changed |= controller.complete(handle, result)
                if controller.lost:
                    self.restarts.watch(controller.lost)
                    for instance_id in self.restarts.given_up & controller.lost:
                        self._placements.release(instance_id)  # lost for good: its group's resources go back
                    changed |= bool(controller.fail_stranded(self.restarts.pending))
                now = time.monotonic()
                # as in the simulator, the scheduler is asked when something happened (an arrival, a cancel, an
                # event), not after every engine call: a decode step's tokens change nothing it decides on, and a
                # schedule() over hundreds of queued requests on every step was the host's biggest cost per step
                if changed or now - self._tick_at >= TICK_FALLBACK_S:
                    self._tally(controller.tick())
                    self._tick_at = now
                self._ask_stats(controller)
                changed |= self._check_heartbeats(controller, now)
                busy = changed or bool(getattr(backend, "in_flight", 0))
                if not busy or now - self._status_at >= STATUS_INTERVAL_S:
                    self._status, self._status_at = self._snapshot(controller), now
                if not busy:
                    self._wait_inbox()
            except Exception:  # one bad tick must not take the pool down
                self.num_tick_errors += 1
                log.exception("controller tick failed")
                time.sleep(self.config.poll_s)

    def _drain(self, controller: Controller) -> bool:
        """Hand every message waiting in the inbox to the controller; True when one changed anything."""
        changed = False
        while True:
            if self._held:
                message = self._held.pop(0)
            else:
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    return changed
            match message:
                case Submit(live):
                    live.arrival_at = self.clock.now()
                    try:
                        controller.submit(live)
                    except ValueError as exc:
                        live.sink(exc)
                case Cancel(request_id):
                    controller.cancel(request_id)
                case Restored(instance_id, replacement):
                    self._restore(controller, instance_id, replacement)
                case Wake():
                    continue
            changed = True

    def _restore(self, controller: Controller, instance_id: str, replacement: Any) -> None:
        ok = not isinstance(replacement, BaseException)
        self.restarts.done(instance_id, ok)
        if ok:
            self._backend.replace(instance_id, replacement)
            controller.restore(instance_id)
            log.warning("instance %s is back", instance_id)

    def _wait_inbox(self) -> None:
        try:
            self._held.append(self._inbox.get(timeout=0.05))
        except queue.Empty:
            return

    def _tally(self, plan: Plan) -> None:
        """Count the model switches and KV moves a Plan orders (metrics, /pool/status)."""
        for instance_id, actions in plan.actions.items():
            before = self._resident.get(instance_id, frozenset())
            after = self._resident[instance_id] = resident_after(before, actions)
            self.num_model_switches += after != before
            for action in actions:
                if isinstance(action, Switch):
                    self.num_switches[(instance_id, action.model)] += 1
                    self.recent_switches.append({"at": round(time.time(), 3), "instance": instance_id,
                                                 "model": action.model, "reason": action.reason})
                elif isinstance(action, SwapOut | SwapIn):
                    self.num_kv_moves["swap_out" if isinstance(action, SwapOut) else "swap_in"] += len(
                        action.request_ids)

    def _ask_stats(self, controller: Controller) -> None:
        """Every `stats_interval_s`, one `stats()` call per live instance (never two at once)."""
        now = time.monotonic()
        if now - self._stats_at < self.config.stats_interval_s:
            return
        self._stats_at = now
        asked = set(self._stats_calls.values())
        for handle, iid in list(self._stats_calls.items()):  # a written-off instance's call may never return
            if iid in controller.lost:
                del self._stats_calls[handle]
                asked.discard(iid)
        for spec in self.instances:
            iid = spec.instance_id
            if iid not in asked and iid not in controller.lost:
                try:
                    self._stats_calls[self._backend.call(iid, calls.GetStats())] = iid
                except Exception:  # an actor already gone; the controller hears of it elsewhere
                    log.debug("stats call to %s failed", iid, exc_info=True)

    def _got_stats(self, controller: Controller, instance_id: str, result: Any) -> bool:
        """A stats() answer (the instance's heartbeat); an instance that died shows here even while idle (before,
        the error was dropped: status showed it up and the next request paid the whole restart). True when
        the instance was written off."""
        self._heartbeat_from.pop(instance_id, None)
        if isinstance(result, InstanceDied) and instance_id not in controller.lost:
            log.error("instance %s died: %s", instance_id, result)
            controller.lose(instance_id, f"its engine died: {result}")
            return True
        if isinstance(result, BaseException) or not dataclasses.is_dataclass(result):
            return False
        self.engine_stats[instance_id] = {**dataclasses.asdict(result), "at": round(time.time(), 3)}  # type: ignore[arg-type]
        return False

    def _check_heartbeats(self, controller: Controller, now: float) -> bool:
        """Write off an instance silent for `heartbeat_timeout_s` (hung: its replacement kills it, `_rebuild`):
        a process that stopped beating (processes and Ray backends, busy or idle: `unresponsive`), or an
        idle instance whose stats() call has gone unanswered. For the latter the clock starts when the call was
        made or, if later, when the instance's last engine call ended: a stats() call queued behind a long
        prefill is not late. A call stuck in a process that still beats is `call_timeout_s`'s to bound."""
        timeout = self.config.heartbeat_timeout_s
        if timeout is None:
            return False
        lost = False
        unresponsive = getattr(self._backend, "unresponsive", None)
        if unresponsive is not None:
            for iid, silent in unresponsive(timeout).items():
                if iid in controller.lost:
                    continue
                self.num_missed_heartbeats += 1
                log.error("instance %s: its process is alive but sent no heartbeat for %.1f s; writing it off",
                          iid, silent)
                controller.write_off_hung(iid, f"no heartbeat from its process for {silent:.1f} s (over "
                                               f"{timeout:g} s): stopped or hung")
                self._heartbeat_from.pop(iid, None)
                lost = True
        if not self._stats_calls:
            return lost
        busy, pending = controller.busy_instances(), set(self._stats_calls.values())
        for iid in pending:
            if iid in busy or iid in controller.lost:
                self._heartbeat_from.pop(iid, None)
                continue
            since = self._heartbeat_from.setdefault(iid, now)
            if now - since > timeout:
                self.num_missed_heartbeats += 1
                log.error("instance %s: no heartbeat for %.1f s while idle; writing it off", iid, now - since)
                controller.lose(iid, f"no heartbeat (stats) answer within {timeout:g} s while idle")
                self._heartbeat_from.pop(iid, None)
                lost = True
        return lost

    def _snapshot(self, controller: Controller) -> dict[str, Any]:
        sched = controller.scheduler
        view = sched.view()
        instances = {}
        for iid, inst in view.instances.items():
            engine = self.engine_stats.get(iid, {})
            instances[iid] = {"role": inst.role, "tp": inst.tp, "active_model": inst.active_model,
                              "prefetched_model": inst.prefetched_model, "busy": inst.busy, "lost": inst.lost,
                              "kv_used_bytes": inst.kv_used_bytes, "kv_capacity_bytes": inst.kv_capacity_bytes,
                              "requests_on_device": inst.num_requests_on_device, "node": self.nodes.get(iid),
                              "engine": {k: v for k, v in engine.items() if k != "extra"},
                              "engine_extra": engine.get("extra", {})}
        kv_by_model = dict.fromkeys(self.models, 0.0)
        for request_id, live in controller.requests.items():
            request = sched.request_view(request_id)
            if request is not None:
                kv_by_model[live.model] = kv_by_model.get(live.model, 0.0) + request.kv_reserved_bytes
        load = self.load()
        models = {name: {"queued": load[name][0], "running": load[name][1],
                         "scheduler_queue": view.queued.get(name, 0),
                         "kv_reserved_bytes": kv_by_model[name]} for name in self.models}
        return {"policy": self.policy, "ready": self.ready, "instances": instances,
                "queues": dict(view.queued), "models": models,
                "requests_in_pool": len(controller.requests), "plans": controller.num_plans,
                "tick_errors": self.num_tick_errors, "lost_instances": sorted(controller.lost),
                "kv_refusals": controller.num_kv_refusals,
                "restarts": sum(self.restarts.num_restarts.values()),
                "switches": sum(self.num_switches.values()), "recent_switches": list(self.recent_switches),
                "model_switches": self.num_model_switches,  # plans that changed an instance's models (not actions)
                # weights copied onto the devices, as the engines count them (their latest stats, of `stats_at`)
                "weight_copies": sum(int(e.get("num_weight_copies") or 0) for e in self.engine_stats.values()),
                "stats_at": min((e["at"] for e in self.engine_stats.values()), default=None)}


def _call_sink(sink: Callable[[TokenOut | BaseException], None], item: TokenOut | BaseException) -> None:
    try:
        sink(item)
    except Exception:  # a consumer's bug must not break the loop thread
        log.exception("a request's sink failed")
