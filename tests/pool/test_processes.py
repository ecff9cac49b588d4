"""The processes backend (an OS process per instance, no Ray) and restarts that free the lost engine's memory.

Real torch engines on CPU with the three tiny demo models: the same greedy
tokens as an uninterrupted run, a killed worker process is a lost instance
whose requests resume on its restarted successor, a worker that cannot
start says which instance and why, and KV handed from a prefill process to
a decode process travels through shared memory, not the pipe.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

from pool.actor import EngineSpec
from pool.engines.device import held_device_bytes
from pool.procs import SHM_MIN_BYTES, ShmArray, _dumps_result
from pool.config import PoolConfig
from pool.service import LivePool, served_model, slot_instances
from tests.factories import LinearCosts
from tests.pool.fault_tools import NOTHING, allocated, outcomes, wait_until
from tests.pool.test_faults import LONG_TOKENS, kill_mid_decode, long_reference, submit_all  # noqa: F401
from tests.pool.test_live_pool import ENGINE, KV_BYTES, tiny  # noqa: F401


def local_pool(tiny, backend: str, num_instances: int = 2, roles=None, engine=ENGINE, **options) -> LivePool:  # noqa: F811
    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    return LivePool(models, slot_instances(num_instances, models, KV_BYTES, roles), "token-level", LinearCosts(),
                    PoolConfig(engine=engine, backend=backend, stats_interval_s=0.1,
                               policy_options={"fixed_turn_steps": 4}, **options))


def test_processes_backend_serves_prefill_decode_split_with_identical_tokens(tiny, long_reference) -> None:  # noqa: F811
    with local_pool(tiny, "processes", roles=["prefill", "decode"]) as pool:
        pids = {iid: w.process.pid for iid, w in pool._backend.workers.items()}
        assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
        sinks = submit_all(pool)
        counts = outcomes(sinks, long_reference, lambda key: True, 120).counts()
        assert counts == {"identical": len(sinks), "clean_errors": 0, "wrong": 0, "hung": 0, "lost": 0}
        status = pool.status()
        assert status["lost_instances"] == [] and status["tick_errors"] == 0
        wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")
        wait_until(lambda: len(pool.engine_stats) == 2, 10, "engine stats from both processes")
        assert all(s["device"] == "cpu" for s in pool.engine_stats.values())
    # stop() ended them (a process killed after its 10 s to close may take a moment more to be reaped on a loaded
    # machine: pool.procs.stop_worker; seen once in CI, session 29)
    wait_until(lambda: all(not w.process.is_alive() for w in pool._backend.workers.values()), 15,
               f"worker processes gone: {[w.process.exitcode for w in pool._backend.workers.values()]}")


def test_killed_worker_process_is_a_lost_instance_and_comes_back(tiny, long_reference) -> None:  # noqa: F811
    with local_pool(tiny, "processes", num_instances=1) as pool:
        old = pool._backend.workers["slot0"].process
        sinks = submit_all(pool)
        killed, held = kill_mid_decode(pool)
        result = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 120)
        counts = result.counts()
        assert counts == {"identical": len(sinks), "clean_errors": 0, "wrong": 0, "hung": 0, "lost": 0}, result
        assert held, "the killed process held part-decoded requests"
        status = pool.status()
        assert status["restarts"] == 1 and status["lost_instances"] == [] and status["tick_errors"] == 0
        assert not old.is_alive() and old.exitcode is not None
        assert pool._backend.workers["slot0"].process.pid != old.pid
        wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")


def test_worker_that_cannot_start_names_its_instance(tiny, tmp_path) -> None:  # noqa: F811
    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    pool = LivePool(models, slot_instances(1, models, KV_BYTES), "token-level", LinearCosts(),
                    PoolConfig(engine=ENGINE, backend="processes"))
    pool.models[models[0].name] = type(models[0])(models[0].name, tmp_path / "missing", models[0].profile)
    with pytest.raises(RuntimeError, match=r"instance slot0 failed to start"):
        pool.start()


def test_kv_arrays_travel_through_shared_memory_files() -> None:
    import pickle

    big = np.arange(SHM_MIN_BYTES, dtype=np.uint8)
    small = np.arange(16, dtype=np.uint8)
    handle, (held_big, held_small) = pickle.loads(_dumps_result((7, (big, small))))
    assert handle == 7 and isinstance(held_big, ShmArray) and isinstance(held_small, np.ndarray)
    assert held_big.nbytes == big.nbytes and os.path.exists(held_big.path)
    mapped = pickle.loads(pickle.dumps(held_big))  # what the importing worker gets
    assert np.array_equal(mapped, big)
    path = held_big.path
    del held_big, mapped
    gc.collect()
    assert not os.path.exists(path), "the file goes with the controller's last reference to it"


def watch_builds(pool: LivePool, device: str) -> list[int]:
    """The engine device bytes this process holds on `device` each time the pool builds an engine (threads)."""
    seen: list[int] = []
    build = pool._new_engine

    def watched(instance_id: str):
        gc.collect()
        seen.append(held_device_bytes(device))
        return build(instance_id)

    pool._new_engine = watched  # type: ignore[method-assign]
    return seen


def test_threads_restart_frees_the_lost_engine_before_building_its_successor(tiny, long_reference) -> None:  # noqa: F811
    """The lost engine's device buffer is freed (engine memory accounting) before the new one is made."""
    with local_pool(tiny, "threads", num_instances=1) as pool:
        engine = pool._backend.engines["slot0"]
        old = weakref.ref(engine)
        seen = watch_builds(pool, "cpu")
        sinks = submit_all(pool)
        wait_until(lambda: engine.stats().device_buffer_bytes > 0, 30, "the engine's device buffer")
        mine = engine.stats().device_buffer_bytes
        others = held_device_bytes("cpu") - mine  # engines of other tests still alive in this process
        del engine
        kill_mid_decode(pool)
        counts = outcomes(sinks, long_reference, lambda key: pool.holds(f"{key[0]}-{key[1]}"), 120).counts()
        assert counts["identical"] == len(sinks), counts
        assert seen == [others], f"device bytes held when the successor was built: {seen} (the lost engine's: {mine})"
        gc.collect()
        assert old() is None, "the lost engine is still referenced"
        assert held_device_bytes("cpu") == others + mine  # the successor's buffer


@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_prefill_decode_hand_off_staged_in_device_memory(tiny, long_reference, backend) -> None:  # noqa: F811
    """KV staged for hand-offs (pool.engines.handoff; CPU: a shared-memory arena opened by the decode process):
    the same tokens, every hand-off staged, and every staged region released once imported or cancelled."""

    engine = EngineSpec("torch", {**ENGINE.options, "handoff_bytes": 8 << 20})
    with local_pool(tiny, backend, roles=["prefill", "decode"], engine=engine) as pool:
        sinks = submit_all(pool)

        def carried() -> list[str]:  # handed over, their KV staged, waiting for the decode instance's SwapIn
            with pool._lock:
                return [rid for rid, live in list(pool.controller.requests.items()) if live.kv_staged]

        wait_until(lambda: bool(carried()), 60, "a request handed over and waiting with its KV staged")
        cancelled = set(carried()[:2])
        for request_id in cancelled:  # their regions are freed at the prefill instance (else they would leak)
            pool.cancel(request_id)
        result = outcomes({k: s for k, s in sinks.items() if f"{k[0]}-{k[1]}" not in cancelled}, long_reference,
                          lambda key: True, 120)
        assert result.counts()["identical"] == len(sinks) - len(cancelled), result
        wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")

        def staged() -> tuple[int, int, int]:
            prefill, decode = pool.engine_stats["slot0"]["extra"], pool.engine_stats["slot1"]["extra"]
            kv_out, kv_in = prefill["timings"]["kv"], decode["timings"]["kv"]
            return (prefill["handoff_staged_bytes"], kv_out.get("export_kv(device)", {}).get("requests", 0),
                    kv_in.get("import_kv(device)", {}).get("requests", 0))

        wait_until(lambda: len(pool.engine_stats) == 2 and staged()[0] == 0 and staged()[2] > 0, 10,
                   "every staged region released")
        _, exported, imported = staged()
        assert exported >= len(sinks) - len(cancelled) and imported >= len(sinks) - len(cancelled)
        kv = pool.engine_stats["slot0"]["extra"]["timings"]["kv"]
        assert "export_kv" not in kv  # none went through host memory


def test_only_prefill_instances_on_every_decoders_device_get_a_hand_off_arena(tiny) -> None:  # noqa: F811
    """One engine spec serves every instance: the arena goes where scheduler.instance.staging_instances says
    (the simulator's rule); a prefill instance on another GPU would stage where the decoder cannot copy from."""

    engine = EngineSpec("torch", {**ENGINE.options, "handoff_bytes": 8 << 20})
    pool = local_pool(tiny, "threads", num_instances=3, roles=["prefill", "prefill", "decode"], engine=engine,
                      devices={"slot0": "cuda:0", "slot1": "cuda:1", "slot2": "cuda:0"})
    arenas = {iid: pool._engine_spec(iid).options["handoff_bytes"] for iid in ("slot0", "slot1", "slot2")}
    assert arenas == {"slot0": 8 << 20, "slot1": 0, "slot2": 0}
    one_device = local_pool(tiny, "threads", num_instances=3, roles=["prefill", "prefill", "decode"], engine=engine)
    assert [one_device._engine_spec(f"slot{k}").options["handoff_bytes"] for k in range(3)] == [8 << 20] * 2 + [0]
    # Ray places actors on GPUs itself: its one spec keeps the arena only where the pool has a single GPU
    assert pool._ray_engine().options["handoff_bytes"] == 0
    assert one_device._ray_engine().options["handoff_bytes"] == 8 << 20
    pd = local_pool(tiny, "threads", roles=["prefill", "decode"], engine=engine,
                    devices={"slot0": "cuda:0", "slot1": "cuda:0"})
    assert pd._ray_engine() is engine  # the default one-GPU layout: unchanged


def test_a_benchmark_can_sample_each_engine_process_host_time(tiny, long_reference, tmp_path,  # noqa: F811
                                                              monkeypatch) -> None:
    """MODELPOOL_HOST_PROFILE_S beside MODELPOOL_CALL_LOG_DIR (benchmarks/gpu_pool.py --host-profile-s): each
    engine process writes pyinstrument reports of its host time per window, named by the window's start on the
    call logs' clock, and serves the same tokens meanwhile."""
    import time

    monkeypatch.setenv("MODELPOOL_CALL_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("MODELPOOL_HOST_PROFILE_S", "0.5")
    started = time.monotonic()
    with local_pool(tiny, "processes", roles=["prefill", "decode"]) as pool:
        sinks = submit_all(pool)
        counts = outcomes(sinks, long_reference, lambda key: True, 120).counts()
        assert counts == {"identical": len(sinks), "clean_errors": 0, "wrong": 0, "hung": 0, "lost": 0}
    for iid in ("slot0", "slot1"):
        reports = sorted(tmp_path.glob(f"host-{iid}-*.txt"), key=lambda p: float(p.stem.rsplit("-", 1)[1]))
        assert reports, f"no host report from {iid}"
        assert all(started - 1 <= float(p.stem.rsplit("-", 1)[1]) <= time.monotonic() for p in reports)
        text = "".join(p.read_text() for p in reports)
        assert "call_engine" in text  # the engine calls, sampled
    decoder = "".join(p.read_text() for p in tmp_path.glob("host-slot1-*.txt"))
    assert "decode_step" in decoder
    assert (tmp_path / "calls-slot1.json").exists()  # the call log beside them


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_cuda_restart_frees_the_lost_engines_device_memory_first(tiny, backend, monkeypatch) -> None:  # noqa: F811
    """On a GPU: an instance killed mid-decode is rebuilt only once the lost engine's device memory is free, and
    every request still ends with all its tokens. Processes: the GPU's memory in use (the driver's figure,
    cudaMemGetInfo) is back to what it was before the pool - the lost process is gone. Threads: the device memory
    this process's tensors hold is back to what it was (Engine.close freed the buffer, KV and graphs; what the
    process keeps for itself - cuBLAS's workspace per stream, which the successor reuses - is set aside)."""
    import torch

    import pool.service

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kv = 4 << 30  # enough that a leak shows in the GPU's memory
    spec = EngineSpec("torch", {"kv_bytes": kv})

    def held(idle: bool = True) -> int:
        if backend == "processes":
            free, total = torch.cuda.mem_get_info()
            return total - free
        if idle:  # no engine runs in this process now: its cuBLAS workspaces can go
            torch._C._cuda_clearCublasWorkspaces()
        return torch.cuda.memory_allocated()

    before = held()  # processes: this process's own CUDA context, nothing else
    at_build: list[int] = []

    def watched(build):
        def build_after_looking(*args, **kwargs):
            gc.collect()
            free, total = torch.cuda.mem_get_info()
            at_build.append(held())
            print(f"[{backend}] at the successor's build: {at_build[-1]:,} bytes held ({before:,} before the pool), "
                  f"the GPU's memory in use {total - free:,}")  # shown with pytest -s (the GPU runs)
            return build(*args, **kwargs)
        return build_after_looking

    with local_pool(tiny, backend, num_instances=1, engine=spec, devices={"slot0": "cuda:0"}) as live:
        if backend == "threads":
            live._new_engine = watched(live._new_engine)  # type: ignore[method-assign]
        else:
            monkeypatch.setattr(pool.service, "start_workers", watched(pool.service.start_workers))
        sinks = submit_all(live)
        wait_until(lambda: live.engine_stats.get("slot0", {}).get("device_buffer_bytes", 0) > 0, 120,
                   "the engine's device buffer")
        assert held(idle=False) >= before + kv, "the engine's KV is not counted: the test could not see a leak"
        kill_mid_decode(live)
        wait_until(lambda: all(s.done.is_set() for s in sinks.values()), 300, "every request ended")
        assert all(s.error is None and len(s.tokens) == LONG_TOKENS and not s.after_end for s in sinks.values())
        assert live.status()["restarts"] == 1
        assert len(at_build) == 1, at_build
        assert at_build[0] <= before + (128 << 20), \
            f"device memory held when the successor was built: {at_build[0]:,} bytes, {before:,} before the pool"


def test_token_outs_cross_the_pipe_whole():
    """TokenOut pickles as its fields (its __reduce__: the engine process sends one per request per step), every
    field kept, through the worker's own pickler too."""
    import pickle

    from pool.engines.base import TokenOut
    from pool.procs import _dumps_result

    outs = [TokenOut("r1", 7, "hi", False, None), TokenOut("r2", 0, "", True, "length")]
    assert pickle.loads(pickle.dumps(outs)) == outs
    assert pickle.loads(_dumps_result(outs)) == outs


def test_freeze_heap_puts_what_start_up_made_out_of_full_collections():
    """pool.heap.freeze_heap (engine processes after warm-up, Ray actors, serve once ready): every object alive
    then moves to the collector's permanent generation; objects made later are collected as before."""
    import gc
    import weakref

    from pool.heap import freeze_heap

    class Node:
        pass

    try:
        before = Node()
        before.me = before  # a cycle only a collection frees
        frozen = freeze_heap()
        assert frozen > 1000  # the imports at least
        # a frozen object still goes when its last reference does (another test's thread may drop a few meanwhile)
        assert 0 <= frozen - gc.get_freeze_count() < 100
        made = Node()
        made.me = made
        ref = weakref.ref(made)
        del made
        gc.collect()
        assert ref() is None  # made after the freeze: collected
        old = weakref.ref(before)
        del before
        gc.collect()
        assert old() is not None  # frozen: left alone
    finally:
        gc.unfreeze()


def test_slow_calls_sample_the_stack_of_a_call_past_its_threshold(tmp_path) -> None:
    """pool.procs.SlowCalls (MODELPOOL_SLOW_CALL_MS under a benchmark): while a call runs past the threshold a
    thread takes the caller's stack; a quick call leaves nothing."""
    import json
    import time

    from pool.procs import SlowCalls

    def a_slow_part() -> None:
        time.sleep(0.2)

    slow = SlowCalls(str(tmp_path), "slotX", 0.02)
    slow.current = ("quick", time.monotonic())
    time.sleep(0.01)
    slow.current = ("import_kv", time.monotonic())
    a_slow_part()
    slow.current = None
    slow.close()
    rows = json.loads((tmp_path / "slow-slotX.json").read_text())
    assert rows and {row[0] for row in rows} == {"import_kv"}
    assert all(20 <= row[2] <= 250 for row in rows) and len(rows) >= 4  # every 5 ms from 20 ms on
    assert all(row[3][-1].endswith("a_slow_part") for row in rows)
