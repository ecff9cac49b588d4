"""The KV an engine reports is the KV it has: slab sizing, the slab pool's promise, each engine's report, and
the scheduler's budget built from the reports (`plan_kv`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pool.engines.base import GenRequest, KvCapacity, OutOfKvMemory, SamplingParams
from pool.engines.kv import KvShape, SlabPool, device_pool, host_pool, slab_bytes_for, slab_share
from pool.engines.sim_engine import SimEngine
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
from pool.served import plan_kv, served_model, slot_instances
from scheduler.fleet import catalogue_arch
from scheduler import InstanceSpec, ModelProfile, Request, make_scheduler
from tests.factories import LinearCosts

MiB, GiB = 1 << 20, 1 << 30


def shape(layers: int, heads: int, dim: int, block: int = 16, dtype: torch.dtype = torch.float32) -> KvShape:
    return KvShape(layers, heads, dim, block, dtype)


def pool_of(slab_bytes: int, num_slabs: int) -> SlabPool:
    region = torch.empty(slab_bytes * num_slabs, dtype=torch.uint8)
    return SlabPool(slab_bytes, num_slabs, lambda i: region[i * slab_bytes:(i + 1) * slab_bytes],
                    slab_offset=lambda i: i * slab_bytes)


# ---- slab sizing ------------------------------------------------------------------------------------------
def test_auto_slabs_hold_whole_blocks_of_every_shape_so_the_demo_loses_no_slab_tail() -> None:
    smollm2, tiny, qwen3 = (shape(30, 3, 64).block_bytes, shape(2, 2, 64).block_bytes, shape(2, 2, 48).block_bytes)
    slab = slab_bytes_for([smollm2, tiny, qwen3], MiB, 8 * MiB)
    assert slab >= MiB and all(slab % b == 0 for b in (smollm2, tiny, qwen3))
    assert slab == math.lcm(smollm2, tiny, qwen3) * -(-MiB // math.lcm(smollm2, tiny, qwen3))
    # the old fixed 1 MiB slab held one 720 KiB SmolLM2 block: 28% of the region lost
    assert MiB // smollm2 * smollm2 / MiB < 0.71
    # no common multiple among the candidates: a whole number of the largest block, the best one for the other
    big, small = 7 * 999983, 3 * 1000003
    odd = slab_bytes_for([small, big], MiB, GiB)
    assert odd % big == 0 and odd >= MiB
    assert slab_share(odd, [small, big], GiB) == max(slab_share(k * big, [small, big], GiB) for k in range(1, 65))
    assert slab_bytes_for([], MiB, GiB) == MiB
    # host slabs: the configured size times a power of two (torch's pinned allocator rounds sizes up to one)
    host = slab_bytes_for([small, big], 4 * MiB, GiB, doubling=True)
    assert host // (4 * MiB) in (1, 2, 4, 8, 16, 32, 64, 128, 256) and host * (host // (4 * MiB)) != 0
    assert slab_bytes_for([2 * MiB], 4 * MiB, GiB, doubling=True) == 4 * MiB  # a whole number already


def _fleet_shapes(archs: Sequence[str]) -> list[KvShape]:
    """The block shapes of catalogue archs as the torch engine makes them (16-token blocks)."""
    out = []
    for key in archs:
        arch = catalogue_arch(key)
        out.append(KvShape(arch.num_layers, arch.num_kv_heads, arch.dim, 16, torch.bfloat16))
        assert out[-1].block_bytes == 16 * arch.kv_bytes_per_token
    return out


SCENARIO_FLEETS = {  # sims.scenarios' fleets, by arch
    "mixed": ("qwen3-4b", "llama-3.2-3b", "qwen2.5-3b", "llama-3.2-1b", "qwen3-1.7b"),
    "eight": ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b"),
    "large": ("qwen2.5-7b", "yi-1.5-6b"),
    "small": ("qwen2.5-0.5b", "llama-3.2-1b"),
}
DEVICE_KV, HOST_KV = 18_160_000_000, 16_000_000_000  # the mixed-onoff H100 run's decode instance


def _shares(device: SlabPool, host: SlabPool, shapes: list[KvShape]) -> list[tuple[float, float]]:
    return [(device.usable_blocks(s, shapes) * s.block_bytes / DEVICE_KV,
             host.usable_blocks(s, shapes) * s.block_bytes / HOST_KV) for s in shapes]


@pytest.mark.parametrize("fleet", sorted(SCENARIO_FLEETS))
def test_slabs_sized_to_the_fleets_blocks_promise_every_shape_nearly_all_of_both_tiers(fleet: str) -> None:
    """3-4B models have 1-2.4 MB blocks: slabs of a few MiB held one or two, and the mixed fleet's pools promised
    its shapes 78% of the device region and 56% of the host bound; sized by slab_bytes_for, at least 98%."""
    shapes = _fleet_shapes(SCENARIO_FLEETS[fleet])
    region = torch.empty(DEVICE_KV, dtype=torch.uint8, device="meta")  # slabs are views: no memory
    blocks = [s.block_bytes for s in shapes]
    device = device_pool(region, slab_bytes_for(blocks, MiB, DEVICE_KV))
    host = host_pool(4 * MiB, HOST_KV, pin=False, block_bytes=lambda: blocks)
    shares = _shares(device, host, shapes)
    assert all(d >= 0.98 and h >= 0.98 for d, h in shares), shares
    assert host.num_slabs == 0  # sized, none made: nothing reserved
    if fleet == "mixed":
        assert device.slab_bytes == 14 * max(blocks) and host.slab_bytes == 16 * MiB
        assert min(d for d, _ in shares) > 0.99
        # the old sizes: a whole number of the largest block (no common multiple within 4 MiB), 4 MiB host slabs
        old = _shares(device_pool(region, max(blocks)), host_pool(4 * MiB, HOST_KV, pin=False), shapes)
        assert round(min(d for d, _ in old), 2) == 0.78 and round(min(h for _, h in old), 2) == 0.56


def test_host_slabs_are_sized_to_the_loaded_models_when_the_device_buffer_is_made(demo_models) -> None:
    """The host pool is made before any model loads: its slab size and its reserved slabs wait for them."""
    engine = TorchEngine(TorchEngineConfig(dtype="float32", kv_bytes=8 * MiB, host_slab_bytes=64 << 10,
                                           max_host_kv_bytes=8 * MiB, host_kv_prealloc_bytes=MiB))
    assert engine.host_kv.num_slabs == 0
    for name, path in demo_models.items():
        engine.load(name, path)
    blocks = [engine.residency.models.require(name).kv_shape.block_bytes for name in demo_models]
    report = engine.kv_capacity()
    slab = engine.host_kv.slab_bytes
    assert slab == slab_bytes_for(blocks, 64 << 10, 8 * MiB, doubling=True) and slab > 64 << 10
    assert engine.host_kv.num_slabs == -(-MiB // slab)  # the reserved slabs, of the new size
    # what the host pool promises is what the rule weighed (64 KiB slabs held no 720 KiB SmolLM2 block at all)
    promised = [report.host_tokens[name] * b // 16 / (8 * MiB) for name, b in zip(demo_models, blocks)]
    assert min(promised) == pytest.approx(slab_share(slab, blocks, 8 * MiB)) and min(promised) > 0.5
    engine.close()


# ---- the pool's promise -----------------------------------------------------------------------------------
def test_one_shape_can_use_every_block_it_is_promised_and_not_one_more() -> None:
    s = shape(2, 2, 64)
    pool = pool_of(5 * s.block_bytes + 100, 7)  # slabs off the row grid: some hold a block less, and say so
    usable = pool.usable_blocks(s, [s])
    assert 28 < usable < 35 and pool.usable_blocks(s, [s], held=1) == usable - 1
    pool.allocate(s, usable)
    with pytest.raises(OutOfKvMemory):
        pool.allocate(s, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 2), st.sampled_from([16, 32, 48, 64])), min_size=1,
                max_size=3, unique=True),
       st.integers(1, 12), st.integers(2, 10), st.booleans(), st.data())
def test_any_mix_whose_shares_add_up_to_one_fits(dims, blocks_per_slab, num_slabs, held, data) -> None:
    """Requests of several shapes, each counted as blocks / usable_blocks of its shape: while the shares sum to
    at most 1, every allocation succeeds (with a scratch block per shape held when `held`). Allocations only:
    frees can fragment the slabs between shapes, which the promise does not cover (see pool.engines.kv)."""
    shapes = [shape(layers, heads, dim) for layers, heads, dim in dims]
    slab = max(s.block_bytes for s in shapes) * blocks_per_slab
    pool = pool_of(slab, num_slabs)
    usable = {s: pool.usable_blocks(s, shapes, int(held)) for s in shapes}
    if held:
        for s in shapes:
            if usable[s]:
                pool.allocate(s, 1)
    share = 0.0
    for _ in range(40):
        s = data.draw(st.sampled_from(shapes))
        count = data.draw(st.integers(1, 4))
        if not usable[s] or share + count / usable[s] > 1 + 1e-12:
            continue
        pool.allocate(s, count)  # must not raise
        share += count / usable[s]


# ---- each engine's report ---------------------------------------------------------------------------------
def test_torch_engine_report_is_exact_for_smollm2_and_true_beside_the_tiny_models(demo_models, smollm2) -> None:
    alone = TorchEngine(TorchEngineConfig(dtype="float32", kv_bytes=8 * MiB))
    alone.load("smollm2-135m", smollm2)
    report = alone.kv_capacity()
    assert report.block_tokens == {"smollm2-135m": 16}
    per_token = 2 * 30 * 3 * 64 * 4
    slab = alone.residency.kv.device.slab_bytes  # type: ignore[union-attr]
    assert slab % (16 * per_token) == 0  # no slab loses a tail; the region loses less than a slab
    assert report.tokens["smollm2-135m"] == 8 * MiB // slab * slab // per_token > (8 * MiB - slab) // per_token
    alone.activate("smollm2-135m")
    request = [GenRequest(f"r{k}", "smollm2-135m", [1] * 16, SamplingParams(max_tokens=2)) for k in range(12)]
    done = 0
    for r in request:  # one block each: exactly as many as reported fit
        if done == report.tokens["smollm2-135m"] // 16:
            with pytest.raises(OutOfKvMemory):
                alone.prefill([r])
            break
        alone.prefill([r])
        done += 1
    assert done == report.tokens["smollm2-135m"] // 16
    assert alone.stats().kv_capacity == report
    alone.close()
    mixed = TorchEngine(TorchEngineConfig(dtype="float32", kv_bytes=8 * MiB))
    for name, path in demo_models.items():
        mixed.load(name, path)
    both = mixed.kv_capacity()
    slab = mixed.residency.kv.device.slab_bytes  # type: ignore[union-attr]
    slabs = 8 * MiB // slab - (3 - 1)  # three block shapes: two slabs kept for part-filled ones
    assert both.tokens["smollm2-135m"] == slabs * slab // per_token
    assert both.tokens["tiny-llama"] == both.tokens["tiny-qwen2"] == slabs * slab // (2 * 2 * 2 * 64 * 4)
    mixed.close()


def test_sim_engine_reports_its_bytes_by_the_token() -> None:
    engine = SimEngine(LinearCosts(), kv_bytes=10_000, kv_bytes_per_token={"a": 300, "b": 7})
    engine.load("a")
    engine.load("b")
    assert engine.kv_capacity() == KvCapacity({"a": 33, "b": 1428}, {"a": 1, "b": 1})


# ---- the scheduler's budget -------------------------------------------------------------------------------
def test_plan_kv_gives_the_scheduler_the_least_budget_every_model_allows_and_the_block() -> None:
    profiles = {"a": ModelProfile("a", 1, 1e6, 100, 4096, 1, 0.1), "b": ModelProfile("b", 1, 2e6, 10, 4096, 1, 0.1)}
    specs = [InstanceSpec("s0", 1, 9e9), InstanceSpec("s1", 1, 9e9)]
    reports = {"s0": KvCapacity({"a": 1000, "b": 20_000}, {"a": 16, "b": 16}),
               "s1": KvCapacity({"a": 900, "b": 20_000}, {"a": 16, "b": 32})}
    planned, planned_profiles = plan_kv(specs, profiles, reports)
    assert [s.kv_bytes for s in planned] == [100_000.0, 90_000.0]
    assert planned_profiles["a"].kv_block_tokens == 16 and planned_profiles["b"].kv_block_tokens == 32
    for policy in ("dedicated", "request-level", "spatial", "token-level"):
        options = {"replicas": {"a": 1, "b": 1}} if policy == "dedicated" else {}
        planned_specs = planned if policy != "token-level" else [
            InstanceSpec(s.instance_id, 1, s.memory_bytes, role, s.kv_bytes)
            for s, role in zip(planned, ("prefill", "decode"))]
        sched = make_scheduler(policy, planned_profiles, planned_specs, LinearCosts(), **options)
        capacity = {iid: inst.kv_capacity_bytes for iid, inst in sched.instances.items()}  # type: ignore[attr-defined]
        assert capacity == {"s0": 100_000.0, "s1": 90_000.0}, policy  # whatever weights the policy places
        assert sched.kv_room("a") in (100_000.0, 90_000.0), policy  # type: ignore[attr-defined]
        # 17 tokens take two blocks of 16: 32 tokens of KV
        assert sched.kv_need_bytes(Request("r", "a", 0.0, 10, 7)) == 3200  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="reported no KV"):
        plan_kv(specs, profiles, {"s0": reports["s0"]})
    with pytest.raises(ValueError, match=r"no KV for \['b'\]"):
        plan_kv(specs, profiles, {"s0": KvCapacity({"a": 1}, {"a": 1}), "s1": reports["s1"]})


def test_the_live_pool_plans_with_what_its_engines_report(demo_models, smollm2) -> None:
    from pool.actor import EngineSpec
    from pool.config import PoolConfig
    from pool.service import LivePool

    models = [served_model("smollm2-135m", smollm2, dtype="float32")]
    pool = LivePool(models, slot_instances(1, models, 8 * MiB), "request-level", LinearCosts(),
                    PoolConfig(engine=EngineSpec("torch", {"dtype": "float32", "kv_bytes": 8 * MiB}),
                               backend="threads"))
    with pool:
        planned = pool.planned_instances[0]
        block = 16 * 2 * 30 * 3 * 64 * 4  # 720 KiB: one shape, so the slab that wastes least is 11 blocks
        assert planned.kv_bytes == 8 * MiB // block * block
        status = pool.status()["instances"]["slot0"]
        assert status["kv_capacity_bytes"] == planned.kv_bytes
        (info,) = pool.model_infos()
        assert info.max_model_len == planned.kv_bytes // (2 * 30 * 3 * 64 * 4)
