"""A step's inputs on the device: the packed rows equal the per-token rule, and on CUDA the input stage (a kernel
reading pinned host memory, no copy engine) gives every upload its own values while earlier work is queued."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pool.engines.device import InputStage, to_device
from pool.engines.kv import KvShape
from pool.engines.kvstore import (SeqKv, decode_inputs, padded_prefill_tokens, prefill_inputs,
                                  prefill_token_buckets)

SHAPE = KvShape(num_layers=2, num_kv_heads=1, head_dim=4, block_size=16, dtype=torch.float32)


def _seq(rng: np.random.Generator, tokens: int) -> SeqKv:
    blocks = -(-tokens // SHAPE.block_size) + 1
    return SeqKv(SHAPE, rows=[int(r) for r in rng.choice(10_000, size=blocks, replace=False) * 64])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=6), st.integers(0, 2**31))
def test_prefill_inputs_follow_the_per_token_rule(lengths: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = [[int(t) for t in rng.integers(0, 50_000, size=n)] for n in lengths]
    kvs = [_seq(rng, n) for n in lengths]
    inp = prefill_inputs(tokens, kvs, torch.device("cpu"))
    where = [kv.slot_of(p) for toks, kv in zip(tokens, kvs) for p in range(len(toks))]
    assert inp.token_ids.tolist() == [t for toks in tokens for t in toks]
    assert inp.positions.tolist() == [p for toks in tokens for p in range(len(toks))]
    assert inp.write_row.tolist() == [w[0] for w in where]
    assert inp.write_offset.tolist() == [w[1] for w in where]
    assert inp.seq_lens == lengths
    assert inp.ends.tolist() == (np.cumsum(lengths) - 1).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 700), min_size=1, max_size=6), st.integers(0, 2**31))
def test_padded_prefill_inputs_add_only_scratch_writes(lengths: list[int], seed: int) -> None:
    """Padding keeps every real token's row as the unpadded inputs have it and aims every padded one at the
    scratch row, position 0; attention's lengths and the last-token indices are the real ones."""
    rng = np.random.default_rng(seed)
    tokens = [[int(t) for t in rng.integers(1, 50_000, size=n)] for n in lengths]
    kvs = [_seq(rng, n) for n in lengths]
    plain = prefill_inputs(tokens, kvs, torch.device("cpu"))
    padded = prefill_inputs(tokens, kvs, torch.device("cpu"), pad_row=7 * 64)
    real = sum(lengths)
    assert len(padded.token_ids) == padded_prefill_tokens(real)
    for name in ("token_ids", "positions", "write_row", "write_offset"):
        assert getattr(padded, name)[:real].tolist() == getattr(plain, name).tolist()
    tail = {name: set(getattr(padded, name)[real:].tolist()) for name in ("token_ids", "positions", "write_row",
                                                                          "write_offset")}
    assert real == len(padded.token_ids) or tail == {"token_ids": {0}, "positions": {0}, "write_row": {7 * 64},
                                                     "write_offset": {0}}
    assert padded.seq_lens == plain.seq_lens and padded.ends.tolist() == plain.ends.tolist()


def test_padded_lengths_are_few_and_cost_at_most_an_eighth() -> None:
    """Every length pads to one of the buckets warm_up runs, by under an eighth of its power of two (16 below
    128): a few dozen shapes up to the pool's default 8192 tokens."""
    buckets = prefill_token_buckets(8192)
    assert buckets == sorted(set(buckets)) and buckets[-1] == 8192 and len(buckets) <= 64
    for n in range(1, 8193):
        p = padded_prefill_tokens(n)
        assert p in buckets and p >= n and p % 16 == 0 and padded_prefill_tokens(p) == p
        assert p - n < max(16, 2 ** (n.bit_length() - 4)) and (n < 128 or p <= 1.125 * n)


def test_to_device_on_cpu_is_the_array_itself() -> None:
    values = np.arange(5, dtype=np.int64)
    out = to_device(values, torch.device("cpu"))
    assert out.dtype == torch.int64 and out.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped-read", "pinned-copy"])
def test_cuda_uploads_keep_their_own_values_behind_queued_work(mapped: bool) -> None:
    """More uploads than the stage has buffers, all queued behind a long stretch of device work (so a buffer is
    reused while the kernels that read it earlier have not run, unless the stage waits): each tensor holds
    exactly the values it was given, growing buffers included."""
    device = torch.device("cuda")
    stage = InputStage(device, slots=4)
    assert stage.mapped, "this GPU should map pinned memory (the H200 does): the fast path is untested otherwise"
    stage.mapped = mapped
    rng = np.random.default_rng(0)
    a = torch.randn(4096, 4096, device=device)
    for _ in range(30):
        a = torch.tanh(a @ a)  # tens of ms of queued work ahead of every upload
    sent = [rng.integers(-2**40, 2**40, size=int(rng.integers(1, 20_000)), dtype=np.int64) for _ in range(40)]
    got = [stage.upload(v.copy()) for v in sent]
    torch.cuda.synchronize()
    for values, tensor in zip(sent, got):
        assert np.array_equal(tensor.cpu().numpy(), values)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_inputs_on_cuda_equal_those_on_cpu() -> None:
    rng = np.random.default_rng(1)
    kvs = [_seq(rng, n) for n in (5, 40, 17)]
    positions = [4, 39, 16]
    args = ([7, 8, 9], kvs, positions)
    cpu = decode_inputs(*args, torch.device("cpu"), 4, 5)
    cuda = decode_inputs(*args, torch.device("cuda"), 4, 5)
    assert torch.equal(cuda.packed.cpu(), cpu.packed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stage_pins_its_buffers_up_front_and_counts_growth() -> None:
    """Every buffer of the ring is pinned at start for `capacity` values: the largest step inputs the pool sends
    (a prefill of 8192 tokens, a decode step of 64 x 1024 blocks) never pin memory while serving; an upload past
    the capacity still works and is counted."""
    stage = InputStage(torch.device("cuda", torch.cuda.current_device()), slots=4, capacity=70_000)
    assert stage.mapped and stage.grown == 0
    for n in (5, 33_000, 66_000, 70_000, 12, 70_000, 3, 66_000):  # each buffer of the ring takes two
        values = np.arange(n, dtype=np.int64) * 3 + n
        assert np.array_equal(stage.upload(values).cpu().numpy(), values)
    assert stage.grown == 0
    big = np.arange(max(b.numel() for b in stage._pinned) + 1, dtype=np.int64)  # past every buffer (rounded up)
    assert np.array_equal(stage.upload(big).cpu().numpy(), big) and stage.grown == 1


def test_engine_stats_report_the_request_path_allocations(demo_models) -> None:  # type: ignore[no-untyped-def]
    """The counters the GPU harness reads (benchmarks/gpu_pool.py): present, and 0 where nothing can wait (CPU)."""
    from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
    from pool.engines.weights import HostWeightCache

    engine = TorchEngine(TorchEngineConfig(device="cpu"), weight_cache=HostWeightCache())
    engine.load("tiny-llama", demo_models["tiny-llama"])
    extra = engine.stats().extra
    assert extra["alloc_retries"] == 0 and extra["input_stage_grown"] == 0
