"""The demo at a steady load: no request waits long for its first or its next token (issue 37, item 5).

The default demo (two CPU instances, token-level, four models: SmolLM2 and three tiny random ones) under
16 closed-loop streams, each sending chats one after another to the models in turn (prompts of ~450
tokens, 96 tokens out). The issue saw 42 s silent gaps under 16 steady streams at 47e42f6; since the mixed
instances' chunked prompts (issue 35) this load shows ~2-4 s. One starvation is still possible and is not
fixed here (issue 37's note; branch s22-mixed-head-due): a mixed instance that keeps chunking its resident
models' prompts can leave a group of another model waiting for a whole prefill (26 s once, in a Plan log).

Measured at the client, as a user sees it: the time to the first chunk (the chat role chunk comes with the
first token) and the longest silence between content chunks of SmolLM2's answers (real text: the tiny
models' random tokens are mostly held back by the detokenizer, so their chunks say nothing about gaps).
A chunk gap is never shorter than the token gap it hides, so the bound on chunks bounds the tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from modelpool.deploy import DEMO_TTFT_S
from pool.config import PoolConfig
from pool.gateway import create_app
from pool.gateway.server import BackgroundServer
from pool.service import LivePool

pytestmark = pytest.mark.slow

STREAMS, PER_STREAM, MAX_TOKENS = 16, 2, 96
PROMPT = "once upon a time there was a king " * 60  # ~450 tokens with the chat template
BOUND_S = 2 * DEMO_TTFT_S  # twice the demo's TTFT SLO: room for a loaded CI machine, far below the 38 s seen


async def _chat(client: httpx.AsyncClient, url: str, model: str, k: int) -> dict:
    sent = time.monotonic()
    stamps: list[float] = []  # content chunks
    first = None
    usage = None
    body = {"model": model, "messages": [{"role": "user", "content": f"Story {k}: {PROMPT}"}],
            "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, (model, response.status_code)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            chunk = json.loads(line[6:])
            if first is None:
                first = now
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    stamps.append(now)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"model": model, "ttft": (first or now) - sent, "gap": max(gaps, default=0.0), "usage": usage}


async def _load(url: str, models: list[str]) -> list[dict]:
    rows: list[dict] = []

    async def stream(s: int) -> None:
        for j in range(PER_STREAM):
            rows.append(await _chat(client, url, models[(s + j) % len(models)], s * 100 + j))

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        await asyncio.gather(*(stream(s) for s in range(STREAMS)))
    return rows


def test_demo_at_a_steady_load_keeps_first_and_next_tokens_coming(smollm2: Path, demo_models, monkeypatch) -> None:
    from modelpool.deploy import demo_deployment

    monkeypatch.setenv("MODELPOOL_CACHE", str(smollm2.parent))
    dep = demo_deployment("torch", 0, None, None)
    names = [m.name for m in dep.models]
    assert "smollm2-135m" in names and len(names) == 4
    pool = LivePool(dep.models, dep.instances, "token-level", dep.costs,
                    PoolConfig(engine=dep.engine, backend="processes", policy_options=dep.policy_options)).start()
    try:
        with BackgroundServer(create_app(pool)) as server:
            started = time.monotonic()
            rows = asyncio.run(_load(server.url, names))
            wall = time.monotonic() - started
        state = pool.status()
    finally:
        pool.stop()
    assert len(rows) == STREAMS * PER_STREAM
    assert all(r["usage"] and r["usage"]["completion_tokens"] == MAX_TOKENS for r in rows), \
        [r["usage"] for r in rows if not r["usage"] or r["usage"]["completion_tokens"] != MAX_TOKENS][:3]
    assert not state["lost_instances"]
    ttft = max(rows, key=lambda r: r["ttft"])
    smol = [r for r in rows if r["model"] == "smollm2-135m"]
    gap = max(smol, key=lambda r: r["gap"])
    print(f"{len(rows)} chats in {wall:.0f} s: longest wait for a first token {ttft['ttft']:.1f} s ({ttft['model']}), "
          f"longest silence within a SmolLM2 answer {gap['gap']:.1f} s")
    assert ttft["ttft"] <= BOUND_S, ttft
    assert gap["gap"] <= BOUND_S, gap
