"""The demo pool past its KV capacity, as `vllm bench serve` drives it: many concurrent OpenAI streaming chats
with random prompts against SmolLM2. Every request completes with its full output; requests wait for KV
(the scheduler's queue), the engines never refuse it and no instance is lost."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import openai
import pytest

from modelpool.deploy import demo_deployment
from pool.gateway import GatewaySettings, create_app
from pool.gateway.prompts import chat_prompt_ids
from pool.gateway.schemas import ChatCompletionRequest
from pool.gateway.server import BackgroundServer
from pool.config import PoolConfig
from pool.service import LivePool

KV_MIB = 10  # per instance: two of these requests' KV (the default, 128 MiB, holds over forty)
NUM_REQUESTS = 12  # all at once
OUTPUT_TOKENS = 12
PROMPT_WORDS = 16
MODEL = "smollm2-135m"


def random_prompts(count: int, seed: int = 0) -> list[str]:
    """Prompts of random words, as `vllm bench serve --dataset-name random` sends random text."""
    rng = random.Random(seed)
    words = "the of and pool model token river stone light paper window green quiet seven orbit market".split()
    return [" ".join(rng.choice(words) for _ in range(PROMPT_WORDS)) for _ in range(count)]


async def stream_all(url: str, prompts: list[str]) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt: str) -> dict:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=OUTPUT_TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, chunks, usage, finish = "", 0, None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    text, chunks = text + choice.delta.content, chunks + 1
                finish = choice.finish_reason or finish
        return {"text": text, "chunks": chunks, "usage": usage, "finish": finish}

    try:
        return await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
    finally:
        await client.close()


def watch(pool: LivePool, stop: threading.Event, seen: dict[str, float]) -> None:
    """The most requests waiting for their first token, holding KV, and the most KV planned, at any moment."""
    while not stop.wait(0.02):
        status = pool.status()
        if not status:
            continue
        seen["waiting"] = max(seen["waiting"], status["models"][MODEL]["queued"])
        instances = status["instances"].values()
        seen["on_device"] = max(seen["on_device"], sum(i["requests_on_device"] for i in instances))
        seen["kv_used"] = max([seen["kv_used"], *(i["kv_used_bytes"] / i["kv_capacity_bytes"] for i in instances)])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["token-level", "spatial"])  # spatial: several models resident per engine
def test_demo_pool_past_its_kv_capacity_completes_every_stream(demo_models, smollm2, monkeypatch, policy) -> None:
    monkeypatch.setenv("MODELPOOL_CACHE", str(smollm2.parent))
    dep = demo_deployment("torch", num_gpus=0, num_instances=None, kv_mib=KV_MIB)
    pool = LivePool(dep.models, dep.instances, policy, dep.costs, PoolConfig(engine=dep.engine, backend="threads"))
    began = time.perf_counter()
    with pool:
        server = BackgroundServer(create_app(pool, GatewaySettings())).start()
        prompts = random_prompts(NUM_REQUESTS)
        tokenizer = pool.tokenizer(MODEL)
        profile = next(m.profile for m in dep.models if m.name == MODEL)
        context = max(len(chat_prompt_ids(ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": p}]),
                                          tokenizer)) for p in prompts) + OUTPUT_TOKENS
        per_request = -(-context // 16) * 16 * profile.kv_bytes_per_token  # whole 16-token blocks
        capacity = sum(int(spec.kv_bytes // per_request) for spec in pool.planned_instances)  # type: ignore[operator]
        assert 1 <= capacity < NUM_REQUESTS / 2, "the load is well past what the KV holds at once"
        seen = {"waiting": 0.0, "on_device": 0.0, "kv_used": 0.0}
        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(pool, stop, seen), daemon=True)
        watcher.start()
        started = time.perf_counter()
        try:
            results = asyncio.run(stream_all(server.url, prompts))
        finally:
            stop.set()
            watcher.join()
            server.stop()
        controller = pool.controller
        assert controller is not None
        status = pool.status()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for r in results:  # every stream got its full output
        assert r["usage"].completion_tokens == OUTPUT_TOKENS and r["finish"] == "length" and r["chunks"] >= 1, r
        assert r["text"].strip(), r
    # never more requests held KV than it holds; the others waited for it (in the pool, not as errors)
    assert seen["on_device"] <= capacity and seen["waiting"] >= NUM_REQUESTS - capacity, seen
    assert 0.5 < seen["kv_used"] <= 1.0, seen
    assert status["kv_refusals"] == controller.num_kv_refusals == 0 and not controller.lost
    assert status["restarts"] == 0
    print(f"\n{NUM_REQUESTS} concurrent streams, KV for {capacity} at once: all complete; "
          f"{seen['waiting']:.0f} waited at most, planned KV peaked at {seen['kv_used']:.0%} of the engines' report, "
          f"{time.perf_counter() - started:.1f} s of load after {started - began:.1f} s of start-up")
