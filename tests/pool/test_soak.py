"""Soak: the 2-minute version of benchmarks/soak.py, and the KV leak the soak found.

The soak runs `modelpool serve --engine sim` under streamed and plain,
finished and abandoned requests of four models and fails on any error, on a
pool that does not drain to nothing afterwards, and on RSS growth beyond 10%
after the warm-up. Its first runs left requests that were cancelled while
their KV moved from the prefill to the decode instance in the decode
engine for good; the deterministic tests below pin that down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pool.actor import EngineSpec, make_engine
from pool.backends import InProcessBackend
from pool.controller import Controller
from pool.engines.base import SamplingParams
from pool.runner import LiveRequest
from pool.service import ServedModel, slot_instances
from scheduler import ManualClock, ModelProfile, make_scheduler
from tests.factories import LinearCosts

REPO = Path(__file__).resolve().parents[2]


class Recording:
    """An engine that remembers the request ids of every call to `method` (then does it)."""

    def __init__(self, engine, method: str) -> None:
        self.engine, self.method, self.calls = engine, method, []

    def __getattr__(self, name):
        attr = getattr(self.engine, name)
        if name != self.method:
            return attr

        def record(arg):
            self.calls.append([getattr(x, "request", x) for x in arg])
            return attr(arg)
        return record


@pytest.mark.parametrize("cancel_during", ["export_kv", "import_kv"])
def test_request_cancelled_while_its_kv_moves_to_the_decode_instance_is_freed_there(cancel_during):
    costs = LinearCosts()
    models = [ServedModel("a", Path("<sim>/a"), ModelProfile("a", 1, 1e9, 1000, 4096, 10.0, 0.1))]
    instances = slot_instances(2, models, 1 << 30, roles=["prefill", "decode"])
    engines = {}
    for spec in instances:
        engines[spec.instance_id] = make_engine(EngineSpec("sim", {"costs": costs, "time_scale": 0, "kv_bytes": 1 << 30,
                                                                   "kv_bytes_per_token": {"a": 1000}}))
        engines[spec.instance_id].load("a", None)
    watched = "slot0" if cancel_during == "export_kv" else "slot1"  # slot0 prefills, slot1 decodes
    engines[watched] = Recording(engines[watched], cancel_during)
    backend, clock = InProcessBackend(engines), ManualClock()
    controller = Controller(make_scheduler("token-level", {"a": models[0].profile}, instances, costs), backend, clock,
                            [spec.instance_id for spec in instances])
    tokens = []
    controller.submit(LiveRequest("r1", "a", [1, 2, 3, 4], SamplingParams(max_tokens=20), clock.now(),
                                  sink=tokens.append))
    controller.tick()
    for _ in range(500):
        clock.advance(0.001)
        results = backend.poll(0.0)  # the in-process backend ran the calls already; results come now
        if engines[watched].calls and "r1" in controller.requests:
            controller.cancel("r1")  # the client leaves while the KV is in flight
        for handle, result in results:
            controller.complete(handle, result)
        controller.tick()
    assert engines[watched].calls, f"the request never reached {cancel_during}"
    assert tokens and not tokens[-1].finished and not controller.requests  # cancelled part-way
    assert {iid: engine.stats().num_requests for iid, engine in engines.items()} == {"slot0": 0, "slot1": 0}


@pytest.mark.slow
def test_two_minute_soak_keeps_rss_flat_with_no_errors(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--duration", "120", "--warmup", "40",
                           "--sample-s", "2", "--clients", "3", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["errors"] == 0, result["error_examples"]
    assert result["drained"]
    assert result["completed"] >= 100 and result["cancelled"] >= 10  # it did carry load, and abandoned some
    assert set(result["requests_by_kind"]) == {"chat-stream", "chat", "completion-stream", "completion"}
    assert result["num_samples_after_warmup"] >= 30
    assert result["max_growth_pct"] <= 10.0, result["rss_samples"]
    assert result["passed"] and proc.returncode == 0, proc.stdout
