"""The fused (Triton) decode and prefill paths against the plain torch ones, on CUDA or under Triton's CPU interpreter.

CI boxes without Triton skip these; `TRITON_INTERPRET=1 MODELPOOL_FUSED=1` runs them on a CPU (slowly). The
interpreter truncates float -> bf16 casts where GPUs round, so bf16 is held to a looser bound there.
The engine-level check (greedy tokens equal transformers' through swaps, fused path on CUDA) is
test_torch_engine.py's gpu test.
"""

from __future__ import annotations

import os

import pytest
import torch

from pool.engines import fused
from pool.engines.base import GenRequest, SamplingParams
from pool.engines.forward import Decoder
from pool.engines.kvstore import decode_inputs, prefill_inputs
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
from pool.engines.weights import HostWeightCache

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and fused.AVAILABLE), reason="needs CUDA and Triton")])]
DEVICES.append(pytest.param("cpu", marks=pytest.mark.skipif(
    not (fused.AVAILABLE and INTERPRET), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_fused_decode_matches_torch_and_ignores_nan_tails(device, dtype, block_size, model, demo_models):
    _check_fused_decode(device, dtype, block_size, model, demo_models, [5, 17, 40])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sms", [8, 12])
def test_fused_decode_shares_each_requests_tiles_over_the_splits(device, dtype, sms, demo_models, monkeypatch):
    """A short request beside a long one (which sets the table width and so the splits): each request's own
    tiles are spread over every split (2 or 3 here), uneven shares and empty splits included."""
    monkeypatch.setattr(fused, "_sm_count", lambda _device: sms)
    assert fused.split_plan(4, 2, 24, 16, torch.device(device)) == (2 if sms == 8 else 3)
    _check_fused_decode(device, dtype, 16, "tiny-qwen3", demo_models, [5, 130, 300])


def _check_fused_decode(device, dtype, block_size, model, demo_models, lengths):
    engine = TorchEngine(TorchEngineConfig(device=device, dtype=dtype, block_size=block_size, cuda_graphs=False),
                         weight_cache=HostWeightCache())
    engine.load(model, demo_models[model])
    engine.activate(model)
    gen = torch.Generator().manual_seed(block_size)
    requests = [GenRequest(f"r{i}", model, torch.randint(0, 500, (n,), generator=gen).tolist(),
                           SamplingParams(max_tokens=8, ignore_eos=True)) for i, n in enumerate(lengths)]
    engine.prefill(requests)
    store, seqs = engine.residency.kv_store(), [engine.seqs[r.request_id] for r in requests]
    kvs = [s.kv for s in seqs]
    store.grow(kvs, [len(s.tokens) for s in seqs])
    for seq in seqs:  # NaN in every unused tail slot (what bytes of another shape can read as)
        used = len(seq.tokens) % block_size
        if used:
            store.device.block(seq.kv.shape, seq.kv.blocks[-1])[:, :, :, used:] = float("nan")
    max_blocks = max(len(kv.blocks) for kv in kvs) + 2  # padded columns, as under CUDA graphs
    inputs = decode_inputs([s.tokens[-1] for s in seqs], kvs, [len(s.tokens) - 1 for s in seqs],
                           engine.device, 4, max_blocks, store.scratch(seqs[0].kv.shape))
    ref = engine.residency.decoder(seqs[0].model)
    where = engine.residency.slots.placement(seqs[0].model.name)
    views = seqs[0].model.image.views(engine.residency.slots.region[where.offset:])
    got = Decoder(ref.spec, views, ref.kv, fused=True).decode(inputs)[:3]
    assert not torch.isnan(got).any()
    ref.kv.nan_to_num_(0.0)  # the torch path reads the tails (weight 0): clean them for the reference
    want = Decoder(ref.spec, views, ref.kv, fused=False).decode(inputs)[:3]
    rel = ((got - want).norm() / want.norm()).item()
    bound = 1e-5 if dtype == "float32" else (4e-2 if device == "cpu" else 2e-2)
    assert rel < bound, rel
    if dtype == "float32":
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_fused_prefill_matches_torch_logits_and_kv(device, dtype, model, demo_models):
    """The fused prefill (decode's kernels, keys out for flash attention) against the torch ops: the logits at
    each request's last token and every K/V row it writes, for a batch of three prompts over several blocks."""
    engine = TorchEngine(TorchEngineConfig(device=device, dtype=dtype, block_size=8, cuda_graphs=False),
                         weight_cache=HostWeightCache())
    engine.load(model, demo_models[model])
    engine.activate(model)
    gen = torch.Generator().manual_seed(3)
    requests = [GenRequest(f"r{i}", model, torch.randint(0, 500, (n,), generator=gen).tolist(),
                           SamplingParams(max_tokens=8, ignore_eos=True)) for i, n in enumerate([5, 17, 40])]
    engine.prefill(requests)  # admits them: KV blocks assigned
    seqs = [engine.seqs[r.request_id] for r in requests]
    inputs = prefill_inputs([r.prompt_token_ids for r in requests], [s.kv for s in seqs], engine.device)
    ref = engine.residency.decoder(seqs[0].model)
    where = engine.residency.slots.placement(seqs[0].model.name)
    views = seqs[0].model.image.views(engine.residency.slots.region[where.offset:])
    ref.kv.zero_()
    got = Decoder(ref.spec, views, ref.kv, fused=True).prefill(inputs)
    kv_got = ref.kv.clone()
    ref.kv.zero_()
    want = Decoder(ref.spec, views, ref.kv, fused=False).prefill(inputs)
    assert got.shape == want.shape == (3, ref.spec.vocab_size)
    assert ref.kv.abs().sum() > 0  # the reference wrote K/V, so the comparison below compares something
    bound = 1e-5 if dtype == "float32" else (4e-2 if device == "cpu" else 2e-2)
    for a, b in ((got, want), (kv_got.float(), ref.kv.float())):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < bound, rel
    if dtype == "float32":
        assert torch.equal(got.argmax(-1), want.argmax(-1))
