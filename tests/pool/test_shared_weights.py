"""One copy of each model's weights per device (pool.engines.shared_weights): engines that share a weights region
copy each model once between them, compute the same tokens as an engine with a region of its own, hold several
resident models at once, and outlive each other: an engine's crash or restart frees nothing another reads.

On CPU the region is a shared-memory file, so these run the same protocol (keeper, marks, copy table) as on a
GPU; the `cuda` tests repeat the cross-process ones with CUDA IPC where a GPU is present.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pool.engines.base import EngineError, GenRequest, SamplingParams
from pool.engines.shared_weights import SharedRegion, layout_bytes, mapped_regions, plan_layout
from pool.engines.weights_keeper import Files
from tests.pool.test_faults import long_reference  # noqa: F401  (fixtures)
from tests.pool.test_live_pool import tiny  # noqa: F401

MiB = 1 << 20
FOLDERS = {"a": "tiny-llama", "b": "tiny-qwen2", "c": "tiny-llama"}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


_CACHE: Any = None


def make_engine(demo_models: dict[str, Path], share_dir: Path | None, device: str = "cpu",
                names: tuple[str, ...] = ("a", "b", "c")) -> Any:
    """A torch engine with the models `names` (their host images read once per process)."""
    global _CACHE
    from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
    from pool.engines.weights import HostWeightCache

    _CACHE = _CACHE or HostWeightCache()
    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = TorchEngine(TorchEngineConfig(device=device, dtype=dtype, kv_bytes=8 * MiB, cuda_graphs=False,
                                           shared_weights=None if share_dir is None else str(share_dir)), _CACHE)
    for name in names:
        engine.load(name, demo_models[FOLDERS[name]])
    return engine


def greedy(engine: Any, model: str, rid: str, max_tokens: int = 6) -> list[int]:
    req = GenRequest(rid, model, tuple(range(11, 18)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outs = engine.prefill([req])
    while not outs[-1].finished:
        outs += engine.decode_step([rid])
    return [o.token_id for o in outs]


def wait_gone(path: Path, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


@pytest.fixture
def share_dir(tmp_path: Path) -> Path:
    return tmp_path / "weights"


def test_layout_places_every_model_once_sorted_and_aligned() -> None:
    layout = plan_layout({"b": 1000, "a": 300, "c": 256})
    assert list(layout) == ["a", "b", "c"]
    assert layout["a"] == (0, 300) and layout["b"] == (512, 1000) and layout["c"] == (1536, 256)
    assert layout_bytes(layout) == 1792


@pytest.mark.parametrize("device", DEVICES)
def test_engines_sharing_a_region_copy_each_model_once_and_compute_the_same_tokens(
        demo_models: dict[str, Path], share_dir: Path, device: str) -> None:
    alone = make_engine(demo_models, None, device)
    want = {}
    for model in ("a", "b"):
        alone.activate(model)
        want[model] = greedy(alone, model, f"ref-{model}")
    alone.close()
    first, second = make_engine(demo_models, share_dir, device), make_engine(demo_models, share_dir, device)
    try:
        first.activate("a")
        assert first.stats().num_weight_copies == 1
        second.activate("a")  # on the device already: mapped, not copied
        assert second.stats().num_weight_copies == 0
        assert greedy(second, "a", "r1") == want["a"] and greedy(first, "a", "r2") == want["a"]
        # several resident models per instance: co-located, each computing as alone
        second.activate("b", evict=False)
        second.activate("c", evict=False)
        assert second.stats().resident_models == ("a", "b", "c")
        assert second.stats().num_weight_copies == 2
        assert greedy(second, "b", "r3") == want["b"] and greedy(second, "a", "r4") == want["a"]
        first.activate("c")  # copied by the other engine: a switch that copies nothing
        first.activate("b", evict=False)
        assert first.stats().num_weight_copies == 1 and first.stats().resident_models == ("b", "c")
        assert greedy(first, "b", "r5") == want["b"]
    finally:
        first.close()
        second.close()


def test_a_model_the_region_has_no_place_for_is_refused(demo_models: dict[str, Path], share_dir: Path) -> None:
    engine = make_engine(demo_models, share_dir, names=("a", "b"))
    try:
        engine.activate("a")
        engine.load("c", demo_models["tiny-llama"])  # loaded after the region was laid out
        with pytest.raises(EngineError, match="no place in the shared weights region"):
            engine.activate("c", evict=False)
        assert engine.stats().resident_models == ("a",)  # the refusal changed nothing
        other = make_engine(demo_models, share_dir, names=("a",))
        with pytest.raises(EngineError, match="must load the same models"):
            other.activate("a")
    finally:
        engine.close()


def test_a_copy_claimed_by_a_dead_engine_is_taken_over(demo_models: dict[str, Path], share_dir: Path) -> None:
    engine = make_engine(demo_models, share_dir)
    try:
        engine.activate("a")
        files = Files(share_dir, "cpu")
        with files.locked():
            table = files.read_table()
            assert table is not None
            table["copies"]["b"] = {"state": "copying", "by": "999999999:dead"}  # no such process
            files.write_table(table)
        engine.activate("b")
        assert files.read_table()["copies"]["b"]["state"] == "ready"  # type: ignore[index]
        assert engine.stats().num_weight_copies == 2
    finally:
        engine.close()


def test_the_keeper_frees_the_region_once_no_engine_maps_it(share_dir: Path) -> None:
    region = SharedRegion(share_dir, "cpu", {"m": 4096}, grace_s=0.3)
    other = SharedRegion(share_dir, "cpu", {"m": 4096}, grace_s=0.3)
    files = region.files
    assert region.keeper == other.keeper and list(mapped_regions().values()) == [2]
    region.storage[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert other.storage[:4].tolist() == [1, 2, 3, 4]  # one region
    region.close()
    time.sleep(0.8)
    assert files.handle.exists(), "the keeper went while an engine of this process still mapped the region"
    other.close()
    assert wait_gone(files.dir), "the keeper left its files behind"
    again = SharedRegion(share_dir, "cpu", {"m": 4096}, grace_s=0.3)  # a fresh region, a fresh keeper
    try:
        assert again.keeper != region.keeper and not again.is_ready("m")
    finally:
        again.close()


# ---- across processes: one owner (the keeper), engines that come and go -------------------------------------------
def _peer(demo_models: dict[str, Path], share_dir: str, device: str, ready: Any, go: Any, result: Any) -> None:
    """A second instance: activate model a (mapped or copied), report its copies and tokens, then wait."""
    torch.set_num_threads(1)
    engine = make_engine(demo_models, Path(share_dir), device)
    engine.activate("a")
    engine.activate("b", evict=False)
    result.put((engine.stats().num_weight_copies, greedy(engine, "a", "peer"), greedy(engine, "b", "peer-b")))
    ready.set()
    go.wait(120)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_or_restarted_engine_leaves_the_others_weights_intact(
        demo_models: dict[str, Path], share_dir: Path, device: str) -> None:
    ctx = mp.get_context("spawn")
    result = ctx.Queue()

    def start_peer() -> tuple[Any, Any, Any]:
        ready, go = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_peer, args=(demo_models, str(share_dir), device, ready, go, result), daemon=True)
        proc.start()
        assert ready.wait(600), "the peer engine did not start"
        return proc, ready, go

    engine = make_engine(demo_models, share_dir, device)
    try:
        engine.activate("a")
        want = greedy(engine, "a", "mine")
        peer, _, _ = start_peer()
        copies, tokens, tokens_b = result.get(timeout=120)
        assert copies == 1 and tokens == want  # "a" mapped from the region; "b" copied by the peer
        os.kill(peer.pid, signal.SIGKILL)  # the instance that copied "b" dies
        peer.join(30)
        engine.activate("b", evict=False)
        assert engine.stats().num_weight_copies == 1  # its copy of "b" outlives it
        assert greedy(engine, "b", "mine-b") == tokens_b and greedy(engine, "a", "mine-2") == want
        restarted, _, go = start_peer()  # a restart maps the region again: nothing to copy
        copies, tokens, tokens_b2 = result.get(timeout=120)
        assert copies == 0 and tokens == want and tokens_b2 == tokens_b
        go.set()
        restarted.join(30)
        keeper = engine.residency.slots.shared.keeper
        assert keeper != peer.pid and keeper != restarted.pid and keeper != os.getpid()
    finally:
        engine.close()


# ---- the live pool: two engine processes, one region ---------------------------------------------------------------
@pytest.mark.slow
def test_a_pool_of_two_processes_copies_each_model_once_between_them(tiny, long_reference,  # noqa: F811
                                                                      share_dir: Path) -> None:
    """Token-level's prefill and decode instances in two processes mapping one region: every model is copied
    into it once between them, and every request ends with its uninterrupted tokens. (An engine process killed
    and restarted beside another: test_a_killed_or_restarted_engine_leaves_the_others_weights_intact.)"""
    from pool.actor import EngineSpec
    from tests.pool.fault_tools import outcomes, wait_until
    from tests.pool.test_faults import submit_all
    from tests.pool.test_live_pool import ENGINE
    from tests.pool.test_processes import local_pool

    engine = EngineSpec("torch", {**ENGINE.options, "shared_weights": str(share_dir)})
    with local_pool(tiny, "processes", roles=["prefill", "decode"], engine=engine) as pool:
        sinks = submit_all(pool)
        counts = outcomes(sinks, long_reference, lambda key: True, 180).counts()
        assert counts == {"identical": len(sinks), "clean_errors": 0, "wrong": 0, "hung": 0, "lost": 0}
        wait_until(lambda: len(pool.engine_stats) == 2 and pool.engine_stats["slot1"]["num_requests"] == 0, 10,
                   "engine stats from both processes")
        stats = pool.engine_stats
        # each model copied into the region once, by the prefill instance (which needs it first); the decode
        # instance computed with all of them and copied nothing
        assert {iid: s["num_weight_copies"] for iid, s in stats.items()} == {"slot0": len(tiny), "slot1": 0}
        assert stats["slot1"]["num_switches"] > 0  # it switched between the models, and its own buffer is KV only
        assert {s["device_buffer_bytes"] for s in stats.values()} == {ENGINE.options["kv_bytes"]}
        table = json.loads((share_dir / "cpu.json").read_text())
        assert {m: c["state"] for m, c in table["copies"].items()} == {m: "ready" for m in tiny}


def test_the_pool_plans_resident_sets_with_the_memory_and_sizes_the_engine_reports(demo_models: dict[str, Path],
                                                                                      share_dir: Path) -> None:
    """The weight budget and model sizes token-level plans its resident sets with are the engine's own (its
    report, `plan_kv`), not the fleet's estimates: a set the policy plans is one the engine holds."""
    from pool.served import plan_kv, served_model, slot_instances

    engines = {"slot0": make_engine(demo_models, share_dir), "slot1": make_engine(demo_models, None)}
    try:
        reports = {iid: e.kv_capacity() for iid, e in engines.items()}
        sizes = {m: engines["slot0"].model_bytes(m) for m in ("a", "b", "c")}
        assert reports["slot0"].weight_bytes == layout_bytes(plan_layout(sizes))  # every model once
        assert reports["slot1"].weight_bytes == 2 * max(sizes.values())  # two slots of the largest
        models = [served_model(m, demo_models[FOLDERS[m]], dtype="float32") for m in ("a", "b", "c")]
        planned, profiles = plan_kv(slot_instances(2, models, 8 * MiB), {m.name: m.profile for m in models}, reports)
        assert [i.weight_bytes for i in planned] == [reports["slot0"].weight_bytes, reports["slot1"].weight_bytes]
        assert {m: p.weight_bytes for m, p in profiles.items()} == sizes
    finally:
        for engine in engines.values():
            engine.close()
