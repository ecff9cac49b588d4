"""vLLM's own benchmark client against the demo pool (issue 37, 9): the load that livelocked it now completes.

SmolLM2 on the default demo (two CPU instances, token-level), 60 random
prompts of 1024 tokens in and 64 out at 4 requests/s with up to 64 at once:
before host-tier admission (scheduler/policies/kv_tiers.py) the host KV store
filled, every refusal re-queued the requests, and 0 of 60 completed in 25
minutes. Every request must complete with its 64 tokens. The client is
vLLM's (RECIPES.md), with vLLM's metric definitions: nothing of ours counts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from pool.gateway import create_app  # noqa: E402
from pool.gateway.server import BackgroundServer  # noqa: E402
from pool.config import PoolConfig  # noqa: E402
from pool.service import LivePool  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 60, 1024, 64


def bench(url: str, tokenizer: Path, result_dir: Path) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "smollm2-135m",
        "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS), "--request-rate", "4",
        "--max-concurrency", "64", "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--result-dir", str(result_dir)])
    return main(args)


def test_vllm_bench_at_1024_in_64_out_completes_every_request(smollm2: Path, demo_models, monkeypatch,
                                                                tmp_path: Path) -> None:
    from modelpool.deploy import demo_deployment

    monkeypatch.setenv("MODELPOOL_CACHE", str(smollm2.parent))
    dep = demo_deployment("torch", 0, None, None)
    pool = LivePool(dep.models, dep.instances, "token-level", dep.costs,
                    PoolConfig(engine=dep.engine, backend="processes", policy_options=dep.policy_options)).start()
    try:
        with BackgroundServer(create_app(pool)) as server:
            result = bench(server.url, smollm2, tmp_path)
        state = pool.status()
    finally:
        pool.stop()
    errors = [e for e in result.get("errors", []) if e]
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, (result["completed"], errors[:3])
    # the client's own counts (with --ignore-eos every request generates exactly its 64)
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["total_input_tokens"] >= NUM_PROMPTS * (INPUT_LEN - 8)
    assert state["kv_refusals"] == 0 and not state["lost_instances"], state["kv_refusals"]
    print(f"vllm bench 1024/64, 4 req/s, concurrency 64: {result['completed']}/{NUM_PROMPTS} in "
          f"{result['duration']:.0f} s, {result['total_output_tokens']} output tokens")
