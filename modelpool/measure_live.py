"""The live pool's own host costs, measured on an idle pool whose engine takes no time (no GPU needed).

One mixed instance of `pool.service.LivePool` (`request-level` policy) runs the `sim` engine
(`pool.engines.sim_engine.SimEngine`) at time scale 0 on the backend serve runs its engines on
(`modelpool.serve.default_backend`: in Ray actors or OS processes, or threads here): every engine call returns
at once, so what a request waits for is the pool itself. Each engine call is timed where the pool makes it, in
this process: issued when the controller hands it to the backend, answered when the backend's poll gives its
result back - so a call to an engine in another process includes the hop (pickling, the pipe or Ray's object
store) that serve pays. Each token is timed where its request's stream gets it. Measured
(`sims.profiles.measurements.HostPoints`, which names the backend):

- admission: one request at a time, submit to its prefill call's issue (`admit_s`), and that call's answer
  to the token at the stream (`deliver_s`);
- the same through the gateway, as clients measure (`gateway_points`): requests of 16, 512 and 4096 prompt
  tokens one at a time from a streaming client in another process through the gateway app under uvicorn, the
  client's send to the pool's submit and each token from the pool's stream to the client's read (the terms
  `request_admit_s`, `request_prompt_token_s` and `token_deliver_s` come from these);
- per decode batch size, the median time between consecutive decode calls of that batch: the pool's time
  per engine call and per token it delivers (fitted as host_call_s + host_token_s x batch);
- hand-offs: on a token-level pair of a prefill and a decode instance (zero-time engines too), one request at a
  time, the answer of its last call there to its first decode call's issue on the other instance (`handoff_s`:
  the pool's KV moves' host time, `kv_call_host_s`).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpool.replay import request_body, stream_completion
from modelpool.validate import PROMPT_VOCAB  # prompt ids drawn as validate's replay draws them
from pool.actor import EngineSpec
from pool.config import PoolConfig
from pool.engines.base import SamplingParams, TokenOut
from pool.served import ServedModel
from pool.service import LivePool
from scheduler import InstanceSpec, ModelProfile
from scheduler.fleet import Arch
from sims.costmodel import RooflineCostModel
from sims.profiles.measurements import GatewayPoint, HostPoints

WAIT_S = 120.0
HANDOFF_TOKENS = 32  # past token-level's first tokens on the prefill instance: the rest decode after the hand-off
MODEL = "host-probe"
_ARCH = Arch(family="llama", num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=64,
             vocab_size=2048, max_context=8192)
GATEWAY_PROMPTS = (16, 512, 4096)  # prompt tokens of the gateway probe's requests (the gateway's work grows with them)
GATEWAY_TOKENS = 8  # tokens each streams: the first one's path, and the per-token path of the rest
_TIMED = frozenset({"prefill", "decode_step"})  # the engine calls a request's tokens come from


@dataclass(slots=True)
class _Call:
    instance_id: str
    name: str
    request_ids: tuple[str, ...]
    issued: float
    answered: float | None = None


class _TimedBackend:
    """The pool's backend, with each prefill and decode call timed in the pool's process: issued as the
    controller hands it over, answered when a poll gives its result back (the loop thread writes, the probe
    reads a copy once its requests have ended)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.log: list[_Call] = []
        self._by_handle: dict[int, _Call] = {}

    def __getattr__(self, name: str) -> Any:  # in_flight, unresponsive, retire, kill, replace, close
        return getattr(self._backend, name)

    def call(self, instance_id: str, call: Any) -> int:
        issued = time.perf_counter()
        handle = self._backend.call(instance_id, call)
        if call.name in _TIMED:
            timed = _Call(instance_id, call.name, tuple(call.request_ids), issued)
            self._by_handle[handle] = timed
            self.log.append(timed)
        return handle

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        out = self._backend.poll(timeout_s)
        answered = time.perf_counter()
        for handle, _ in out:
            timed = self._by_handle.pop(handle, None)
            if timed is not None:
                timed.answered = answered
        return out

    def calls(self, since: int = 0) -> list[_Call]:
        return list(self.log[since:])


class _TimedPool(LivePool):
    """A LivePool whose backend is timed (`_TimedBackend`), and each request's submit and the arrival of each of
    its tokens at its sink (on the pool's loop thread, before the sink - the gateway's queue - takes it)."""

    timed: _TimedBackend

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.submitted: dict[str, float] = {}
        self.streamed: dict[str, list[float]] = {}

    def _start_backend(self, ids: Sequence[str]) -> Any:
        self.timed = _TimedBackend(super()._start_backend(ids))
        return self.timed

    def submit(self, request_id: str, model: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
               sink: Any) -> None:
        times: list[float] = []

        def timed(item: TokenOut | BaseException) -> None:
            if not isinstance(item, BaseException):
                times.append(time.perf_counter())
            sink(item)

        self.streamed[request_id] = times
        self.submitted[request_id] = time.perf_counter()
        super().submit(request_id, model, prompt_token_ids, sampling, timed)


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


def _zero_time_pool(backend: str, instances: Sequence[InstanceSpec], policy: str) -> _TimedPool:
    """A pool of `instances` serving one model on the sim engine at time scale 0, on `backend`."""
    costs = RooflineCostModel.for_models({MODEL: (_ARCH, 1)}, "h200")  # paces nothing: the engine's scale is 0
    profile = ModelProfile(MODEL, 1, _ARCH.weight_bytes, _ARCH.kv_bytes_per_token, _ARCH.max_context, 60.0, 1.0)
    engine = EngineSpec("sim", {"costs": costs, "kv_bytes": 1 << 30, "time_scale": 0.0,
                                "kv_bytes_per_token": {MODEL: _ARCH.kv_bytes_per_token}})
    return _TimedPool([ServedModel(MODEL, Path("zero-time") / MODEL, profile)], instances, policy, costs,
                      PoolConfig(engine=engine, backend=backend))  # type: ignore[arg-type]


def measure_host(backend: str, probes: int = 20, batches: Sequence[int] = (1, 4, 16), tokens: int = 32) -> HostPoints:
    """The idle pool's host costs on `backend` (ray, processes or threads): `probes` single requests for
    admission and delivery, then per batch size `tokens` decode steps, then `probes` hand-offs on a
    prefill/decode pair. On Ray, where no cluster is joined yet, an embedded one is started for it (its actors
    on CPU: a zero-time engine needs no GPU, and two of them may not share one) and shut down after."""
    started = backend == "ray" and _start_ray()
    try:
        by_batch, admit, deliver, gateway = _measure_mixed(backend, probes, batches, tokens)
        handoffs = measure_handoffs(backend, probes)
    finally:
        if started:
            import ray

            ray.shutdown()
    return HostPoints(backend=backend, step_s_by_batch=by_batch, admit_s=admit,  # type: ignore[arg-type]
                      deliver_s=deliver, handoff_s=handoffs, gateway=gateway)


def _start_ray() -> bool:
    """An embedded Ray cluster for the probe's actors, on CPU (True), unless one is joined already (False)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(os.cpu_count() or 1, 2), num_gpus=0)
    return True


def _mixed_pool(backend: str) -> _TimedPool:
    return _zero_time_pool(backend, [InstanceSpec("host0", 1, float(1 << 31), "mixed")], "request-level")


def _measure_mixed(backend: str, probes: int, batches: Sequence[int],
                   tokens: int) -> tuple[dict[int, float], list[float], list[float], list[GatewayPoint]]:
    pool = _mixed_pool(backend)
    client, counter = _Client(), [0]

    def submit(max_tokens: int) -> str:
        counter[0] += 1
        rid = f"host{counter[0]}"
        pool.submit(rid, MODEL, list(range(16)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    client.sink(rid))
        return rid

    admit, deliver = [], []
    by_batch: dict[int, float] = {}
    with pool:
        client.wait([submit(4)])  # warm-up: the model's first switch, the first calls through the backend
        for _ in range(probes):
            since = len(pool.timed.log)
            submitted = time.perf_counter()
            rid = submit(1)
            client.wait([rid])
            issued, answered = _prefill_times(pool, rid, since)
            admit.append(round(issued - submitted, 7))
            deliver.append(round(client.times[rid][0] - answered, 7))
        for batch in batches:
            since = len(pool.timed.log)
            client.wait([submit(tokens) for _ in range(batch)])
            starts = [c.issued for c in pool.timed.calls(since)
                      if c.name == "decode_step" and len(c.request_ids) == batch]
            gaps = [b - a for a, b in zip(starts, starts[1:])]
            if gaps:
                by_batch[batch] = round(statistics.median(gaps), 7)
        gateway = gateway_points(pool, probes)
    return by_batch, admit, deliver, gateway


def _prefill_times(pool: _TimedPool, request_id: str, since: int = 0) -> tuple[float, float]:
    """When `request_id`'s prefill call (among the calls from `since`) was issued and answered: a poll gives its
    result back before the controller sends the token on, so a token without the answer is a broken probe."""
    prefill = next(c for c in pool.timed.calls(since) if c.name == "prefill" and request_id in c.request_ids)
    if prefill.answered is None:
        raise RuntimeError(f"idle-pool probe: request {request_id}'s token came before its prefill's answer")
    return prefill.issued, prefill.answered


def measure_handoffs(backend: str, probes: int) -> list[float]:
    """Per request, one at a time, on an idle token-level pool of a prefill and a decode instance (zero-time
    engines on `backend`): the answer of its last call on the prefill instance (which decodes its first tokens)
    to its first decode call's issue on the decode instance (the pool's SwapOut, SwapIn and the ticks between
    them, and the decode call's own host time)."""
    instances = [InstanceSpec("pre0", 1, float(1 << 31), "prefill"), InstanceSpec("dec0", 1, float(1 << 31), "decode")]
    pool = _zero_time_pool(backend, instances, "token-level")
    client, gaps = _Client(), []
    with pool:
        for k in range(probes + 1):  # the first one warms the backend up
            rid = f"handoff{k}"
            since = len(pool.timed.log)
            pool.submit(rid, MODEL, list(range(16)), SamplingParams(max_tokens=HANDOFF_TOKENS, ignore_eos=True),
                        client.sink(rid))
            client.wait([rid])
            calls = [c for c in pool.timed.calls(since) if rid in c.request_ids]
            prefilled = [c.answered for c in calls if c.instance_id == "pre0" and c.answered is not None]
            decoded = [c.issued for c in calls if c.instance_id == "dec0" and c.name == "decode_step"]
            if not prefilled or not decoded:
                raise RuntimeError(f"idle-pool probe: request {rid} was not handed from pre0 to dec0")
            if k:
                gaps.append(round(decoded[0] - max(prefilled), 7))
    return gaps


def measure_gateway(backend: str, probes: int, prompts: Sequence[int] = GATEWAY_PROMPTS,
                    tokens: int = GATEWAY_TOKENS) -> list[GatewayPoint]:
    """`gateway_points` on a fresh idle zero-time pool (mixed, request-level) on `backend`."""
    pool = _mixed_pool(backend)
    with pool:
        return gateway_points(pool, probes, prompts, tokens)


def gateway_points(pool: _TimedPool, probes: int, prompts: Sequence[int] = GATEWAY_PROMPTS,
                   tokens: int = GATEWAY_TOKENS) -> list[GatewayPoint]:
    """The gateway's own time, per request, one at a time: the idle zero-time `pool` (running) behind the gateway
    app (`pool.gateway.app.create_app`) under uvicorn on a loopback port, as serve runs it, and a client in its
    own process, as `modelpool validate`'s is (`modelpool.replay.stream_completion`: httpx, /v1/completions with
    the prompt as token ids, streamed). `probes` requests of each prompt length in `prompts` (after one warm-up),
    `tokens` tokens each. Both processes read one clock (CLOCK_MONOTONIC).

    Per request (`GatewayPoint`): the client's send to the pool's submit (`in_s`: HTTP, the body's parsing and
    checks, the prompt's ids), and per token the pool's sink to the client's read of its SSE line (`out_s`: the
    hop onto the event loop, the chunk's JSON, the socket, the client's parsing); beside them, what the pool's
    own terms measure on the same request (`admit_s`, `deliver_s`) and the client's TTFT."""
    from pool.gateway.app import create_app
    from pool.gateway.server import BackgroundServer

    rng = random.Random(0)
    plan = [(16, 2)] + [(n, tokens) for n in prompts for _ in range(probes)]  # the first one warms up
    bodies = [request_body(MODEL, [rng.randrange(10, PROMPT_VOCAB) for _ in range(n)], m) for n, m in plan]
    with BackgroundServer(create_app(pool)) as server:
        results = _client_process(server.url, bodies)
    out = []
    for (n, _), result in list(zip(plan, results))[1:]:
        rid = result.get("id")
        if result.get("error") is not None or rid not in pool.submitted or not result["token_s"]:
            raise RuntimeError(f"gateway probe: a request of {n} prompt tokens failed: {result.get('error')}")
        streamed, client = pool.streamed[rid], result["token_s"]
        if len(client) != len(streamed):
            raise RuntimeError(f"gateway probe: request {rid} streamed {len(streamed)} tokens, its client read "
                               f"{len(client)}")
        issued, answered = _prefill_times(pool, rid)
        submitted = pool.submitted[rid]
        out.append(GatewayPoint(prompt_tokens=n, in_s=round(submitted - result["sent_s"], 7),
                                out_s=[round(c - s, 7) for c, s in zip(client, streamed)],
                                admit_s=round(issued - submitted, 7),
                                deliver_s=round(streamed[0] - answered, 7),
                                ttft_s=round(client[0] - result["sent_s"], 7),
                                client_gap_s=[round(b - a, 7) for a, b in zip(client, client[1:])],
                                pool_gap_s=[round(b - a, 7) for a, b in zip(streamed, streamed[1:])]))
    return out


def _client_process(url: str, bodies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`bodies` sent one after the other by a client in a fresh Python process (its own interpreter and GIL, as
    validate's client is): per request the send time and each token's read time, on CLOCK_MONOTONIC."""
    code = ("import json, sys; from modelpool.replay import one_by_one; "
            "json.dump(one_by_one(**json.load(sys.stdin)), sys.stdout)")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    job = {"url": url, "bodies": list(bodies), "timeout_s": WAIT_S}
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(job),
                          capture_output=True, text=True, timeout=WAIT_S, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"gateway probe: the client process failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)
