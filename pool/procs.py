"""A process per instance without Ray: each engine in its own OS process, with its own CUDA context and GIL.

The single-machine pattern of vLLM's multiprocessing executor. `ProcessBackend`
answers the same `call`/`poll` contract as the Ray and thread backends: calls
to one instance run in order in its process, instances run in parallel, and a
process that dies (killed, crashed, or its pipe broken) is a lost instance:
every call in flight or sent later to it ends with `InstanceDied`.

Each process beats: a thread of its own writes `time.monotonic()` into a
shared double every `beat_s` (0.5 s), whatever its engine is doing. A live
process beats while its main thread computes (a torch op, a sleep, a pipe
write release the GIL; pure Python gives it up every 5 ms), so a beat that
stops while the process is alive means the whole process is stopped or
stuck: SIGSTOP, a frozen cgroup, a C call that holds the GIL for ever.
`ProcessBackend.unresponsive(timeout_s)` names those processes, within
seconds even in the middle of a long call, and `retire` kills them at once
(no grace: they cannot close themselves). A call stuck while the process's
threads still run (a kernel that never ends, with the GIL released) is not
seen this way: the controller's `call_timeout_s` is its bound.

Messages go over one pipe per process, pickled (protocol 5). A large array in
a result - the KV of `export_kv` - does not go through the pipe: the worker
writes it to a file in shared memory (/dev/shm) and sends its name; the
controller's process passes the name on to the importing worker, which maps
the file, and unlinks the file once that call has ended (or when nobody
needs the array any more).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pool.actor import EngineSpec
from pool.backends import WAKE, take_done
from pool.calls import EngineCall
from pool.engines.tp_files import remove_stores
from pool.engines.base import EngineError
from pool.errors import InstanceDied
from pool.engines.timings import call_engine
from pool.heap import freeze_heap

log = logging.getLogger("modelpool.procs")

SHM_MIN_BYTES = 1 << 20  # arrays at least this large travel through shared memory
_SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


# ---- large arrays through shared-memory files ---------------------------------------------------------
class ShmArray:
    """A worker's array in a shared-memory file, as the controller's process holds it (never mapped here).

    Pickled to a worker it becomes the mapped array again; the file is
    unlinked when this object goes (after the call that carried it ended).
    """

    def __init__(self, path: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.shape = path, dtype, shape
        weakref.finalize(self, _unlink, path)

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * np.prod(self.shape))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_map_array, (self.path, self.dtype, self.shape))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _map_array(path: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """In a worker: the array of a shared-memory file (a read-only map; the file may be unlinked later)."""
    if not shape or int(np.prod(shape)) == 0:
        return np.empty(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class _WorkerPickler(pickle.Pickler):
    """A worker's results: large arrays go to shared-memory files, the rest as usual."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray) and obj.nbytes >= SHM_MIN_BYTES:
            path = str(_SHM_DIR / f"modelpool-{os.getpid()}-{uuid.uuid4().hex}")
            np.ascontiguousarray(obj).tofile(path)
            return (ShmArray, (path, obj.dtype.str, tuple(obj.shape)))
        return NotImplemented


def _dumps_result(item: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    _WorkerPickler(buffer, protocol=5).dump(item)
    return buffer.getvalue()


class HostProfile:
    """A benchmark's look at where an engine process's host time goes (MODELPOOL_HOST_PROFILE_S=<seconds>, beside
    MODELPOOL_CALL_LOG_DIR): pyinstrument samples the process (1 ms) and writes a text report per window of that
    many seconds, host-<instance>-<start>.txt in the call-log folder, <start> the window's start on the monotonic
    clock the call logs use (so a slow stretch of the call log finds its report)."""

    def __init__(self, folder: str, instance_id: str, window_s: float) -> None:
        self.folder, self.instance_id, self.window_s = folder, instance_id, window_s
        self._profiler: Any = None
        self._started = 0.0
        self._start()

    @classmethod
    def from_env(cls, instance_id: str) -> HostProfile | None:
        window, folder = os.environ.get("MODELPOOL_HOST_PROFILE_S"), os.environ.get("MODELPOOL_CALL_LOG_DIR")
        return cls(folder, instance_id, float(window)) if window and folder else None

    def _start(self) -> None:
        from pyinstrument import Profiler

        self._profiler, self._started = Profiler(interval=0.001), time.monotonic()
        self._profiler.start()

    def _write(self) -> None:
        self._profiler.stop()
        path = os.path.join(self.folder, f"host-{self.instance_id}-{self._started:.1f}.txt")
        with open(path, "w") as out:
            out.write(self._profiler.output_text(unicode=False, color=False))

    def tick(self) -> None:
        """After each engine call: a window that is over is written and the next one begins."""
        if time.monotonic() - self._started >= self.window_s:
            self._write()
            self._start()

    def close(self) -> None:
        self._write()


class SlowCalls:
    """A benchmark's look inside an engine process's slow calls (MODELPOOL_SLOW_CALL_MS=<ms>, beside
    MODELPOOL_CALL_LOG_DIR): a thread wakes every quarter of that; while a call has run longer, it takes the
    calling thread's stack. Unlike HostProfile it does nothing while calls are quick, so it hardly slows the
    process it looks at. Writes slow-<instance>.json: rows [method, started at (monotonic s, the call log's
    clock), ms into the call, the innermost frames as 'file:line function']."""

    FRAMES = 12

    def __init__(self, folder: str, instance_id: str, threshold_s: float) -> None:
        self.path = os.path.join(folder, f"slow-{instance_id}.json")
        self.threshold_s = threshold_s
        self.current: tuple[str, float] | None = None  # (method, started at) while a call runs
        self.samples: list[tuple[str, float, float, list[str]]] = []
        self._caller = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="modelpool-slow-calls", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, instance_id: str) -> SlowCalls | None:
        threshold, folder = os.environ.get("MODELPOOL_SLOW_CALL_MS"), os.environ.get("MODELPOOL_CALL_LOG_DIR")
        return cls(folder, instance_id, float(threshold) / 1e3) if threshold and folder else None

    def _watch(self) -> None:
        import sys

        while not self._stop.wait(self.threshold_s / 4):
            call = self.current
            if call is None or time.monotonic() - call[1] < self.threshold_s:
                continue
            frame = sys._current_frames().get(self._caller)
            if frame is None:
                continue
            stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)]
            self.samples.append((call[0], call[1], (time.monotonic() - call[1]) * 1e3, stack[-self.FRAMES:]))

    def close(self) -> None:
        import json

        self._stop.set()
        self._thread.join()
        with open(self.path, "w") as out:
            json.dump([[m, round(t, 6), round(ms, 2), stack] for m, t, ms, stack in self.samples], out)


# ---- the worker process ---------------------------------------------------------------------------------
BEAT_S = 0.5  # a worker process's liveness beat, by default (PoolConfig.heartbeat_interval_s)


def _beat(beat: Any, interval_s: float) -> None:
    """A worker's liveness thread: its process's `time.monotonic()` (one clock for every process on a host)
    into the shared `beat`, every `interval_s`, for as long as the process runs."""
    while True:
        beat.value = time.monotonic()
        time.sleep(interval_s)


def _worker_main(conn: Any, instance_id: str, spec: EngineSpec, models: Mapping[str, str],
                 max_tokens: int | None, threads: int, beat: Any = None, beat_s: float = BEAT_S) -> None:
    import signal

    if beat is not None:  # from the start: a slow load is alive too
        threading.Thread(target=_beat, args=(beat, beat_s), name="modelpool-beat", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle: it stops us in order
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        torch.set_num_threads(threads)
        from pool.actor import make_engine

        engine = make_engine(spec)
        for name, path in models.items():
            engine.load(name, Path(path))
        captured = engine.warm_up(max_tokens)
        freeze_heap()  # start-up's objects out of the collector's way while serving
    except BaseException:  # noqa: BLE001 - reported to the parent, which gives the start up
        conn.send_bytes(pickle.dumps(("failed", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", captured)))
    profile = HostProfile.from_env(instance_id)
    slow = SlowCalls.from_env(instance_id)
    log_dir = os.environ.get("MODELPOOL_CALL_LOG_DIR")  # a benchmark's: every engine call, timed, at the end
    timings = engine.timings
    if log_dir and timings is not None:
        timings.watch_gc()  # and the collector's pauses
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the controller's process is gone
            break
        if message is None:
            break
        handle, call = message
        if slow is not None:
            slow.current = (call.name, time.monotonic())
        try:
            result: Any = call_engine(engine, call)
        except Exception as exc:  # handed to the controller, which decides what it means
            result = exc
        if slow is not None:
            slow.current = None
        name = call.name
        del call, message
        try:
            payload = _dumps_result((handle, result))
        except Exception as exc:  # an exception (or result) that cannot be pickled: say what it was
            payload = _dumps_result((handle, EngineError(f"{instance_id}: {name} -> unpicklable {exc!r}: "
                                                         f"{result!r}"[:2000])))
        conn.send_bytes(payload)
        if profile is not None:
            profile.tick()
    if profile is not None:
        profile.close()
    if slow is not None:
        slow.close()
    if log_dir and timings is not None:
        timings.dump_calls(os.path.join(log_dir, f"calls-{instance_id}.json"))
        timings.dump_kv_calls(os.path.join(log_dir, f"kv-{instance_id}.json"))
        timings.dump_gc(os.path.join(log_dir, f"gc-{instance_id}.json"))
    engine.close()


# ---- the controller's side ------------------------------------------------------------------------------
class _Worker:
    """One instance's process, its pipe, and the thread that reads its answers."""

    def __init__(self, instance_id: str, process: Any, conn: Any, beat: Any = None) -> None:
        self.instance_id, self.process, self.conn = instance_id, process, conn
        self.beat = beat  # shared double: the process's time.monotonic() at its last liveness beat (None: none)
        self.alive = True
        self.pending: dict[int, EngineCall] = {}  # handle -> call (kept: the shared-memory files it carries live on)
        self.lock = threading.Lock()


def start_workers(instances: Mapping[str, EngineSpec], models: Mapping[str, str], *,
                  max_tokens: int | None = None, threads: int = 1,
                  timeout_s: float | None = None, beat_s: float = BEAT_S) -> dict[str, _Worker]:
    """One process per instance id (value: its engine, device and tp included); returns once every engine has
    loaded its models and captured its decode graphs (for requests up to `max_tokens` tokens). Each process
    beats every `beat_s` (module docstring). A worker that
    fails to start stops them all (RuntimeError). A tensor-parallel torch instance's process is its rank 0 and
    starts the other ranks as its own subprocesses (`pool.engines.tp`)."""
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    workers: dict[str, _Worker] = {}
    for instance_id, spec in instances.items():
        parent, child = ctx.Pipe()
        beat = ctx.RawValue("d", time.monotonic())
        process = ctx.Process(target=_worker_main, name=f"modelpool-{instance_id}", daemon=True,
                              args=(child, instance_id, spec, dict(models), max_tokens, threads, beat, beat_s))
        process.start()
        child.close()
        workers[instance_id] = _Worker(instance_id, process, parent, beat)
    try:
        for worker in workers.values():
            if not worker.conn.poll(timeout_s):
                raise TimeoutError(f"instance {worker.instance_id} did not start within {timeout_s} s")
            try:
                status, detail = pickle.loads(worker.conn.recv_bytes())
            except (EOFError, OSError):
                raise RuntimeError(f"instance {worker.instance_id}: its process died while starting "
                                   f"(exit code {worker.process.exitcode})") from None
            if status != "ready":
                raise RuntimeError(f"instance {worker.instance_id} failed to start:\n{detail}")
    except BaseException:
        for worker in workers.values():
            stop_worker(worker, timeout_s=5)
        raise
    return workers


def stop_worker(worker: _Worker, timeout_s: float = 30.0) -> None:
    """Ask the process to close its engine and end; kill it if it does not within `timeout_s`. Returns once
    it is gone (its device memory is free then)."""
    try:
        worker.conn.send_bytes(pickle.dumps(None))
    except (OSError, ValueError):
        pass
    worker.process.join(timeout_s)
    killed = worker.process.is_alive()
    if killed:
        worker.process.kill()
        worker.process.join(10)
    worker.alive = False
    worker.conn.close()
    if (killed or not worker.process.is_alive()) and worker.process.pid is not None:
        # a TP rank 0 killed before it closed leaves its rendezvous file; once SIGKILL is sent it can use it no
        # more, though a loaded machine may take longer than the join to reap it
        remove_stores(worker.process.pid)


class ProcessBackend:
    """Engines in worker processes (`start_workers`); see the module docstring."""

    def __init__(self, workers: Mapping[str, _Worker]) -> None:
        self.workers: dict[str, _Worker] = {}
        self._ids = itertools.count(1)
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.in_flight = 0  # touched by the loop thread only
        self._hung: set[str] = set()  # found silent by `unresponsive`: `retire` kills them without a grace
        for worker in workers.values():
            self._adopt(worker)

    def _adopt(self, worker: _Worker) -> None:
        self.workers[worker.instance_id] = worker
        self._hung.discard(worker.instance_id)
        threading.Thread(target=self._read, args=(worker,), name=f"modelpool-read-{worker.instance_id}",
                         daemon=True).start()

    def _read(self, worker: _Worker) -> None:
        while True:
            try:
                handle, result = pickle.loads(worker.conn.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            with worker.lock:
                call = worker.pending.pop(handle, None)
            self._done.put((handle, result))
            del call  # the call is over: shared-memory files it carried may go
        with worker.lock:
            worker.alive = False
            orphans, worker.pending = list(worker.pending), {}
        code = worker.process.exitcode
        for handle in orphans:
            self._done.put((handle, InstanceDied(f"the process of {worker.instance_id} died (exit code {code})")))

    def call(self, instance_id: str, call: EngineCall) -> int:
        handle = next(self._ids)
        worker = self.workers[instance_id]
        self.in_flight += 1
        with worker.lock:
            alive = worker.alive
            if alive:
                worker.pending[handle] = call
        if not alive:
            self._done.put((handle, InstanceDied(f"the process of {instance_id} is gone")))
            return handle
        try:
            worker.conn.send_bytes(pickle.dumps((handle, call), protocol=5))
        except (OSError, ValueError) as exc:  # a broken pipe: the reader sees the end and fails the call
            log.warning("call to %s could not be sent: %r", instance_id, exc)
            with worker.lock:
                if worker.pending.pop(handle, None) is not None:
                    self._done.put((handle, InstanceDied(f"the process of {instance_id} is gone: {exc!r}")))
        return handle

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        out = take_done(self._done, timeout_s if self.in_flight else 0.0)
        self.in_flight -= len(out)
        return out

    def wake(self) -> None:
        """End a `poll` waiting now (or the next one) at once, answering nothing: the pool's loop has a message."""
        self._done.put(WAKE)

    def replace(self, instance_id: str, worker: _Worker) -> None:
        """A fresh process for a lost instance (the old one was stopped by `retire` first)."""
        self._adopt(worker)

    def unresponsive(self, timeout_s: float) -> dict[str, float]:
        """Instances whose process is alive but has not beaten for over `timeout_s`: stopped or hung, busy or
        idle (module docstring) -> seconds since its last beat. A process that died is not named here: its
        reader fails the calls it had (the controller counts them against what they carried), and a call to
        it fails at once. Each one named is killed without a grace when retired."""
        now, out = time.monotonic(), dict[str, float]()
        for instance_id, worker in self.workers.items():
            if worker.beat is None or not worker.alive:
                continue
            silent = now - worker.beat.value
            if silent > timeout_s and worker.process.is_alive():
                out[instance_id] = silent
                self._hung.add(instance_id)
        return out

    def retire(self, instance_id: str, timeout_s: float = 30.0) -> bool:
        """Stop a lost instance's process and wait until it is gone (its GPU memory is free then); True once
        it is (False: it outlived its kill too). A process found silent (`unresponsive`) is killed at once:
        a stopped or hung one cannot close itself, and its replacement must not wait for it."""
        worker = self.workers[instance_id]
        stop_worker(worker, 0.0 if instance_id in self._hung else timeout_s)
        return not worker.process.is_alive()

    def kill(self, instance_id: str) -> None:
        """Fault injection: kill the process (as a crash would)."""
        self.workers[instance_id].process.kill()

    def close(self) -> None:
        for worker in self.workers.values():
            stop_worker(worker, timeout_s=10)
