"""The live pool's own host costs, measured on an idle pool whose engine takes no time (no GPU needed).

One mixed instance of `pool.service.LivePool` (threads backend, `request-level` policy) runs a
`pool.engines.sim_engine.SimEngine` at time scale 0: every engine call returns at once, so what a request
waits for is the pool itself. Each engine call is timed where the backend makes it; each token where its
request's stream gets it. Measured (`sims.profiles.measurements.HostPoints`):

- admission: one request at a time, submit to its prefill call's start (`admit_s`), and that call's return
  to the token at the stream (`deliver_s`);
- per decode batch size, the median time between consecutive decode calls of that batch: the pool's time
  per engine call and per token it delivers (fitted as host_call_s + host_token_s x batch);
- hand-offs: on a token-level pair of a prefill and a decode instance (zero-time engines too), one request at a
  time, the return of its last call there to its first decode call on the other instance (`handoff_s`: the pool's KV
  moves' host time, `kv_call_host_s`).
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
HANDOFF_TOKENS = 32  # past token-level's first tokens on the prefill instance: the rest decode after the hand-off
MODEL = "host-probe"
_ARCH = Arch(family="llama", num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=64,
             vocab_size=256, max_context=4096)


class _TimedEngine:
    """The engine, with the start and end of each prefill and decode_step call recorded (in the worker thread)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.prefills: list[tuple[float, float]] = []  # (start, end)
        self.last_end: dict[str, float] = {}  # request id -> the end of the last prefill or decode call it was in
        self.decodes: list[tuple[int, float]] = []  # (batch, start)
        self.first_decode: dict[str, float] = {}  # request id -> the start of its first decode call here

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def prefill(self, requests: Sequence[GenRequest]) -> Any:
        started = time.perf_counter()
        out = self._engine.prefill(requests)
        ended = time.perf_counter()
        self.prefills.append((started, ended))
        self.last_end.update((r.request_id, ended) for r in requests)
        return out

    def decode_step(self, request_ids: Sequence[str]) -> Any:
        started = time.perf_counter()
        self.decodes.append((len(request_ids), started))
        for rid in request_ids:
            self.first_decode.setdefault(rid, started)
        out = self._engine.decode_step(request_ids)
        self.last_end.update(dict.fromkeys(request_ids, time.perf_counter()))
        return out


class _GivenEnginePool(LivePool):
    """A LivePool whose instances run the engines built here (instance id -> engine)."""

    def __init__(self, engines: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self._given = engines
        super().__init__(*args, **kwargs)

    def _new_engine(self, instance_id: str) -> Any:
        return self._given[instance_id]


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


def _zero_time_engine(costs: RooflineCostModel) -> _TimedEngine:
    engine = _TimedEngine(SimEngine(costs, kv_bytes=1 << 30, time_scale=0.0,
                                    kv_bytes_per_token={MODEL: _ARCH.kv_bytes_per_token}))
    engine.load(MODEL, None)
    return engine


def measure_host(probes: int = 20, batches: Sequence[int] = (1, 4, 16), tokens: int = 32) -> HostPoints:
    """The idle pool's host costs: `probes` single requests for admission and delivery, then per batch size
    `tokens` decode steps, then `probes` hand-offs on a prefill/decode pair."""
    costs = RooflineCostModel.for_models({MODEL: (_ARCH, 1)}, "h200")  # paces nothing: the engine's scale is 0
    profile = ModelProfile(MODEL, 1, _ARCH.weight_bytes, _ARCH.kv_bytes_per_token, _ARCH.max_context, 60.0, 1.0)
    served = [ServedModel(MODEL, Path("zero-time") / MODEL, profile)]
    engine = _zero_time_engine(costs)
    pool = _GivenEnginePool({"host0": engine}, served, [InstanceSpec("host0", 1, float(1 << 31), "mixed")],
                            "request-level", costs, PoolConfig(backend="threads"))
    client, counter = _Client(), [0]

    def submit(to: LivePool, max_tokens: int) -> str:
        counter[0] += 1
        rid = f"host{counter[0]}"
        to.submit(rid, MODEL, list(range(16)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), client.sink(rid))
        return rid

    admit, deliver = [], []
    by_batch: dict[int, float] = {}
    with pool:
        client.wait([submit(pool, 4)])  # warm-up: the model's first switch, the threads' first calls
        for _ in range(probes):
            calls = len(engine.prefills)
            submitted = time.perf_counter()
            rid = submit(pool, 1)
            client.wait([rid])
            started, ended = engine.prefills[calls]
            admit.append(started - submitted)
            deliver.append(client.times[rid][0] - ended)
        for batch in batches:
            first = len(engine.decodes)
            client.wait([submit(pool, tokens) for _ in range(batch)])
            starts = [at for size, at in engine.decodes[first:] if size == batch]
            gaps = [b - a for a, b in zip(starts, starts[1:])]
            if gaps:
                by_batch[batch] = round(statistics.median(gaps), 7)
    return HostPoints(step_s_by_batch=by_batch, admit_s=[round(x, 7) for x in admit],
                      deliver_s=[round(x, 7) for x in deliver], handoff_s=measure_handoffs(probes))


def measure_handoffs(probes: int) -> list[float]:
    """Per request, one at a time, on an idle token-level pool of a prefill and a decode instance (zero-time
    engines, threads backend): the return of its last call on the prefill instance (which decodes its first
    tokens) to its first decode call's start on the decode instance (the pool's SwapOut, SwapIn and the ticks
    between them, and the decode call's own host time)."""
    costs = RooflineCostModel.for_models({MODEL: (_ARCH, 1)}, "h200")
    profile = ModelProfile(MODEL, 1, _ARCH.weight_bytes, _ARCH.kv_bytes_per_token, _ARCH.max_context, 60.0, 1.0)
    engines = {"pre0": _zero_time_engine(costs), "dec0": _zero_time_engine(costs)}
    instances = [InstanceSpec("pre0", 1, float(1 << 31), "prefill"), InstanceSpec("dec0", 1, float(1 << 31), "decode")]
    pool = _GivenEnginePool(engines, [ServedModel(MODEL, Path("zero-time") / MODEL, profile)], instances,
                            "token-level", costs, PoolConfig(backend="threads"))
    client, gaps = _Client(), []
    with pool:
        for k in range(probes + 1):  # the first one warms the threads up
            rid = f"handoff{k}"
            pool.submit(rid, MODEL, list(range(16)), SamplingParams(max_tokens=HANDOFF_TOKENS, ignore_eos=True),
                        client.sink(rid))
            client.wait([rid])
            prefilled, decoded = engines["pre0"].last_end.get(rid), engines["dec0"].first_decode.get(rid)
            if prefilled is None or decoded is None:
                raise RuntimeError(f"idle-pool probe: request {rid} was not handed from pre0 to dec0")
            if k:
                gaps.append(round(decoded - prefilled, 7))
    return gaps
