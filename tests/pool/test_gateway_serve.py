"""`modelpool serve`: what it would deploy, and the real thing - embedded Ray, the demo fleet, SmolLM2 text."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import typer

from modelpool.cpu_costs import CpuCosts
from modelpool.deploy import demo_deployment, fleet_deployment
from modelpool.gpu_memory import GPU_HEADROOM_BYTES, HANDOFF_BATCHES, HOST_KV_PREALLOC_BYTES, gpu_kv_bytes, plan_gpu_memory
from pool.gateway.server import free_port
from tests.pool.fault_tools import stop_serve, wait_for_serve

REPO = Path(__file__).resolve().parents[2]


def test_demo_deployment_on_cpu_is_two_float32_slots_under_a_cpu_cost_model(demo_models, monkeypatch):
    monkeypatch.setenv("MODELPOOL_CACHE", str(next(iter(demo_models.values())).parent))
    dep = demo_deployment("torch", num_gpus=0, num_instances=None, kv_mib=None)
    assert [m.name for m in dep.models] == list(demo_models) and len(dep.instances) == 2
    assert dep.engine.kind == "torch" and dep.engine.options["dtype"] == "float32" and dep.backend == "ray"
    assert isinstance(dep.costs, CpuCosts) and {i.role for i in dep.instances} == {"mixed"}
    vllm = demo_deployment("vllm", 0, None, None)
    assert vllm.engine.kind == "vllm" and "tiny-qwen3" not in [m.name for m in vllm.models]
    from pool.engines.vllm_engine import VllmEngineConfig

    config = VllmEngineConfig(**vllm.engine.options)  # what make_vllm_engine builds inside each actor
    assert config.device == "cpu"  # each model's vLLM context no shorter than the torch engine's (issue 37)
    assert all(m.profile.max_context <= config.max_model_lens.get(m.name, config.max_model_len) for m in vllm.models)
    sim = demo_deployment("sim", 0, None, None)
    assert sim.engine.kind == "sim" and sim.engine.options["costs"] is sim.costs and sim.backend == "threads"


def test_fleet_deployment_serves_weights_folders_or_refuses_clearly(demo_models, tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("pool: {gpu: h100, num_gpus: 2}\nmodels:\n" + "".join(
        f"  - {{name: {name}, arch: {path}, weights: {path}}}\n" for name, path in demo_models.items()
        if name.startswith("tiny")))
    dep = fleet_deployment(fleet, "torch", num_gpus=0, num_instances=None, policy="token-level", kv_mib=64)
    assert [m.name for m in dep.models] == ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] and len(dep.instances) == 2
    assert dep.engine.options["kv_bytes"] == 64 << 20
    gpu = fleet_deployment(fleet, "torch", num_gpus=2, num_instances=None, policy="token-level", kv_mib=None)
    assert [i.role for i in gpu.instances] == ["prefill", "decode"] and gpu.engine.options["device"] == "cuda"
    assert gpu.engine.options["handoff_bytes"] == 0  # on two GPUs: hand-offs through host memory
    # decode graphs up to the scheduler's max_batch_size (the pool's, default 256): no batch it forms runs eagerly
    assert gpu.engine.options["graph_batch_sizes"][-1] == 256
    # host KV pinned at start, never past what the instance may use (host_kv_gb 256 over 8 GPUs a node)
    assert gpu.engine.options["host_kv_prealloc_bytes"] == HOST_KV_PREALLOC_BYTES < gpu.engine.options["max_host_kv_bytes"]
    tight = tmp_path / "tight.yaml"
    tight.write_text(fleet.read_text().replace("num_gpus: 2}", "num_gpus: 2, host_kv_gb: 8}"))
    options = fleet_deployment(tight, "torch", 2, None, "token-level", None).engine.options
    assert options["host_kv_prealloc_bytes"] == options["max_host_kv_bytes"] == 1_000_000_000
    small = tmp_path / "small.yaml"
    small.write_text(fleet.read_text().replace("num_gpus: 2}", "num_gpus: 2, max_batch_size: 48}"))
    assert fleet_deployment(small, "torch", 2, None, "token-level", None).engine.options["graph_batch_sizes"] == \
        (1, 2, 4, 8, 16, 32, 48)
    # on one GPU the prefill instance stages its hand-offs in device memory, set aside from the KV of both; the
    # two instances map one region holding every model once, and may keep all of them resident
    one = fleet_deployment(fleet, "torch", num_gpus=1, num_instances=None, policy="token-level", kv_mib=None)
    arena = one.engine.options["handoff_bytes"]
    kv_per_token = max(m.profile.kv_bytes_per_token for m in one.models)
    assert arena == HANDOFF_BATCHES * 8192 * kv_per_token > 0  # the pool's max_prefill_tokens (default 8192)
    usable = int(80e9 * 0.9)  # h100, the default gpu_memory_utilization
    weights = sum(int(m.profile.weight_bytes) for m in one.models)
    assert one.engine.options["kv_bytes"] == (usable - weights - 2 * GPU_HEADROOM_BYTES - arena) // 2
    assert "modelpool-weights-" in one.engine.options["shared_weights"]
    assert {i.memory_bytes for i in one.instances} == {one.engine.options["kv_bytes"] + weights}
    with pytest.raises(typer.BadParameter, match="--engine sim"):
        fleet_deployment(REPO / "models.yaml", "torch", 0, None, "token-level", None)
    dry = fleet_deployment(REPO / "models.yaml", "sim", 0, None, "token-level", None)
    assert len(dry.models) == 47 and dry.engine.kind == "sim" and sum(i.tp for i in dry.instances) == 16


def test_a_fleet_of_7b_and_smaller_models_fits_one_80gb_gpu_each_model_once() -> None:
    """Issue 35's fleet: eight 1.5B-7B models (~61 GB) on an H100 under the default one-GPU token-level layout
    (a prefill and a decode instance, the prefill one staging hand-offs). Two slots per instance held four
    copies of the 7B and left no KV; one copy of each model per GPU leaves both instances KV for prefill steps."""
    from scheduler.fleet import catalogue_arch

    archs = [catalogue_arch(n) for n in ("qwen2.5-1.5b", "qwen3-1.7b", "qwen2.5-3b", "llama-3.2-3b", "qwen3-4b",
                                         "qwen2.5-7b", "qwen2.5-7b", "qwen2.5-1.5b")]
    weights = [int(a.weight_bytes) for a in archs]
    step = 8192 * max(a.kv_bytes_per_token for a in archs)
    usable = int(80e9 * 0.9)
    assert 60e9 < sum(weights) < 62e9 and gpu_kv_bytes(usable, 2, max(weights), HANDOFF_BATCHES * step) <= 0
    plan = plan_gpu_memory(usable, 2, 1, weights, step)
    assert plan.shared_weights and plan.weights_bytes == sum(weights) and plan.kv_bytes >= step
    assert step <= plan.handoff_bytes < HANDOFF_BATCHES * step  # the arena gives way to KV on a tight GPU
    assert plan.weights_bytes + plan.handoff_bytes + 2 * (plan.kv_bytes + GPU_HEADROOM_BYTES) <= usable
    # on an H200 the arena keeps its HANDOFF_BATCHES steps
    assert plan_gpu_memory(int(141e9 * 0.9), 2, 1, weights, step).handoff_bytes == HANDOFF_BATCHES * step
    # a fleet too big to hold once: each instance's two slots, as before; vLLM's engines never share
    private = plan_gpu_memory(usable, 2, 1, weights * 2, step)
    assert not private.shared_weights and private.weights_bytes == 2 * 2 * max(weights)
    assert not plan_gpu_memory(int(141e9 * 0.9), 2, 0, weights, step, can_share=False).shared_weights


@pytest.mark.slow
def test_modelpool_serve_with_no_arguments_answers_the_openai_client_with_real_text(demo_models, smollm2):
    port = free_port()
    env = {**os.environ, "MODELPOOL_CACHE": str(smollm2.parent), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "modelpool.cli", "serve", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        url, lines = wait_for_serve(proc)
        assert url == f"http://127.0.0.1:{port}"
        while not any("curl" in line for line in lines):
            lines.append(proc.stdout.readline())  # type: ignore[union-attr]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=24, temperature=0)
        assert "Paris" in answer.choices[0].message.content
        stream = client.chat.completions.create(model="tiny-qwen3", messages=question, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True})
        assert list(stream)[-1].usage.completion_tokens >= 1
        status = httpx.get(f"{url}/pool/status").json()
        assert set(status["instances"]) == {"slot0", "slot1"} and status["tick_errors"] == 0
    finally:
        stop_serve(proc)
    rest = proc.stdout.read()  # type: ignore[union-attr]
    assert proc.returncode == 0 and "Traceback" not in rest, "".join(lines) + rest
