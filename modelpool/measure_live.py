"""What the live pool adds to each step: a short load through `pool.service.LivePool` (threads backend).

The pool runs one mixed instance on the calibration's own engine (random
weights, `request-level` policy), and its sinks time every token as a client
of the pool would get it. Against the same engine's calls, timed inside the
backend's worker thread:

- prefill probes: single requests, one after another, each to its first token
  (submit to sink), with the engine's prefill call alone;
- a decode load: `batch` requests at once, `tokens` tokens each; the median
  gap between a request's tokens at the sink, with the engine's decode_step.

`sims.profiles.calibrated` charges the difference between what the sink saw
and what the fitted engine terms predict as prefill_host_s and decode_host_s.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pool.engines.base import GenRequest, SamplingParams, TokenOut
from pool.served import ServedModel
from pool.service import LivePool
from scheduler import InstanceSpec, ModelProfile
from scheduler.fleet import Arch
from sims.costmodel import RooflineCostModel

LIVE_KEYS = ("prefill_probes", "prompt", "batch", "decode_prompt", "tokens")
WAIT_S = 300.0


class _TimedEngine:
    """The engine, with the wall time of each prefill and decode_step call recorded (in the worker thread)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.prefills: list[tuple[int, float]] = []  # (requests, seconds)
        self.decodes: list[tuple[int, float]] = []  # (batch, seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def prefill(self, requests: Sequence[GenRequest]) -> Any:
        started = time.perf_counter()
        out = self._engine.prefill(requests)
        self.prefills.append((len(requests), time.perf_counter() - started))
        return out

    def decode_step(self, request_ids: Sequence[str]) -> Any:
        started = time.perf_counter()
        out = self._engine.decode_step(request_ids)
        self.decodes.append((len(request_ids), time.perf_counter() - started))
        return out


class _GivenEnginePool(LivePool):
    """A LivePool whose one instance runs an engine built here (random weights; no model folders)."""

    def __init__(self, engine: Any, *args: Any, **kwargs: Any) -> None:
        self._given = engine
        super().__init__(*args, **kwargs)

    def _new_engine(self, *_: Any) -> Any:  # (instance id, in newer pools)
        return self._given


class _Client:
    """The sink side of requests: every token's arrival time, and a flag when each request ends."""

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
                raise RuntimeError(f"calibration load: request {rid} did not finish within {WAIT_S:g} s")
        if self.errors:
            raise RuntimeError(f"calibration load: the pool failed a request: {self.errors[0]!r}")


def measure_live(engine: Any, name: str, arch: Arch, plan: dict[str, int], kv_bytes: int) -> dict[str, Any]:
    """Prefill probes and a decode load of model `name` through a live pool on `engine`."""
    plan = {key: int(plan[key]) for key in LIVE_KEYS}
    timed = _TimedEngine(engine)
    profile = ModelProfile(name, 1, arch.weight_bytes, arch.kv_bytes_per_token, arch.max_context, 60.0, 1.0)
    costs = RooflineCostModel.for_models({name: (arch, 1)}, "h200")  # the policy's predictions only
    instance = InstanceSpec("calibrate0", 1, 0.9 * kv_bytes + arch.weight_bytes, "mixed")
    pool = _GivenEnginePool(timed, [ServedModel(name, Path("random-weights") / name, profile)], [instance],
                            "request-level", costs, backend="threads")
    client, counter = _Client(), [0]
    gen = torch.Generator().manual_seed(1)

    def submit(prompt: int, max_tokens: int) -> str:
        counter[0] += 1
        rid = f"live{counter[0]}"
        tokens = torch.randint(0, arch.vocab_size, (prompt,), generator=gen).tolist()
        pool.submit(rid, name, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), client.sink(rid))
        return rid

    with pool:
        client.wait([submit(plan["decode_prompt"], plan["tokens"]) for _ in range(plan["batch"])])  # warm-up
        probes = []
        for _ in range(plan["prefill_probes"]):
            submitted = time.perf_counter()
            rid = submit(plan["prompt"], 1)
            client.wait([rid])
            probes.append({"tokens": plan["prompt"], "ttft_s": round(client.times[rid][0] - submitted, 6),
                           "engine_s": round(timed.prefills[-1][1], 6)})
        first_decode = len(timed.decodes)
        ids = [submit(plan["decode_prompt"], plan["tokens"]) for _ in range(plan["batch"])]
        client.wait(ids)
    gaps = [later - earlier for rid in ids for earlier, later in zip(client.times[rid][1:], client.times[rid][2:])]
    steps = [seconds for batch, seconds in timed.decodes[first_decode:] if batch == plan["batch"]]
    return {"arch": name, "policy": "request-level", "backend": "threads", "prefill": probes,
            "decode": {"batch": plan["batch"], "context": plan["decode_prompt"] + plan["tokens"] // 2,
                       "gap_s": round(statistics.median(gaps), 7) if gaps else None,
                       "engine_s": round(statistics.median(steps), 7) if steps else None, "num_gaps": len(gaps)}}
