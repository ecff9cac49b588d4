"""Every policy serves the demo fleet (SmolLM2 and the tiny models, torch engine on CPU) through the gateway,
as `modelpool serve --policy P` builds it: warm-up, a real answer from SmolLM2, a streamed tiny-model answer.
Spatial co-locates the models (`Switch(evict=False)`) and decodes every resident model's batch in one step."""

from __future__ import annotations

import threading

import openai
import pytest

from modelpool.deploy import demo_deployment
from modelpool.serve import warm_up
from pool.gateway import create_app
from pool.gateway.server import BackgroundServer
from pool.config import PoolConfig
from pool.service import LivePool
from scheduler import POLICIES

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_demo_fleet_serves_real_text_under_every_policy(policy, smollm2, monkeypatch):
    monkeypatch.setenv("MODELPOOL_CACHE", str(smollm2.parent))
    # dedicated gives every model an instance of its own (`--instances 4`); the others share serve's default two
    dep = demo_deployment("torch", num_gpus=0, num_instances=4 if policy == "dedicated" else None, kv_mib=None)
    pool = LivePool(dep.models, dep.instances, policy, dep.costs,
                    PoolConfig(engine=dep.engine, backend="inprocess", policy_options=dep.policy_options,
                               max_restarts=0, stats_interval_s=0.2))
    pool.start()
    try:
        warm_up(pool, timeout_s=120)
        with BackgroundServer(create_app(pool)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
            answers: dict[str, str] = {}

            def ask(model: str, max_tokens: int) -> None:
                reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=max_tokens,
                                                       temperature=0)
                answers[model] = reply.choices[0].message.content or ""

            # SmolLM2 and a tiny model at once: spatial decodes both resident models in one step
            asking = [threading.Thread(target=ask, args=("smollm2-135m", 12)),
                      threading.Thread(target=ask, args=("tiny-qwen2", 6))]
            for thread in asking:
                thread.start()
            for thread in asking:
                thread.join(timeout=120)
            assert "Paris" in answers["smollm2-135m"] and answers["tiny-qwen2"]
            stream = client.chat.completions.create(model="tiny-qwen3", messages=QUESTION, max_tokens=4, stream=True,
                                                    stream_options={"include_usage": True})
            assert list(stream)[-1].usage.completion_tokens == 4
            status = pool.status()
        assert status["tick_errors"] == 0 and status["lost_instances"] == [] and status["restarts"] == 0
        if policy == "spatial":  # co-located: an instance computes with several resident models
            resident = [i["engine"].get("resident_models", ()) for i in status["instances"].values()]
            assert max(len(r) for r in resident) > 1, resident
    finally:
        pool.stop()
