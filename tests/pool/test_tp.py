"""Tensor parallelism in the torch engine on CPU: two ranks (processes, gloo), the three tiny demo models.

Greedy tokens at TP2 equal TP1's and transformers' `generate` (float32); a
switch, preemption and KV swap every k tokens at TP2 change nothing; KV
handed from a TP2 prefill instance to a TP2 decode instance (and to a TP1
one: the export is the same format) continues the same tokens; a rank
killed mid-decode writes its instance off, and its requests resume on the
other instance with identical tokens without anything hanging; `serve
--fleet` with a TP2 model deploys TP2 instances on CPU ranks.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pool.engines.base import GenRequest, SamplingParams
from pool.engines.torch_engine import TorchEngineConfig
from pool.engines.tp import RankLost, TpEngine, join_kv, rank_config, split_kv
from pool.engines.tp_files import PREFIX, store_stem, sweep_dead
from pool.engines.weights import ModelImage
from pool.config import PoolConfig
from pool.service import LivePool, served_model, slot_instances
from tests.factories import LinearCosts
from tests.pool.fault_tools import NOTHING, allocated, homes, outcomes, wait_until
from tests.pool.test_faults import LONG_TOKENS, long_reference, submit_all  # noqa: F401
from tests.pool.test_live_pool import ENGINE, KV_BYTES, reference, run_requests, tiny  # noqa: F401
from tests.pool.test_torch_engine import (TINY, hf_greedy, ids_of, make_engine, prompt_ids, run, run_preempted,
                                          tiny_requests)

SLAB = 128 * 1024


def tp_engine(demo_models, **config) -> TpEngine:
    config = {"dtype": "float32", "tp": 2, **config}
    engine = TpEngine(TorchEngineConfig(**config), threads=1)
    for name in TINY:
        engine.load(name, demo_models[name])
    return engine


@pytest.fixture(scope="module")
def tp2(demo_models):
    engine = tp_engine(demo_models, kv_bytes=12 * SLAB, device_slab_bytes=SLAB // 2, host_slab_bytes=SLAB // 2)
    yield engine
    engine.close()


def test_tp2_greedy_tokens_equal_tp1_and_transformers_generate(tp2, demo_models):
    tp1 = make_engine(demo_models)
    for model in TINY:
        ids = prompt_ids(tp1, model)
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        got = run(tp2, [GenRequest(f"{model}/{i}", model, p, params) for i, p in enumerate(ids)])
        alone = run(tp1, [GenRequest(f"{model}/{i}", model, p, params) for i, p in enumerate(ids)])
        for i, prompt in enumerate(ids):
            want = hf_greedy(demo_models[model], tuple(prompt), 16, True)
            assert ids_of(got[f"{model}/{i}"]) == ids_of(alone[f"{model}/{i}"]) == want, (model, i)
        assert "".join(o.text for o in got[f"{model}/0"]) == "".join(o.text for o in alone[f"{model}/0"])
    # each rank holds and copies its own shard: heads and MLP halved, embeddings whole
    stats = tp2.stats()
    whole = {m: tp1.model_bytes(m) for m in TINY}
    shard = {m: tp2.model_bytes(m) for m in TINY}
    assert all(whole[m] / 2 < shard[m] < whole[m] for m in TINY), (shard, whole)
    per_rank = [r["bytes_h2d"] for r in stats.extra["tp_ranks"]]  # the untied head's odd vocab: a row apart
    assert len(per_rank) == 2 and per_rank[0] > 0 and abs(per_rank[0] - per_rank[1]) < 0.01 * per_rank[0]
    assert stats.extra["tp"] == 2 and len(set(stats.extra["tp_rank_pids"])) == 2
    assert stats.num_requests == 0 and stats.kv_device_used_bytes == 0


def test_shards_rebuild_the_whole_model_and_kv_round_trips_through_ranks(demo_models):
    from pool.engines.weights import HostWeightCache

    cache = HostWeightCache()
    path = demo_models["tiny-qwen2"]  # qkv bias, tied embeddings
    whole = cache.load("q", path, torch.float32).views()
    shards = [cache.load("q", path, torch.float32, (r, 2)).views() for r in range(2)]
    assert torch.equal(torch.cat([s["0.o"] for s in shards], dim=1), whole["0.o"])
    assert torch.equal(torch.cat([s["1.down"] for s in shards], dim=1), whole["1.down"])
    assert torch.equal(torch.cat([s["lm_head"] for s in shards]), whole["lm_head"])  # odd vocab: 364 + 363 rows
    spec = cache.load("q", path, torch.float32, (0, 2)).spec
    q, kv = spec.q_size, spec.kv_size
    parts = [s["0.qkv_bias"].split([q, kv, kv]) for s in shards]
    assert torch.equal(torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)]), whole["0.qkv_bias"])
    random = [ModelImage("r", spec.whole().shard(r, 2), torch.float32, pin=False) for r in range(2)]
    one = ModelImage("r", spec.whole(), torch.float32, pin=False)
    for image in (*random, one):
        image.fill_random(seed=3)
    assert torch.equal(torch.cat([i.views()["0.gate_up"].chunk(2)[1] for i in random]),
                       one.views()["0.gate_up"].chunk(2)[1])  # random shards are the shards of one random model
    with pytest.raises(ValueError, match="KV heads 2 do not split over tp 4"):
        spec.whole().shard(0, 4)

    engine = make_engine(demo_models, ["tiny-qwen2"])
    engine.activate("tiny-qwen2")
    engine.prefill([GenRequest("x", "tiny-qwen2", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))])
    export = engine.export_kv(["x"])[0]
    halves = split_kv(export, 2)
    assert [h.kv_shape[2] for h in halves] == [1, 1] and sum(h.kv_bytes for h in halves) == export.kv_bytes
    assert join_kv(halves).kv.tobytes() == export.kv.tobytes()


@pytest.mark.parametrize("k", [1, 4])
def test_tp2_preempting_and_switching_every_k_tokens_changes_nothing(k, tp2, demo_models):
    tp1 = make_engine(demo_models)
    requests = tiny_requests(tp1, 16)
    expected = {rid: ids_of(o) for m in TINY for rid, o in run(tp1, requests[m]).items()}
    before = tp2.stats()
    assert run_preempted(tp2, requests, k, 16) == expected
    stats = tp2.stats()
    assert stats.num_requests == 0 and stats.kv_device_used_bytes == 0 and stats.kv_host_used_bytes == 0
    moved = [now["bytes_d2h"] - was["bytes_d2h"] for now, was in zip(stats.extra["tp_ranks"], before.extra["tp_ranks"])]
    assert moved[0] == moved[1] > 0  # each rank swapped its own half of the KV


def test_tp2_prefill_instance_hands_kv_to_a_tp2_decode_instance(tp2, demo_models):
    decode = tp_engine(demo_models)
    tp1 = make_engine(demo_models)
    try:
        for model in ("tiny-llama", "tiny-qwen3"):
            ids = prompt_ids(tp1, model)[:3]
            params = SamplingParams(max_tokens=14, ignore_eos=True)
            reqs = [GenRequest(f"h-{model}/{i}", model, p, params) for i, p in enumerate(ids)]
            want = {rid: ids_of(o) for rid, o in run(tp1, reqs).items()}
            got = {r.request_id: [] for r in reqs}
            tp2.activate(model)
            for out in tp2.prefill(reqs):
                got[out.request_id].append(out.token_id)
            for out in tp2.decode_step(list(got)):  # a prefill instance decodes the first tokens too
                got[out.request_id].append(out.token_id)
            tp2.save_kv([reqs[0].request_id])  # one from host memory, the others off the device
            exports = tp2.export_kv(list(got))
            assert tp2.stats().num_requests == 0 and exports[0].kv_shape[2] == 2  # all KV heads, as at tp 1
            decode.import_kv(exports[:2])
            tp1.import_kv(exports[2:])  # the same export goes to a tp 1 instance
            for engine, rids in ((decode, list(got)[:2]), (tp1, list(got)[2:])):
                engine.activate(model)
                engine.restore_kv(rids)
                while rids:
                    for out in engine.decode_step(rids):
                        got[out.request_id].append(out.token_id)
                    rids = [rid for rid in rids if len(got[rid]) < 14]
            assert got == want, model
    finally:
        decode.close()


def test_a_rank_never_stages_hand_offs_in_device_memory():
    # the instance joins its ranks' exports on the host (join_kv reads numpy arrays, not staged regions)
    config = TorchEngineConfig(dtype="float32", tp=2, kv_bytes=4 * SLAB, handoff_bytes=1 << 20)
    assert [rank_config(config, r, "cpu").handoff_bytes for r in range(2)] == [0, 0]


def test_tp2_prefill_and_decode_instances_in_the_live_pool(tiny, reference):  # noqa: F811
    """Token-level's split with two TP2 instances: prompts prefilled on one, KV handed (all heads, joined from
    and split back to the ranks) to the other, which decodes the uninterrupted greedy tokens."""
    models = [served_model(name, path, dtype="float32", tp=2) for name, path in tiny.items()]
    log = io.StringIO()
    pool = LivePool(models, slot_instances(2, models, KV_BYTES, roles=["prefill", "decode"], tp=2), "token-level",
                    LinearCosts(), PoolConfig(engine=ENGINE, backend="threads", policy_options={"fixed_turn_steps": 3}),
                    plan_log=log)
    with pool:
        sinks = run_requests(pool, timeout_s=300)
    for key, sink in sinks.items():
        assert sink.tokens == reference[key], key
    plans = [json.loads(line)["actions"] for line in log.getvalue().splitlines()]
    assert {"SwapIn", "Decode"} <= {a["op"] for p in plans for a in p.get("slot1", [])}
    assert "Prefill" not in {a["op"] for p in plans for a in p.get("slot1", [])}


def test_a_dead_rank_fails_the_call_at_once_and_every_later_one(demo_models):
    engine = tp_engine(demo_models)
    try:
        engine.activate("tiny-llama")
        engine.prefill([GenRequest("d", "tiny-llama", [4, 5, 6], SamplingParams(max_tokens=30, ignore_eos=True))])
        os.kill(engine.rank_pids[1], signal.SIGKILL)
        with pytest.raises(RankLost):
            for _ in range(30):  # the kill lands within a step or two
                engine.decode_step(["d"])
        with pytest.raises(RankLost, match="already lost"):
            engine.stats()
    finally:
        engine.close()


def tp2_pool(tiny, backend: str) -> LivePool:  # noqa: F811
    models = [served_model(name, path, dtype="float32", tp=2) for name, path in tiny.items()]
    return LivePool(models, slot_instances(2, models, KV_BYTES, tp=2), "token-level", LinearCosts(),
                    PoolConfig(engine=ENGINE, backend=backend, stats_interval_s=0.1, max_restarts=0,
                               policy_options={"fixed_turn_steps": 4}))


def kill_rank_mid_decode(pool: LivePool) -> tuple[str, set[str]]:
    """SIGKILL rank 1 of the instance holding the most part-decoded requests; returns it and what it held."""
    def victim() -> str | None:
        held = [home for home, _, produced in homes(pool).values() if 1 <= produced < LONG_TOKENS - 8]
        return max(set(held), key=held.count) if held else None

    wait_until(lambda: victim() is not None and len(pool.engine_stats) == 2, 60, "a TP2 instance decoding")
    chosen = victim()
    assert chosen is not None
    held = {rid for rid, h in homes(pool).items() if h[0] == chosen}
    os.kill(pool.engine_stats[chosen]["extra"]["tp_rank_pids"][1], signal.SIGKILL)
    return chosen, held


def assert_resumed_elsewhere(pool: LivePool, sinks, reference, chosen: str, held: set[str]) -> None:
    result = outcomes(sinks, reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 120)
    counts = result.counts()
    assert counts == {"identical": len(sinks), "clean_errors": 0, "wrong": 0, "hung": 0, "lost": 0}, result
    status = pool.status()
    assert held and status["lost_instances"] == [chosen] and status["tick_errors"] == 0
    wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")


def test_a_rank_that_cannot_start_fails_the_instance_at_once(monkeypatch):
    import time

    from pool.engines import tp_ranks

    monkeypatch.setattr(tp_ranks.sys, "executable", "/bin/false")  # the rank's process exits at once
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="tp rank 1 failed to start"):
        TpEngine(TorchEngineConfig(dtype="float32", tp=2))
    assert time.monotonic() - started < 60  # not the process group's 120 s timeout


def test_a_rank_gone_before_it_reads_its_setup_fails_the_instance_at_once(monkeypatch):
    """The race the test above can also take: the rank's process is gone before its setup is sent."""
    from pool.engines import tp_ranks

    def broken(self, data):  # noqa: ANN001
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(tp_ranks.sys, "executable", "/bin/false")
    monkeypatch.setattr(tp_ranks.Connection, "send_bytes", broken)
    with pytest.raises(RuntimeError, match=r"tp rank 1 failed to start: its process exited"):
        TpEngine(TorchEngineConfig(dtype="float32", tp=2))


@pytest.mark.slow
def test_rank_killed_mid_decode_requests_resume_on_the_other_instance(tiny, long_reference):  # noqa: F811
    with tp2_pool(tiny, "processes") as pool:
        sinks = submit_all(pool, models=("tiny-llama", "tiny-qwen2"))  # two models: a shorter test
        chosen, held = kill_rank_mid_decode(pool)
        assert_resumed_elsewhere(pool, sinks, long_reference, chosen, held)
        worker = pool._backend.workers[chosen].process
    wait_until(lambda: not worker.is_alive(), 30, "the lost instance's rank 0 process ended")


@pytest.mark.slow
def test_ray_rank_actors_in_the_placement_group_and_one_killed_mid_decode(tiny, long_reference):  # noqa: F811
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with tp2_pool(tiny, "ray") as pool:
            groups = ray.util.placement_group_table().values()
            assert sorted(len(g["bundles"]) for g in groups if g["state"] == "CREATED") == [2, 2]
            sinks = submit_all(pool, models=("tiny-qwen3",))  # one model: a shorter test
            chosen, held = kill_rank_mid_decode(pool)
            assert_resumed_elsewhere(pool, sinks, long_reference, chosen, held)
    finally:
        ray.shutdown()
    assert dead_tp_files() == []  # the killed instance's rendezvous file too (a Ray actor has no parent to sweep)


def test_fleet_with_a_tp2_model_deploys_tp2_instances_on_cpu_ranks(demo_models, tmp_path):
    import typer

    from modelpool.deploy import fleet_deployment

    fleet = tmp_path / "fleet.yaml"
    path = demo_models["tiny-llama"]
    fleet.write_text(f"pool: {{gpu: h100, num_gpus: 2}}\nmodels:\n  - {{name: one, arch: {path}, weights: {path}}}\n"
                     f"  - {{name: two, arch: {path}, weights: {path}, tp: 2}}\n")
    dep = fleet_deployment(fleet, "torch", num_gpus=0, num_instances=None, policy="token-level", kv_mib=16)
    assert [(i.instance_id, i.tp) for i in dep.instances] == [("slot0", 1), ("slot1", 1), ("tp2-0", 2), ("tp2-1", 2)]
    assert {m.name: m.profile.tp for m in dep.models} == {"one": 1, "two": 2}
    with pytest.raises(typer.BadParameter, match="CPU ranks only"):
        fleet_deployment(fleet, "torch", num_gpus=2, num_instances=None, policy="token-level", kv_mib=None)


@pytest.mark.slow
def test_tp_benchmark_runs_tiny_on_cpu_and_counts_two_all_reduces_a_layer(tmp_path):
    out = tmp_path / "tp.json"
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "gpu_tp.py"), "--tiny", "--shapes", "tiny",
                           "--batches", "1", "8", "--prefill", "64", "--steps", "3", "--reps", "1", "--out", str(out)],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(out.read_text())["shapes"]["tiny"]
    one, two = runs["tp1"], runs["tp2"]
    assert one["shard_bytes"] / 2 < two["shard_bytes"] < one["shard_bytes"] and two["switch_s"] > 0
    step = two["decode"]["1"]["per_step"]
    assert step["all_reduces"] == two["cost_model"]["allreduces_per_step"] == 4 and step["gathers"] == 1
    assert two["decode"]["8"]["kv_bytes_per_rank"] == [one["decode"]["8"]["kv_bytes_per_rank"][0] // 2] * 2


@pytest.mark.slow
def test_modelpool_serve_fleet_serves_a_tp2_model_on_cpu_ranks(demo_models, tmp_path):
    """The same weights as a TP1 model and a TP2 model: greedy completions through the gateway are equal."""
    import httpx

    from pool.gateway.server import free_port
    from tests.pool.fault_tools import stop_serve, wait_for_serve

    path = demo_models["tiny-llama"]
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"pool: {{gpu: h100, num_gpus: 2}}\nmodels:\n  - {{name: one, arch: {path}, weights: {path}}}\n"
                     f"  - {{name: two, arch: {path}, weights: {path}, tp: 2}}\n")
    repo, port = Path(__file__).resolve().parents[2], free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.Popen([sys.executable, "-m", "modelpool.cli", "serve", "--fleet", str(fleet), "--backend",
                             "threads", "--instances", "1", "--kv-mib", "16", "--port", str(port)], cwd=repo,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        url, lines = wait_for_serve(proc)
        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        texts = {m: httpx.post(f"{url}/v1/completions", json={**body, "model": m}, timeout=120).json()
                 for m in ("one", "two")}
        assert texts["one"]["usage"]["completion_tokens"] == texts["two"]["usage"]["completion_tokens"] == 24, texts
        assert texts["one"]["choices"][0]["text"] == texts["two"]["choices"][0]["text"], texts
        status = httpx.get(f"{url}/pool/status", timeout=30).json()
        assert {iid: i["tp"] for iid, i in status["instances"].items()} == {"slot0": 1, "tp2-0": 2}
        assert status["instances"]["tp2-0"]["engine_extra"]["tp"] == 2 and status["tick_errors"] == 0
    finally:
        stop_serve(proc)
    rest = proc.stdout.read()  # type: ignore[union-attr]
    assert proc.returncode == 0 and "Traceback" not in rest, "".join(lines) + rest
    assert dead_tp_files() == []  # /dev/shm left clean


def dead_tp_files() -> list[str]:
    """TP rendezvous files on this machine whose rank-0 process is gone (other sessions' live pools ignored)."""
    folder = Path(store_stem(0)).parent
    return sorted(p.name for p in folder.glob(PREFIX + "*")
                  if not Path(f"/proc/{p.name[len(PREFIX):].split('-')[0]}").exists())


def test_sweep_removes_the_files_of_dead_processes_only():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = Path(store_stem(int(gone.stdout))), Path(store_stem(os.getpid()))
    files = [Path(f"{dead}a"), Path(f"{dead}b"), Path(f"{live}c")]
    for path in files:
        path.write_bytes(b"x")
    try:
        assert sweep_dead() >= 2 and [p.exists() for p in files] == [False, False, True]
    finally:
        files[2].unlink()
