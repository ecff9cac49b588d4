"""The `sim` engine (cost-model timing, placeholder text) and the gateway's overload answers on top of it."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from pool.actor import EngineSpec, make_engine
from pool.engines.base import EngineError, GenRequest, OutOfKvMemory, SamplingParams, TokenOut
from pool.engines.sim_engine import SIM_LABEL, PlaceholderTokenizer, SimEngine
from pool.gateway import GatewaySettings, create_app
from pool.gateway.server import BackgroundServer
from pool.config import PoolConfig
from pool.service import LivePool, ServedModel, served_model, slot_instances
from scheduler import ModelProfile
from tests.factories import LinearCosts

GB = 1e9


def gen(rid: str, model: str = "a", prompt: int = 4, max_tokens: int = 5, **sampling) -> GenRequest:
    return GenRequest(rid, model, tuple(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, **sampling))


def engine(**options) -> SimEngine:
    sim = SimEngine(LinearCosts(step_s=0.01, switch_s=0.05), kv_bytes_per_token={"a": 100, "b": 200}, **options)
    sim.load("a", None)
    sim.load("b", None)
    return sim


def test_sim_engine_times_calls_by_the_cost_model_and_labels_its_text():
    sim = engine(kv_bytes=10_000)
    started = time.perf_counter()
    assert sim.activate("a") == pytest.approx(0.05)
    first = sim.prefill([gen("r1"), gen("r2", stop=("dolor",))])
    outs = [first]
    while any(not o.finished for o in outs[-1]):
        outs.append(sim.decode_step([o.request_id for o in outs[-1] if not o.finished]))
    assert time.perf_counter() - started >= 0.05 + 0.01 * (len(outs) - 1)
    r1 = "".join(o.text for step in outs for o in step if o.request_id == "r1")
    r2 = "".join(o.text for step in outs for o in step if o.request_id == "r2")
    assert r1 == f"{SIM_LABEL} lorem ipsum dolor sit" and r2 == f"{SIM_LABEL} lorem ipsum "
    finals = [o for step in outs for o in step if o.finished]
    assert {(o.request_id, o.finish_reason) for o in finals} == {("r1", "length"), ("r2", "stop")}
    assert sim.stats().num_requests == 0 and sim.stats().num_switches == 1


def test_sim_engine_keeps_the_engine_contract():
    sim = engine(kv_bytes=2_000, time_scale=0)
    with pytest.raises(EngineError):
        sim.prefill([gen("r1")])  # no model active
    sim.activate("a")
    with pytest.raises(OutOfKvMemory):
        sim.prefill([gen("big", prompt=30)])  # 31 tokens x 100 B > 2000 B
    sim.prefill([gen("r1"), gen("r2")])
    sim.save_kv(["r1"])
    assert sim.stats().kv_device_used_bytes == 5 * 100 and sim.stats().bytes_d2h == 500
    with pytest.raises(EngineError):
        sim.decode_step(["r1"])  # KV in host memory
    sim.restore_kv(["r1"])
    sim.prefetch("b")
    assert sim.activate("b") == 0.0  # prefetched: free
    with pytest.raises(EngineError):
        sim.decode_step(["r1"])  # model a is not active
    sim.release(["r2", "unknown"])
    assert sim.stats().num_requests == 1


def test_sim_engine_moves_a_request_to_another_engine():
    one, two = engine(time_scale=0), engine(time_scale=0)
    one.activate("a")
    one.prefill([gen("r1", max_tokens=4)])
    one.decode_step(["r1"])
    (export,) = one.export_kv(["r1"])
    assert export.num_tokens == 4 + 2 - 1 and isinstance(export.kv, np.ndarray) and one.stats().num_requests == 0
    two.import_kv([export])
    two.activate("a")
    two.restore_kv(["r1"])
    outs: list[TokenOut] = two.decode_step(["r1"]) + two.decode_step(["r1"])
    assert [o.text for o in outs] == [" ipsum", " dolor"] and outs[-1].finish_reason == "length"


def test_placeholder_tokenizer_and_make_engine():
    tok = PlaceholderTokenizer()
    ids = tok("What is the capital of France?")["input_ids"]
    assert len(ids) == 7 and all(3 <= i < tok.vocab_size for i in ids)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).endswith("assistant\n")
    sim = make_engine(EngineSpec("sim", {"costs": LinearCosts(), "time_scale": 0}))
    assert isinstance(sim, SimEngine)


# ---- the gateway on a sim pool: labelled text, 429 and 503 -------------------------------------------
SLOW_PREFILL = LinearCosts(step_s=0.005, prefill_per_token_s=0.15, switch_s=0.0)


@pytest.fixture(scope="module")
def sim_served(demo_models):
    catalogue = ModelProfile("catalog-7b", 1, 15.2 * GB, 57344, 32768, 10.0, 0.1)
    models = [served_model(n, demo_models[n]) for n in ("tiny-llama", "tiny-qwen2")]
    models.append(ServedModel("catalog-7b", Path("<sim>/catalog-7b"), catalogue))
    instances = slot_instances(1, models, 1 << 30)
    spec = EngineSpec("sim", {"costs": SLOW_PREFILL, "kv_bytes": int(instances[0].memory_bytes),
                              "kv_bytes_per_token": {m.name: m.profile.kv_bytes_per_token for m in models}})
    pool = LivePool(models, instances, "token-level", SLOW_PREFILL,
                    PoolConfig(engine=spec, backend="threads", max_queued_per_model=1, max_requests=2,
                               retry_after_s=2.0)).start()
    settings = GatewaySettings(owned_by="modelpool-sim", fingerprint="modelpool-sim")
    with BackgroundServer(create_app(pool, settings)) as server:
        yield pool, server.url
    pool.stop()


def test_sim_pool_answers_in_labelled_placeholder_text(sim_served):
    _, url = sim_served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    cards = {m.id: m for m in client.models.list()}
    assert cards["catalog-7b"].owned_by == "modelpool-sim" and cards["catalog-7b"].max_model_len > 1000
    chat = client.chat.completions.create(model="catalog-7b", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3)
    assert chat.choices[0].message.content == f"{SIM_LABEL} lorem ipsum" and chat.system_fingerprint == "modelpool-sim"


def test_full_model_queue_gets_429_and_a_full_pool_503_with_retry_after(sim_served):
    pool, url = sim_served
    ended = []
    sink = lambda item: ended.append(item) if isinstance(item, BaseException) or item.finished else None  # noqa: E731
    body = {"prompt": "one two three four five six", "max_tokens": 2}
    pool.submit("first", "tiny-llama", list(range(1, 8)), SamplingParams(max_tokens=2), sink)  # ~1 s of prefill
    queued = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", **body})
    assert queued.status_code == 429 and queued.headers["retry-after"] == "2"
    assert queued.json()["error"]["code"] == "model_queue_full"
    pool.submit("second", "tiny-qwen2", list(range(1, 8)), SamplingParams(max_tokens=2), sink)
    full = httpx.post(f"{url}/v1/completions", json={"model": "catalog-7b", **body})
    assert full.status_code == 503 and full.headers["retry-after"] == "2"
    assert full.json()["error"]["code"] == "pool_full"
    deadline = time.monotonic() + 20
    while len(ended) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ended) == 2 and not any(isinstance(e, BaseException) for e in ended)
    assert httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", **body}, timeout=30).status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    assert 'modelpool_requests_rejected_total{model_name="tiny-llama",reason="queue_full"} 1.0' in metrics
    assert 'modelpool_request_errors_total{model_name="catalog-7b",status="503"} 1.0' in metrics
