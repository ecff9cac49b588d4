"""The live pool end to end on CPU: real engines, the real scheduler, preemption between tokens."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pool.actor import EngineSpec
from pool.engines.base import SamplingParams
from pool.config import PoolConfig
from pool.service import LivePool, served_model, slot_instances
from tests.factories import LinearCosts
from tests.pool.fault_tools import Sink, wait_until

MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
KV_BYTES = 32 << 20
ENGINE = EngineSpec("torch", {"dtype": "float32", "kv_bytes": KV_BYTES})


Collector = Sink  # tokens, the error, and anything that arrives after the end (must stay empty)


@pytest.fixture(scope="module")
def tiny(demo_models: dict[str, Path]) -> dict[str, Path]:
    return {name: demo_models[name] for name in MODELS}


@pytest.fixture(scope="module")
def reference(tiny: dict[str, Path]) -> dict[tuple[str, int], list[int]]:
    """transformers' own greedy generate (float32) for each model and prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in tiny.items():
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        for k, prompt in enumerate(PROMPTS):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
            out[(name, k)] = gen[0, len(prompt):].tolist()
    return out


PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8, 120, 64, 9, 11, 2], [250, 1, 33]]
NEW_TOKENS = 12


def run_requests(pool: LivePool, timeout_s: float = 120.0) -> dict[tuple[str, int], Collector]:
    sinks = {}
    for name in MODELS:
        for k, prompt in enumerate(PROMPTS):
            sink = sinks[(name, k)] = Collector()
            pool.submit(f"{name}-{k}", name, prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), sink)
    for key, sink in sinks.items():
        assert sink.done.wait(timeout_s), f"{key} did not finish; pool status: {pool.status()}"
        assert sink.error is None and not sink.after_end, f"{key}: {sink.error!r} {sink.after_end}"
    return sinks


@pytest.mark.parametrize("k", [1, 3, 7])
def test_three_models_share_one_instance_preempted_every_k_tokens(k: int, tiny, reference) -> None:
    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    # a device that holds KV for one model's requests only, so every turn change swaps: slabs of 3 tiny-llama
    # (or 4 tiny-qwen3) blocks, two of them, one kept for a slab part-filled by the other shape; each request
    # takes two 16-token blocks, so the one usable slab holds the three requests of one model
    slab = 3 * 16 * 2 * 2 * 2 * 64 * 4
    engine = EngineSpec("torch", {"dtype": "float32", "kv_bytes": 2 * slab, "device_slab_bytes": slab})
    instances = slot_instances(1, models, 2 * slab)
    log = io.StringIO()
    pool = LivePool(models, instances, "token-level", LinearCosts(),
                    PoolConfig(engine=engine, backend="inprocess", policy_options={"fixed_turn_steps": k}),
                    plan_log=log)
    with pool:
        assert pool.planned_instances[0].kv_bytes == slab  # the scheduler plans with what the engine reports
        sinks = run_requests(pool)
    for key, sink in sinks.items():
        assert sink.tokens == reference[key], key
    ops = [a["op"] for line in log.getvalue().splitlines() for acts in json.loads(line)["actions"].values() for a in acts]
    assert ops.count("SwapOut") >= 3 and ops.count("SwapIn") >= 3 and ops.count("Switch") >= 3
    decode_steps = [a["max_steps"] for line in log.getvalue().splitlines()
                    for acts in json.loads(line)["actions"].values() for a in acts if a["op"] == "Decode"]
    assert max(decode_steps) <= k


def test_real_ray_two_instances_three_models(tiny, reference) -> None:
    import ray

    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        pool = LivePool(models, slot_instances(2, models, KV_BYTES), "request-level", LinearCosts(),
                        PoolConfig(engine=ENGINE, backend="ray"))
        with pool:
            sinks = run_requests(pool, timeout_s=300)
            # a sink has its last token before the controller retires the request: the pool empties just after
            wait_until(lambda: pool.status()["requests_in_pool"] == 0, 30, "the pool to retire the finished requests")
            status = pool.status()
        for key, sink in sinks.items():
            assert sink.tokens == reference[key], key
        assert set(status["instances"]) == {"slot0", "slot1"} and status["requests_in_pool"] == 0
        assert status["tick_errors"] == 0
    finally:
        ray.shutdown()
