"""The gateway over real loopback sockets: httpx and the official openai client against the torch engine on CPU.

One in-process pool (token-level, one CPU slot, two tiny models) behind
uvicorn on a free port serves most tests; the ones that stop a pool or need
keys build their own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from pool.actor import EngineSpec
from pool.gateway import GatewaySettings, create_app
from pool.gateway.auth import Secret
from pool.gateway.server import BackgroundServer
from pool.config import PoolConfig
from pool.service import LivePool, served_model, slot_instances
from tests.factories import LinearCosts

MODELS = ("tiny-llama", "tiny-qwen2")
KV_BYTES = 32 << 20
ENGINE = EngineSpec("torch", {"dtype": "float32", "kv_bytes": KV_BYTES})
VLLM_NAMES = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
POOL_NAMES = ("modelpool_model_switches_total", "modelpool_switch_seconds_total", "modelpool_kv_swapped_bytes_total",
              "modelpool_instance_loaded_model", "modelpool_kv_swaps_total")
CHAT = [{"role": "user", "content": "Tell me a story about the sea."}]


def make_pool(demo_models: dict[str, Path], **limits) -> LivePool:
    models = [served_model(name, demo_models[name], dtype="float32") for name in MODELS]
    return LivePool(models, slot_instances(1, models, KV_BYTES), "token-level", LinearCosts(),
                    PoolConfig(engine=ENGINE, backend="inprocess", stats_interval_s=0.2, **limits))


@pytest.fixture(scope="module")
def served(demo_models):
    pool = make_pool(demo_models).start()
    with BackgroundServer(create_app(pool)) as server:
        yield pool, server.url
    pool.stop()


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[1]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list_and_card(url):
    listing = httpx.get(f"{url}/v1/models").json()
    assert listing["object"] == "list"
    cards = {card["id"]: card for card in listing["data"]}
    assert set(cards) == set(MODELS)
    for card in cards.values():
        assert card["object"] == "model" and card["owned_by"] == "modelpool" and card["root"]
        assert 0 < card["max_model_len"] <= 2048
    assert httpx.get(f"{url}/v1/models/tiny-qwen2").json() == cards["tiny-qwen2"]
    missing = httpx.get(f"{url}/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_openai_client_completions_and_chat_with_usage(client):
    done = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=7,
                                     extra_body={"ignore_eos": True})
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 7 and done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + 7
    chat = client.chat.completions.create(model="tiny-qwen2", messages=CHAT, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5


def test_streamed_chat_matches_the_non_streamed_answer_and_ends_with_usage(client):
    args = dict(model="tiny-llama", messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_is_unbuffered_each_token_leaves_as_it_is_made(url):
    body = {"model": "tiny-qwen2", "prompt": "The sea", "max_tokens": 60, "ignore_eos": True, "stream": True}
    arrivals, events = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                arrivals.append(time.perf_counter())
                events.append(line)
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[0]
    assert len(chunks) >= 30  # one event per token with text, not one blob
    span = arrivals[-1] - arrivals[0]  # ~60 decode steps of a few ms each
    assert span > 0.1 and sum(arrivals[-1] - t > span / 4 for t in arrivals) >= len(arrivals) // 4


def test_engine_fields_pass_through(client):
    def text(temperature: float, **extra) -> str:
        return client.completions.create(model="tiny-llama", prompt="A", max_tokens=10, temperature=temperature,
                                         extra_body={"ignore_eos": True, **extra}).choices[0].text

    assert text(1.0, seed=7) == text(1.0, seed=7)
    greedy = text(0.0)
    assert text(1.0, top_k=1) == greedy
    assert text(0.0, repetition_penalty=1.3)
    stop = greedy[4:7]
    stopped = client.completions.create(model="tiny-llama", prompt="A", max_tokens=10, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == greedy[: greedy.find(stop)]


BAD_REQUESTS = [  # (path, body, param)
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": "five"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "sea " * 3000}, "prompt"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"model": "tiny-llama"}, "prompt"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": CHAT, "logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{p}-{b}" for p, _, b in BAD_REQUESTS])
def test_bad_requests_get_400_naming_the_field(url, path, body, param):
    response = httpx.post(f"{url}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_bad_json_unknown_model_and_unknown_route(url, client):
    raw = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=99_999)
    assert info.value.body["code"] == "context_length_exceeded"
    assert httpx.get(f"{url}/v2/nothing").json()["error"]["type"] == "not_found_error"


def wait_until(check, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def pool_is_empty(url: str, engine_too: bool = False) -> bool:
    status = httpx.get(f"{url}/pool/status").json()
    instances = status["instances"].values()
    empty = status["requests_in_pool"] == 0 and all(i["kv_used_bytes"] == 0 for i in instances)
    if engine_too:
        empty = empty and all(i["engine"].get("num_requests") == 0 for i in instances)
    return empty and all(m["queued"] == m["running"] == 0 for m in status["models"].values())


def test_client_disconnect_mid_stream_frees_the_kv_at_once(url):
    body = {"model": "tiny-qwen2", "prompt": "The sea", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert not pool_is_empty(url)  # it is decoding, its KV reserved
    gone_at = time.monotonic()
    assert wait_until(lambda: pool_is_empty(url), 2.0), httpx.get(f"{url}/pool/status").json()
    assert time.monotonic() - gone_at < 2.0  # 1500 tokens would take ~10 s
    assert wait_until(lambda: pool_is_empty(url, engine_too=True), 3.0)


def test_client_disconnect_while_waiting_for_a_whole_answer(url):
    body = {"model": "tiny-llama", "prompt": "The sea", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    assert wait_until(lambda: pool_is_empty(url, engine_too=True), 3.0)


def test_metrics_have_vllm_names_with_model_label_and_pool_metrics(url, client):
    client.completions.create(model="tiny-llama", prompt="count", max_tokens=4, extra_body={"ignore_eos": True})
    text = httpx.get(f"{url}/metrics").text
    for name in VLLM_NAMES:
        assert f'{name}{{model_name="tiny-llama"}}' in text or f'{name}_count{{model_name="tiny-llama"}}' in text \
            or f'{name}_bucket{{le="0.001",model_name="tiny-llama"}}' in text, name
    for name in POOL_NAMES:
        assert f"\n{name}{{" in text or f"# TYPE {name}" in text, name
    generated = [line for line in text.splitlines() if line.startswith('vllm:generation_tokens_total{model_name="tiny-llama"}')]
    assert float(generated[0].split()[-1]) >= 4
    assert 'modelpool_instance_loaded_model{instance="slot0"' in text


def test_health_and_pool_status(url):
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    status = httpx.get(f"{url}/pool/status").json()
    assert status["ready"] and set(status["models"]) == set(MODELS)
    slot = status["instances"]["slot0"]
    assert {"active_model", "prefetched_model", "kv_used_bytes", "engine"} <= set(slot)
    assert status["recent_switches"] and {"instance", "model", "reason", "at"} <= set(status["recent_switches"][0])


def test_an_error_after_the_stream_started_is_the_last_event_then_503(demo_models):
    pool = make_pool(demo_models).start()
    with BackgroundServer(create_app(pool)) as server:
        body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = (line for line in response.iter_lines() if line)
            assert '"text"' in next(lines)
            pool.stop()
            rest = list(lines)
        error = json.loads(rest[-2][6:])["error"]
        assert rest[-1] == "data: [DONE]" and error["code"] == "pool_unavailable"
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["type"] == "service_unavailable"


def test_api_keys_and_admin_key(served):
    pool, _ = served
    settings = GatewaySettings(api_keys=(Secret("user-key"),), admin_keys=(Secret("admin-key"),))
    with BackgroundServer(create_app(pool, settings)) as server:
        url = server.url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "user-key"}):
            denied = httpx.get(f"{url}/v1/models", headers=headers)
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        posted = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
        assert posted.status_code == 401
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="user-key", max_retries=0)
        assert keyed.completions.create(model="tiny-llama", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(f"{url}/pool/status", headers={"Authorization": "Bearer user-key"}).status_code == 401
        admin = httpx.get(f"{url}/pool/status", headers={"Authorization": "Bearer admin-key"})
        assert admin.status_code == 200 and "admin-key" not in admin.text and "user-key" not in admin.text
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
    assert "user-key" not in repr(settings) and "user-key" not in str(settings.api_keys)
