"""What an engine's steps cost in the live pool: prefill times, and the host's share of each decode step.

A decode step's period is the time from one `decode_step` call of a batch
to the next one of the same batch: the device's forward pass plus all the
host adds around it (inputs, sampling, token delivery, the backend hop, the
controller's tick, the runner). The forward alone is timed on the device
(CUDA events around the graph replay) or, on CPU, by the host clock, so
`period - forward` is the host overhead per step that the live pool pays
and the cost model must charge. Prefill is timed whole (inputs to sampled
token), as the live pool runs it.

What the live pool adds to the engine's own step (`added`, what the simulator
is calibrated with) is the time outside the engine's call, period - call; but
for a step launched ahead (async decode) the host's work, inside the call and
outside it, ran while the device computed, so what it adds is period - forward.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pool.calls import EngineCall
    from pool.engines.base import Engine

BATCH_BUCKETS = (1, 4, 8, 16, 32, 64, 256)  # decode figures per batch up to each


class StepTimings:
    def __init__(self, cuda: bool, keep: int = 4096) -> None:
        self.cuda = cuda
        # (model, tokens, requests, s, 1 when the call began by discarding a decode step launched ahead: the
        # device ran that step first, inside the call's time)
        self.prefills: deque[tuple[str, int, int, float, int]] = deque(maxlen=keep)
        # (batch, period s, forward s, call s, ahead): call = the step's time inside the engine (inputs, forward,
        # sampling, tokens out); period - call = the time outside it (backend hop, controller, runner); ahead:
        # 1 when the step was launched ahead of the host (async decode), else 0
        self.decodes: deque[tuple[int, float, float, float, int]] = deque(maxlen=keep)
        self.decode_models: deque[str] = deque(maxlen=keep)  # each of `decodes`' model(s), "a+b" for a mixed batch
        # (ids, entered at, forward, call s, ahead, model)
        self._last: tuple[tuple[str, ...], float, Any, float, bool, str] | None = None
        # (method, requests, bytes, s, of which s waiting for the device's compute stream, s until that wait
        # began (checks, blocks, the copies' launch), started at: time.monotonic)
        self.kv_calls: deque[tuple[str, int, int, float, float, float, float]] = deque(maxlen=keep)
        # every call a backend made (`call_engine`): method -> [calls, seconds] since start, the latest seconds of
        # each method, and a log of the latest calls as (method, started at: time.monotonic, seconds)
        self.call_totals: dict[str, list[float]] = {}
        self.calls: dict[str, deque[float]] = {}
        self.call_log: deque[tuple[str, float, float]] = deque(maxlen=16 * keep)
        # the cyclic collector's pauses in this process once `watch_gc` is on: (generation, started at: monotonic, s)
        self.gc_pauses: deque[tuple[int, float, float]] = deque(maxlen=keep)
        self._gc_began: float | None = None

    # ---- forward timer: CUDA events around the forward, or the host clock on CPU ----
    def forward_begin(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return (start, end)

    def forward_end(self, timer: Any) -> Any:
        if not self.cuda:
            return time.perf_counter() - timer
        timer[1].record()
        return timer

    @staticmethod
    def seconds(timer: Any) -> float:
        if isinstance(timer, float):
            return timer
        return timer[0].elapsed_time(timer[1]) / 1e3  # both recorded before the step's sampling synced

    # ---- records ----
    def prefill(self, model: str, num_tokens: int, num_requests: int, seconds: float,
                after_discard: bool = False) -> None:
        self.prefills.append((model, num_tokens, num_requests, seconds, int(after_discard)))
        self._last = None

    def decode(self, request_ids: tuple[str, ...], entered_at: float, forward: Any, ahead: bool = False,
               model: str = "") -> None:
        """A decode step of `request_ids` (of `model`) entered at `entered_at`; `forward` from forward_end (None:
        untimed); `ahead`: its tokens came from a step launched before this call (async decode)."""
        last = self._last
        if last is not None and last[0] == request_ids and last[2] is not None:
            self.decodes.append((len(request_ids), entered_at - last[1], self.seconds(last[2]), last[3], int(last[4])))
            self.decode_models.append(last[5])
        self._last = (request_ids, entered_at, forward, time.perf_counter() - entered_at, ahead, model)

    def kv_call(self, method: str, num_requests: int, nbytes: int, seconds: float, waited: float = 0.0,
                launched: float | None = None) -> None:
        """A KV call (save_kv, restore_kv, export_kv, import_kv): its requests, bytes and time in the engine
        (the host's part: save and restore copies run on their own streams and are not waited for), `waited` of
        it for the compute stream (a staged hand-off's copies: whatever was queued there before them too), and
        `launched`: the seconds before that wait began (default: all of `seconds` less `waited`)."""
        launched = seconds - waited if launched is None else launched
        self.kv_calls.append((method, num_requests, nbytes, seconds, waited, launched,
                              time.monotonic() - seconds))
        self._last = None

    def call(self, method: str, started_at: float, seconds: float) -> None:
        """One engine call, as a backend made it (inside the engine: from entry to return)."""
        total = self.call_totals.get(method)
        if total is None:  # the first call of `method` (not a new list and deque on every call: a hot path)
            total = self.call_totals[method] = [0, 0.0]
            self.calls[method] = deque(maxlen=self.kv_calls.maxlen)
        total[0] += 1
        total[1] += seconds
        self.calls[method].append(seconds)
        self.call_log.append((method, started_at, seconds))

    def dump_calls(self, path: str) -> None:
        """Write the call log as JSON rows [method, started at (monotonic s, one clock for the host's processes),
        seconds]: instances' calls can be laid side by side (benchmarks/gpu_pool.py on the GPU)."""
        import json

        with open(path, "w") as out:
            json.dump([[m, round(t, 6), round(d, 6)] for m, t, d in self.call_log], out)

    def dump_kv_calls(self, path: str) -> None:
        """Write the latest KV calls as JSON rows [method, requests, bytes, started at (monotonic s), seconds,
        of them waiting for the compute stream, before that wait]: which hand-offs took long, and where."""
        import json

        with open(path, "w") as out:
            json.dump([[m, n, b, round(t, 6), round(s, 6), round(w, 6), round(x, 6)]
                       for m, n, b, s, w, x, t in self.kv_calls], out)

    def watch_gc(self) -> None:
        """Time every collection of the cyclic garbage collector in this process from now on (an engine
        process's: a collection inside an engine call stalls it, and a full one walks whatever serving made)."""
        import gc

        if self._gc_phase not in gc.callbacks:
            gc.callbacks.append(self._gc_phase)

    def _gc_phase(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            seconds = time.perf_counter() - self._gc_began
            self.gc_pauses.append((info["generation"], time.monotonic() - seconds, seconds))
            self._gc_began = None

    def dump_gc(self, path: str) -> None:
        """Write the latest collections as JSON rows [generation, started at (monotonic s), seconds]."""
        import json

        with open(path, "w") as out:
            json.dump([[g, round(t, 6), round(s, 6)] for g, t, s in self.gc_pauses], out)

    def clear_decodes(self) -> None:
        """Forget the decode steps recorded so far (a benchmark's warm-up)."""
        self.decodes.clear()
        self.decode_models.clear()
        self._last = None

    def other(self) -> None:
        """Any other engine call: the next decode step starts a new run of the same batch."""
        self._last = None

    # ---- summaries ----
    def summary(self, max_prefills: int = 256) -> dict[str, Any]:
        """Decode period, forward and host overhead (ms) per batch bucket; the latest prefills."""
        decode: dict[str, Any] = {}
        if self.decodes:
            rows = np.array(self.decodes, dtype=np.float64)
            low = 0
            for high in BATCH_BUCKETS:
                picked = rows[(rows[:, 0] > low) & (rows[:, 0] <= high)]
                low = high
                if not len(picked):
                    continue
                overhead = (picked[:, 1] - picked[:, 2]) * 1e3
                outside = (picked[:, 1] - picked[:, 3]) * 1e3
                added = np.where(picked[:, 4] > 0, overhead, outside)
                decode[f"<={high}"] = {
                    "steps": int(len(picked)), "batch_mean": round(float(picked[:, 0].mean()), 3),
                    "period_ms_p50": round(float(np.median(picked[:, 1])) * 1e3, 4),
                    "forward_ms_p50": round(float(np.median(picked[:, 2])) * 1e3, 4),
                    "overhead_ms_p50": round(float(np.median(overhead)), 4),
                    "overhead_ms_p90": round(float(np.percentile(overhead, 90)), 4),
                    "in_engine_ms_p50": round(float(np.median(picked[:, 3])) * 1e3, 4),
                    "outside_ms_p50": round(float(np.median(outside)), 4),
                    "outside_ms_p90": round(float(np.percentile(outside, 90)), 4),
                    "ahead_share": round(float(picked[:, 4].mean()), 4),
                    "added_ms_p50": round(float(np.median(added)), 4),
                    # what the steps add on average, stalls included (a stats() call, a KV call between two steps):
                    # over a turn of many steps the mean adds up, not the median (the simulator's decode_host terms)
                    "added_ms_mean": round(float(added.mean()), 4)}
        prefills = [[m, t, n, round(s, 6), d] for m, t, n, s, d in list(self.prefills)[-max_prefills:]]
        # per model and batch bucket, the mean forward and period: what a model's decode step costs in the live
        # pool, beside the cost model's decode terms at that batch (a mixed batch counts as its own "a+b")
        by_model: dict[str, dict[str, Any]] = {}
        if self.decodes and len(self.decode_models) == len(self.decodes):  # (rows added by hand have no model)
            rows = np.array(self.decodes, dtype=np.float64)
            models = np.array(self.decode_models, dtype=object)
            for name in sorted(set(self.decode_models)):
                mine = rows[models == name]
                low = 0
                for high in BATCH_BUCKETS:
                    picked = mine[(mine[:, 0] > low) & (mine[:, 0] <= high)]
                    low = high
                    if len(picked):
                        by_model.setdefault(name, {})[f"<={high}"] = {
                            "steps": int(len(picked)), "batch_mean": round(float(picked[:, 0].mean()), 3),
                            "forward_ms_mean": round(float(picked[:, 2].mean()) * 1e3, 4),
                            "period_ms_mean": round(float(picked[:, 1].mean()) * 1e3, 4)}
        kv: dict[str, Any] = {}
        for method in sorted({call[0] for call in self.kv_calls}):
            of_method = [c for c in self.kv_calls if c[0] == method]
            ms = np.array([c[3] for c in of_method]) * 1e3
            waited = np.array([c[4] for c in of_method]) * 1e3
            launched = np.array([c[5] for c in of_method]) * 1e3
            kv[method] = {"calls": len(of_method), "requests": sum(c[1] for c in of_method),
                          "mb": round(sum(c[2] for c in of_method) / 1e6, 3), "ms_mean": round(float(ms.mean()), 4),
                          "ms_p50": round(float(np.median(ms)), 4),
                          "ms_p90": round(float(np.percentile(ms, 90)), 4), "ms_max": round(float(ms.max()), 4),
                          "wait_ms_p50": round(float(np.median(waited)), 4),
                          "wait_ms_p90": round(float(np.percentile(waited, 90)), 4),
                          "wait_ms_max": round(float(waited.max()), 4),
                          "launch_ms_p50": round(float(np.median(launched)), 4),
                          "launch_ms_max": round(float(launched.max()), 4)}
        calls: dict[str, Any] = {}
        for method, (count, seconds) in sorted(self.call_totals.items()):
            ms = np.array(self.calls.get(method) or [0.0]) * 1e3
            calls[method] = {"calls": int(count), "s": round(seconds, 4), "ms_p50": round(float(np.median(ms)), 4),
                             "ms_p90": round(float(np.percentile(ms, 90)), 4), "ms_max": round(float(ms.max()), 4)}
        collections: dict[str, Any] = {}
        for generation in sorted({g for g, _, _ in self.gc_pauses}):
            ms = np.array([s for g, _, s in self.gc_pauses if g == generation]) * 1e3
            collections[f"gen{generation}"] = {"collections": len(ms), "ms_sum": round(float(ms.sum()), 3),
                                               "ms_max": round(float(ms.max()), 3)}
        return {"decode": decode, "decode_by_model": by_model, "prefills": prefills, "kv": kv, "calls": calls,
                "gc": collections}


def call_engine(engine: Engine, call: EngineCall) -> Any:
    """One engine call as a backend makes it, timed into the engine's StepTimings when it keeps them (the
    summary's `calls`: where an instance's time goes, method by method)."""
    started, clock = time.perf_counter(), time.monotonic()
    try:
        return call.run(engine)
    finally:
        if engine.timings is not None:
            engine.timings.call(call.name, clock, time.perf_counter() - started)
