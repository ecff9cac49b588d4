"""The live pool's own host costs, measured on an idle pool whose engine takes no time (no GPU needed).

One mixed instance of `pool.service.LivePool` (threads backend, `request-level` policy) runs a
`pool.engines.sim_engine.SimEngine` at time scale 0: every engine call returns at once, so what a request
waits for is the pool itself. Each engine call is timed where the backend makes it; each token where its
request's stream gets it. Measured (`sims.profiles.measurements.HostPoints`):

- admission: one request at a time, submit to its prefill call's start (`admit_s`), and that call's return
  to the token at the stream (`deliver_s`);
- per decode batch size, the median time between consecutive decode calls of that batch: the pool's time
  per engine call and per token it delivers (fitted as host_call_s + host_token_s x batch).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pool.config import PoolConfig
from pool.engines.base import GenRequest, SamplingParams, TokenOut
from pool.engines.sim_engine import SimEngine
from pool.served import ServedModel
from pool.service import LivePool
from scheduler import InstanceSpec, ModelProfile
from scheduler.fleet import Arch
from sims.costmodel import RooflineCostModel
from sims.profiles.measurements import HostPoints

WAIT_S = 120.0
MODEL = "host-probe"
_ARCH = Arch(family="llama", num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=64,
             vocab_size=256, max_context=4096)


class _TimedEngine:
    """The engine, with the start and end of each prefill and decode_step call recorded (in the worker thread)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.prefills: list[tuple[float, float]] = []  # (start, end)
        self.decodes: list[tuple[int, float]] = []  # (batch, start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def prefill(self, requests: Sequence[GenRequest]) -> Any:
        started = time.perf_counter()
        out = self._engine.prefill(requests)
        self.prefills.append((started, time.perf_counter()))
        return out

    def decode_step(self, request_ids: Sequence[str]) -> Any:
        self.decodes.append((len(request_ids), time.perf_counter()))
        return self._engine.decode_step(request_ids)


class _GivenEnginePool(LivePool):
    """A LivePool whose one instance runs the engine built here."""

    def __init__(self, engine: Any, *args: Any, **kwargs: Any) -> None:
        self._given = engine
        super().__init__(*args, **kwargs)

    def _new_engine(self, *_: Any) -> Any:
        return self._given


class _Client:
    """The stream side of requests: every token's arrival time, and a flag when each request ends."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.ended: dict[str, threading.Event] = {}
        self.errors: list[BaseException] = []

    def sink(self, request_id: str) -> Any:
        self.times[request_id], self.ended[request_id] = [], threading.Event()

        def take(item: TokenOut | BaseException) -> None:
            if isinstance(item, BaseException):
                self.errors.append(item)
                self.ended[request_id].set()
                return
            self.times[request_id].append(time.perf_counter())
            if item.finished:
                self.ended[request_id].set()
        return take

    def wait(self, request_ids: Sequence[str]) -> None:
        deadline = time.perf_counter() + WAIT_S
        for rid in request_ids:
            if not self.ended[rid].wait(max(0.0, deadline - time.perf_counter())):
                raise RuntimeError(f"idle-pool probe: request {rid} did not finish within {WAIT_S:g} s")
        if self.errors:
            raise RuntimeError(f"idle-pool probe: the pool failed a request: {self.errors[0]!r}")


def measure_host(probes: int = 20, batches: Sequence[int] = (1, 4, 16), tokens: int = 32) -> HostPoints:
    """The idle pool's host costs: `probes` single requests for admission and delivery, then per batch size
    `tokens` decode steps."""
    costs = RooflineCostModel.for_models({MODEL: (_ARCH, 1)}, "h200")  # paces nothing: the engine's scale is 0
    engine = _TimedEngine(SimEngine(costs, kv_bytes=1 << 30, time_scale=0.0,
                                    kv_bytes_per_token={MODEL: _ARCH.kv_bytes_per_token}))
    profile = ModelProfile(MODEL, 1, _ARCH.weight_bytes, _ARCH.kv_bytes_per_token, _ARCH.max_context, 60.0, 1.0)
    instance = InstanceSpec("host0", 1, float(1 << 31), "mixed")
    engine.load(MODEL, None)
    pool = _GivenEnginePool(engine, [ServedModel(MODEL, Path("zero-time") / MODEL, profile)], [instance],
                            "request-level", costs, PoolConfig(backend="threads"))
    client, counter = _Client(), [0]

    def submit(max_tokens: int) -> str:
        counter[0] += 1
        rid = f"host{counter[0]}"
        pool.submit(rid, MODEL, list(range(16)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), client.sink(rid))
        return rid

    admit, deliver = [], []
    by_batch: dict[int, float] = {}
    with pool:
        client.wait([submit(4)])  # warm-up: the model's first switch, the threads' first calls
        for _ in range(probes):
            calls = len(engine.prefills)
            submitted = time.perf_counter()
            rid = submit(1)
            client.wait([rid])
            started, ended = engine.prefills[calls]
            admit.append(started - submitted)
            deliver.append(client.times[rid][0] - ended)
        for batch in batches:
            first = len(engine.decodes)
            client.wait([submit(tokens) for _ in range(batch)])
            starts = [at for size, at in engine.decodes[first:] if size == batch]
            gaps = [b - a for a, b in zip(starts, starts[1:])]
            if gaps:
                by_batch[batch] = round(statistics.median(gaps), 7)
    return HostPoints(step_s_by_batch=by_batch, admit_s=[round(x, 7) for x in admit],
                      deliver_s=[round(x, 7) for x in deliver])
