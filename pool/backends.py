"""Where the controller's engine calls run: in this process (inline or on a thread per instance), or in Ray actors.

Both answer `call(instance_id, call) -> handle` at once (`call` a `pool.calls` value) and hand
results back through `poll(timeout_s) -> [(handle, result or exception)]`,
oldest call first. Each takes `replace(instance_id, engine or actor)` when a
lost instance comes back. The in-process ones also take `kill(instance_id)`
(fault injection, as `ray.kill` is for actors): from then on every call to
the instance, and any still queued for it, ends with `InstanceDied`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from pool.calls import EngineCall
from pool.engines.base import Engine
from pool.errors import InstanceDied
from pool.engines.device import GATE
from pool.engines.timings import call_engine

log = logging.getLogger(__name__)

BEAT_CHECK_S = 0.25  # the Ray backend reads its actors' beats at most this often


class InProcessBackend:
    """Engines in this process; each call runs as it is issued (tests and single-process dry runs)."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self.engines = dict(engines)
        self._ids = itertools.count(1)
        self._done: deque[tuple[int, Any]] = deque()

    def call(self, instance_id: str, call: EngineCall) -> int:
        handle = next(self._ids)
        engine = self.engines[instance_id]
        try:
            result: Any = _dead(instance_id) if engine is None else call.run(engine)
        except Exception as exc:  # handed to the controller, which decides what it means
            result = exc
        self._done.append((handle, result))
        return handle

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        out = list(self._done)
        self._done.clear()
        return out

    def replace(self, instance_id: str, engine: Engine) -> None:
        """A fresh engine for a lost instance."""
        self.engines[instance_id] = engine

    def kill(self, instance_id: str) -> None:
        self.engines[instance_id] = None  # type: ignore[assignment]

    def close(self) -> None:
        """The pool stopped: close every engine still serving (a TP instance's files go with it)."""
        for instance_id, engine in self.engines.items():
            if engine is not None:
                _close_quietly(instance_id, engine)


class RayBackend:
    """One Ray actor per instance (`pool.actor.InstanceActor`); calls on one actor run in order.

    A call to an actor that died (killed, its process gone) ends with
    `InstanceDied`, which the controller takes as the instance's loss.
    """

    def __init__(self, actors: Mapping[str, Any]) -> None:
        import ray

        self._ray = ray
        self.actors = dict(actors)
        self._ids = itertools.count(1)
        self._pending: dict[Any, tuple[int, str]] = {}  # ObjectRef -> (handle, instance)
        self._failed: list[tuple[int, Any]] = []  # calls that could not even be sent
        self._beats: dict[str, tuple[Any, float]] = {}  # actor id -> (its beat count, when it last moved here)
        self._beats_read_at = float("-inf")

    def call(self, instance_id: str, call: EngineCall) -> int:
        handle = next(self._ids)
        actor = self.actors.get(instance_id)
        if actor is None:
            raise KeyError(f"no actor for instance {instance_id!r}")
        try:
            self._pending[actor.call.remote(call)] = (handle, instance_id)
        except self._ray.exceptions.RayActorError as exc:
            self._failed.append((handle, InstanceDied(f"the actor of {instance_id} is gone: {exc}")))
        return handle

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        out, self._failed = self._failed, []
        if not self._pending:
            return out
        refs = list(self._pending)
        ready, _ = self._ray.wait(refs, num_returns=1, timeout=0.0 if out else timeout_s)
        if ready:
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            handle, instance_id = self._pending.pop(ref)
            try:
                result = self._ray.get(ref)
            except self._ray.exceptions.RayActorError as exc:
                result = InstanceDied(f"the actor of {instance_id} died: {exc}")
            except Exception as exc:  # the engine's own errors (RayTaskError wraps them)
                result = exc
            out.append((handle, result))
        return sorted(out, key=lambda pair: pair[0])

    def unresponsive(self, timeout_s: float) -> dict[str, float]:
        """Instances whose actor has beaten before (`pool.actor.beat_to_gcs`) and not for over `timeout_s`,
        as this process saw its count (no clock is shared across nodes) -> seconds since it last moved.
        Asked at most every BEAT_CHECK_S (a key-value read per actor). An actor that died is found by its
        calls (RayActorError), within a second or so."""
        from ray.experimental import internal_kv

        from pool.actor import BEAT_NAMESPACE

        now, out = time.monotonic(), dict[str, float]()
        if now - self._beats_read_at < BEAT_CHECK_S:
            return out
        self._beats_read_at = now
        for instance_id, actor in self.actors.items():
            key = actor._actor_id.hex()
            try:
                count = internal_kv._internal_kv_get(key, namespace=BEAT_NAMESPACE)
            except Exception:  # noqa: BLE001 - the GCS briefly away: judge next time
                continue
            seen = self._beats.get(key)
            if count is None:  # not beating (yet, or at all): not judged
                continue
            if seen is None or seen[0] != count:
                self._beats[key] = (count, now)
            elif now - seen[1] > timeout_s:
                out[instance_id] = now - seen[1]
        return out

    def replace(self, instance_id: str, actor: Any) -> None:
        """A fresh actor for a lost instance; calls still pending on the old one end as they end."""
        old = self.actors.get(instance_id)
        self.actors[instance_id] = actor
        if old is not None:
            key = old._actor_id.hex()
            self._beats.pop(key, None)
            try:
                from ray.experimental import internal_kv

                from pool.actor import BEAT_NAMESPACE

                internal_kv._internal_kv_del(key, namespace=BEAT_NAMESPACE)
            except Exception:  # noqa: BLE001 - a stale key costs a few bytes
                pass

    @property
    def in_flight(self) -> int:
        return len(self._pending) + len(self._failed)


class ThreadBackend:
    """Engines in this process, one worker thread per instance: calls on one instance run in order,
    instances in parallel (the `sim` engine's sleeps and torch's kernels release the GIL). Each call
    holds `GATE` shared, so an engine capturing CUDA graphs meanwhile has the device to itself."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self.engines = dict(engines)
        self._ids = itertools.count(1)
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (handle, result), or WAKE
        # a call, None (stop), or an Event: `retire` - close the engine, set the event, stop
        self._work: dict[str, queue.SimpleQueue[tuple[int, EngineCall] | threading.Event | None]] = {}
        self.in_flight = 0  # touched by the loop thread only
        self._retired: set[str] = set()  # freed by retire() and not replaced since
        self._threads: dict[str, threading.Thread] = {}
        for iid, engine in self.engines.items():
            self._start_worker(iid, engine)

    def _start_worker(self, instance_id: str, engine: Engine) -> None:
        work = self._work[instance_id] = queue.SimpleQueue()
        thread = threading.Thread(target=self._serve, args=(instance_id, engine, work),
                                  name=f"modelpool-{instance_id}", daemon=True)
        self._threads[instance_id] = thread
        thread.start()

    def _serve(self, instance_id: str, engine: Engine, work: queue.SimpleQueue[Any]) -> None:
        while (item := work.get()) is not None:
            if isinstance(item, threading.Event):  # retire(): free the engine's memory here, between calls
                engine.close()
                del engine
                item.set()
                self._answer_dead(instance_id, work)
                return
            handle, call = item
            try:
                if self.engines.get(instance_id) is not engine:  # killed, or replaced since: calls on it are gone
                    result: Any = _dead(instance_id)
                else:
                    with GATE.shared():
                        result = call_engine(engine, call)
            except Exception as exc:  # handed to the controller, which decides what it means
                result = exc
            del call, item
            self._done.put((handle, result))
        _close_quietly(instance_id, engine)  # close(): the pool stopped (a TP instance's files go with its engine)

    def _answer_dead(self, instance_id: str, work: queue.SimpleQueue[Any]) -> None:
        while True:
            try:
                item = work.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                self._done.put((item[0], _dead(instance_id)))

    def call(self, instance_id: str, call: EngineCall) -> int:
        handle = next(self._ids)
        self.in_flight += 1
        if self.engines.get(instance_id) is None:  # killed or retired: no worker will run it
            self._done.put((handle, _dead(instance_id)))
        else:
            self._work[instance_id].put((handle, call))
        return handle

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        out = take_done(self._done, timeout_s if self.in_flight else 0.0)
        self.in_flight -= len(out)
        return out

    def wake(self) -> None:
        """End a `poll` waiting now (or the next one) at once, answering nothing: the pool's loop has a message."""
        self._done.put(WAKE)

    def replace(self, instance_id: str, engine: Engine) -> None:
        """A fresh engine (and worker) for a lost instance; the old worker ends after its current call."""
        self._work[instance_id].put(None)
        self.engines[instance_id] = engine
        self._retired.discard(instance_id)
        self._start_worker(instance_id, engine)

    def retire(self, instance_id: str, timeout_s: float = 30.0) -> bool:
        """Write a lost instance's engine off and free its device memory (after the call it may be running):
        its later calls end with `InstanceDied`. True once freed; False if its worker is still stuck in a
        call after `timeout_s` (a hung kernel: the memory cannot be taken back). Retired already (a restart
        tried again): True at once."""
        if instance_id in self._retired:
            return True
        self.engines[instance_id] = None  # type: ignore[assignment]
        freed = threading.Event()
        self._work[instance_id].put(freed)
        if not freed.wait(timeout_s):
            return False
        self._retired.add(instance_id)
        return True

    def kill(self, instance_id: str) -> None:
        self.engines[instance_id] = None  # type: ignore[assignment]

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop every worker; each closes its engine after the call it is running. Waits `timeout_s` in all: a
        worker inside a long call (a warm-up that Ctrl-C cut short) closes its engine when that call returns,
        if the process still runs."""
        for work in self._work.values():
            work.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))


def _close_quietly(instance_id: str, engine: Engine) -> None:
    try:
        engine.close()
    except Exception:  # noqa: BLE001 - the pool is stopping: nothing is left to tell
        log.warning("closing %s's engine failed", instance_id, exc_info=True)


WAKE: Any = ("wake",)  # put on a backend's answers queue by `wake`: ends a poll's wait, answers nothing


def take_done(done: queue.SimpleQueue[Any], timeout_s: float) -> list[tuple[int, Any]]:
    """Every (handle, result) waiting in `done`, oldest call first; waits up to `timeout_s` (> 0) for the first,
    or for a `WAKE` (which it drops)."""
    out = []
    try:
        item = done.get(timeout=timeout_s) if timeout_s > 0 else done.get_nowait()
        while True:
            if item is not WAKE:
                out.append(item)
            item = done.get_nowait()
    except queue.Empty:
        pass
    return sorted(out, key=lambda pair: pair[0])


def _dead(instance_id: str) -> InstanceDied:
    return InstanceDied(f"the engine of {instance_id} was killed")
