"""The swap-native torch engine on CPU: token-for-token against transformers, through preemption and swaps.

Exactness tests run in float32 (engine and reference): bf16 rounding differs
between a fused and an unfused matmul, and random-weight models have close
logits, so bf16 greedy paths may part after a few tokens without either side
being wrong. The real-text check runs in the checkpoint's bf16.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from pool.engines.base import EngineError, GenRequest, OutOfKvMemory, SamplingParams, TokenOut
from pool.engines.device import BumpAllocator
from pool.engines import step, torch_engine, warmup
from pool.engines.kv import KvShape, device_pool, row_view
from pool.engines.kvstore import padded_prefill_tokens, prefill_inputs, prefill_token_buckets
from pool.engines.sampling import OutputText
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
from pool.engines.weights import HostWeightCache

TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
PROMPTS = (
    "The capital of France is",
    "Once upon a time a lighthouse keeper",
    "def add(a, b):",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256",
    "x",
)
REPO = Path(__file__).resolve().parents[2]
WEIGHTS = HostWeightCache()  # one host copy per model for the whole module, as in a node


def make_engine(demo_models: dict[str, Path], names=TINY, **config) -> TorchEngine:
    config.setdefault("dtype", "float32")
    config.setdefault("async_decode", True)  # the default on CUDA; on CPU it only runs the same logic
    engine = TorchEngine(TorchEngineConfig(**config), weight_cache=WEIGHTS)
    for name in names:
        engine.load(name, demo_models[name])
    return engine


def prompt_ids(engine: TorchEngine, model: str, prompts=PROMPTS) -> list[list[int]]:
    return [engine.tokenizer(model)(p)["input_ids"] for p in prompts]


def run(engine: TorchEngine, requests: list[GenRequest]) -> dict[str, list[TokenOut]]:
    """Prefill then decode all requests together until each finishes."""
    engine.activate(requests[0].model)
    outs: dict[str, list[TokenOut]] = {r.request_id: [] for r in requests}
    for out in engine.prefill(requests):
        outs[out.request_id].append(out)
    live = [rid for rid, got in outs.items() if not got[-1].finished]
    while live:
        for out in engine.decode_step(live):
            outs[out.request_id].append(out)
        live = [rid for rid in live if not outs[rid][-1].finished]
    return outs


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def ids_of(outs: list[TokenOut]) -> list[int]:
    return [o.token_id for o in outs]


def text_of(outs: list[TokenOut]) -> str:
    return "".join(o.text for o in outs)


@functools.cache
def hf_greedy(folder: Path, prompt: tuple[int, ...], new_tokens: int, ignore_eos: bool) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _hf_model(folder)
    extra = {"min_new_tokens": new_tokens} if ignore_eos else {}
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, **extra)
    return out[0, len(prompt):].tolist()


@functools.cache
def _hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ---- exactness against transformers ------------------------------------------------------------
@pytest.mark.parametrize("model", [*TINY, "smollm2-135m"])
def test_greedy_tokens_equal_transformers_generate(model, demo_models, request):
    if model not in demo_models:
        request.getfixturevalue("smollm2")  # skips with the reason
    engine = make_engine(demo_models, [model])
    real = model == "smollm2-135m"
    new_tokens = 24
    if real:
        tok = engine.tokenizer(model)
        ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for p in PROMPTS]
    else:
        ids = prompt_ids(engine, model)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=not real)
    outs = run(engine, [GenRequest(f"r{i}", model, p, params) for i, p in enumerate(ids)])
    for i, prompt in enumerate(ids):
        assert ids_of(outs[f"r{i}"]) == hf_greedy(demo_models[model], tuple(prompt), new_tokens, not real), i


def test_smollm2_answers_paris_in_bf16(smollm2):
    engine = TorchEngine(TorchEngineConfig(), weight_cache=HostWeightCache())  # the checkpoint's bf16
    engine.load("smollm2", smollm2)
    tok = engine.tokenizer("smollm2")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    outs = run(engine, [GenRequest("q", "smollm2", ids, SamplingParams(max_tokens=32))])["q"]
    assert "Paris" in text_of(outs)
    assert outs[-1].finish_reason == "stop" and len(outs) < 32  # ended on EOS
    assert engine.stats().num_requests == 0


# ---- preemption: three models, one engine, KV to host and back --------------------------------
def run_preempted(engine: TorchEngine, requests: dict[str, list[GenRequest]], k: int, n: int) -> dict[str, list[int]]:
    """Round-robin turns of k decode steps per model; KV to host between turns (but tiny-qwen3's stays)."""
    outs: dict[str, list[int]] = {r.request_id: [] for reqs in requests.values() for r in reqs}
    models, started, turn = list(requests), set(), 0
    while any(len(v) < n for v in outs.values()):
        model, after = models[turn % len(models)], models[(turn + 1) % len(models)]
        turn += 1
        live = [r.request_id for r in requests[model] if len(outs[r.request_id]) < n]
        if not live:
            continue
        engine.activate(model)
        engine.prefetch(after)  # the next turn's switch only swaps slot roles
        if model not in started:
            started.add(model)
            for out in engine.prefill(requests[model]):
                outs[out.request_id].append(out.token_id)
        else:
            engine.restore_kv(live)  # a no-op for requests whose KV stayed on the device
        for _ in range(k):
            live = [rid for rid in live if len(outs[rid]) < n]
            if live:
                for out in engine.decode_step(live):
                    outs[out.request_id].append(out.token_id)
        if model != "tiny-qwen3":
            engine.save_kv([rid for rid in live if len(outs[rid]) < n])
    return outs


def tiny_requests(engine: TorchEngine, n: int) -> dict[str, list[GenRequest]]:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    return {m: [GenRequest(f"{m}/{i}", m, p, params) for i, p in enumerate(prompt_ids(engine, m)[:3])] for m in TINY}


@pytest.mark.parametrize("k", [1, 3, 7])
def test_preempting_every_k_tokens_changes_nothing(k, demo_models):
    slab = 128 * 1024
    engine = make_engine(demo_models, kv_bytes=6 * slab, device_slab_bytes=slab, host_slab_bytes=slab)
    requests = tiny_requests(engine, 20)
    expected = {rid: ids_of(o) for m in TINY for rid, o in run(engine, requests[m]).items()}
    assert run_preempted(engine, requests, k, 20) == expected
    stats = engine.stats()
    assert stats.num_requests == 0 and stats.kv_device_used_bytes == 0 and stats.kv_host_used_bytes == 0
    assert stats.bytes_d2h > 0 and stats.prefetched_model is not None


def test_warm_prefill_leaves_no_request_and_changes_no_token(demo_models):
    """warm_up's prefill of warm_prefill_tokens per shape (allocator blocks for any prefill the pool sends) writes
    only the scratch block: no request, no KV block held, the same tokens after it."""
    requests = tiny_requests(make_engine(demo_models), 12)
    want = {rid: ids_of(o) for m in TINY for rid, o in run(make_engine(demo_models), requests[m]).items()}
    engine = make_engine(demo_models, warm_prefill_tokens=96)
    engine.warm_up()
    stats = engine.stats()
    shapes = {m.kv_shape for m in engine.residency.models.values()}
    assert set(engine.residency.kv_store()._scratch) == shapes  # a scratch block per shape, as the decode graphs' padded rows use
    assert stats.num_requests == 0 and stats.kv_device_used_bytes == sum(shape.block_bytes for shape in shapes)
    assert {rid: ids_of(o) for m in TINY for rid, o in run(engine, requests[m]).items()} == want
    with pytest.raises(ValueError, match="warm_prefill_tokens"):
        TorchEngineConfig(warm_prefill_tokens=-1)


def test_padded_prefill_changes_no_token_and_warms_every_bucket(demo_models, monkeypatch):
    """Prefills padded to their bucket (the CUDA default) give the same tokens as unpadded ones, batches of
    several prompts included, the padding written only to the scratch block; warm_up runs each bucket up to
    warm_prefill_tokens once per shape."""
    requests = tiny_requests(make_engine(demo_models), 12)
    plain = make_engine(demo_models, pad_prefill=False)
    want = {rid: ids_of(o) for m in TINY for rid, o in run(plain, requests[m]).items()}
    assert not make_engine(demo_models, names=()).pads_prefill  # the CPU default: no padding
    engine = make_engine(demo_models, pad_prefill=True, warm_prefill_tokens=150)
    seen: list[int] = []  # every prefill's token count as the decoders get it

    def spy(*args, **kwargs):
        inputs = prefill_inputs(*args, **kwargs)
        seen.append(len(inputs.token_ids))
        return inputs

    for module in (step, warmup):  # the engine's prefills (Stepper) and its warm-up's (GraphSet)
        monkeypatch.setattr(module, "prefill_inputs", spy)
    engine.warm_up()
    shapes = {(m.image.spec, m.image.dtype) for m in engine.residency.models.values()}
    assert sorted(seen) == sorted(prefill_token_buckets(150) * len(shapes))  # 16, 32, ..., 160 per shape
    seen.clear()
    assert {rid: ids_of(o) for m in TINY for rid, o in run(engine, requests[m]).items()} == want
    prompts = {m: sum(len(r.prompt_token_ids) for r in reqs) for m, reqs in requests.items()}
    assert sorted(seen) == sorted(padded_prefill_tokens(n) for n in prompts.values())  # a prefill per model
    assert any(padded_prefill_tokens(n) > n for n in prompts.values())  # some padded
    stats, scratch = engine.stats(), engine.residency.kv_store()._scratch
    assert stats.num_requests == 0 and stats.kv_device_used_bytes == sum(shape.block_bytes for shape in scratch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_engine_matches_transformers_through_swaps(graphs, demo_models):
    from transformers import AutoModelForCausalLM

    slab = 128 * 1024
    engine = make_engine(demo_models, device="cuda", cuda_graphs=graphs, kv_bytes=6 * slab, device_slab_bytes=slab,
                         host_slab_bytes=slab)
    captured = engine.warm_up()  # every graph before serving: none is captured on the request path
    assert (captured > 0) == graphs
    requests = tiny_requests(engine, 20)
    expected = {}
    for model, reqs in requests.items():
        hf = AutoModelForCausalLM.from_pretrained(demo_models[model], dtype=torch.float32).cuda().eval()
        for r in reqs:
            prompt = torch.tensor([r.prompt_token_ids], device="cuda")
            out = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
            expected[r.request_id] = out[0, prompt.shape[1]:].tolist()
    assert run_preempted(engine, requests, 3, 20) == expected
    extra = engine.stats().extra
    assert extra["graph_captures"] == captured and extra["graph_misses"] == 0
    assert (extra["graph_replays"] > 0) == graphs
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    ids = prompt_ids(engine, "tiny-llama")
    first = run(engine, [GenRequest("s1", "tiny-llama", ids[0], seeded)])["s1"]
    batch = run(engine, [GenRequest(f"s2-{i}", "tiny-llama", p, seeded) for i, p in enumerate(ids)])["s2-0"]
    assert ids_of(first) == ids_of(batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_of_more_requests_than_any_graph_runs_eagerly_and_is_counted(demo_models):
    """A batch past the largest captured size runs eagerly (same tokens) and shows as a graph miss."""
    slab = 128 * 1024
    sizes = dict(device="cuda", kv_bytes=6 * slab, device_slab_bytes=slab, host_slab_bytes=slab)
    eager, small = make_engine(demo_models, cuda_graphs=False, **sizes), make_engine(demo_models, **sizes,
                                                                                      graph_batch_sizes=(1, 2))
    assert small.warm_up() > 0
    for reqs in tiny_requests(small, 12).values():  # 3 requests a model: past (1, 2)
        assert {r: ids_of(o) for r, o in run(small, reqs).items()} == {r: ids_of(o) for r, o in run(eager, reqs).items()}
    extra = small.stats().extra
    assert extra["graph_misses"] >= 3 * 11 and extra["graph_replays"] == 0, extra


def test_mistral_matches_transformers_and_refuses_beyond_its_window(tmp_path):
    from transformers import AutoModelForCausalLM, MistralConfig

    from pool.demo import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(1)
    config = MistralConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, sliding_window=48, initializer_range=0.05)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = TorchEngine(TorchEngineConfig(dtype="float32"), weight_cache=HostWeightCache())
    engine.load("mistral", tmp_path)
    prompt = tok("What is two plus two?")["input_ids"]
    got = ids_of(run(engine, [GenRequest("m", "mistral", prompt, greedy(16))])["m"])
    assert got == hf_greedy(tmp_path, tuple(prompt), 16, True)
    with pytest.raises(EngineError, match="sliding-window"):
        engine.prefill([GenRequest("long", "mistral", prompt * 8, greedy(16))])


# ---- sampling and stopping -----------------------------------------------------------------------
def test_stop_string_is_cut_and_never_streamed(demo_models):
    engine = make_engine(demo_models, ["tiny-llama"])
    ids = prompt_ids(engine, "tiny-llama")[1]
    full = text_of(run(engine, [GenRequest("a", "tiny-llama", ids, greedy(24))])["a"])
    stop = full[12:16]
    assert len(full) > 20 and stop.strip()
    outs = run(engine, [GenRequest("b", "tiny-llama", ids, SamplingParams(max_tokens=24, ignore_eos=True,
                                                                      stop=[stop, "never-there"]))])["b"]
    assert text_of(outs) == full[: full.find(stop)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert all(stop not in o.text for o in outs)


def test_max_tokens_stop_tokens_and_eos(demo_models):
    engine = make_engine(demo_models, ["tiny-qwen2"])
    ids = prompt_ids(engine, "tiny-qwen2")[0]
    plain = ids_of(run(engine, [GenRequest("g", "tiny-qwen2", ids, greedy(12))])["g"])
    assert len(plain) == 12

    one = engine.prefill([GenRequest("one", "tiny-qwen2", ids, SamplingParams(max_tokens=1))])
    assert one[0].finished and one[0].finish_reason == "length" and engine.stats().num_requests == 0

    marker = plain[5]
    cut = plain.index(marker) + 1
    by_id = run(engine, [GenRequest("s", "tiny-qwen2", ids, SamplingParams(max_tokens=12, stop_token_ids=[marker]))])
    assert ids_of(by_id["s"]) == plain[:cut] and by_id["s"][-1].finish_reason == "stop"

    eos_engine = TorchEngine(TorchEngineConfig(dtype="float32"), weight_cache=WEIGHTS)
    image = WEIGHTS.load("tiny-qwen2", demo_models["tiny-qwen2"], torch.float32)
    eos_engine.add_image(image, engine.tokenizer("tiny-qwen2"), eos_ids=[marker])
    eos = run(eos_engine, [GenRequest("e", "tiny-qwen2", ids, SamplingParams(max_tokens=12))])["e"]
    assert ids_of(eos) == plain[:cut] and eos[-1].finish_reason == "stop"
    ignored = run(eos_engine, [GenRequest("i", "tiny-qwen2", ids, SamplingParams(max_tokens=12, ignore_eos=True))])
    assert ids_of(ignored["i"]) == plain and ignored["i"][-1].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(demo_models):
    engine = make_engine(demo_models, ["tiny-llama"])
    ids = prompt_ids(engine, "tiny-llama")

    def sampled(seed: int, batch: int, **kw) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True, **kw)
        reqs = [GenRequest(f"s{seed}-{i}", "tiny-llama", ids[i], params) for i in range(batch)]
        return ids_of(run(engine, reqs)[f"s{seed}-0"])

    assert sampled(7, 1) == sampled(7, 1) == sampled(7, 4)
    assert sampled(7, 1) != sampled(8, 1)
    plain = ids_of(run(engine, [GenRequest("g", "tiny-llama", ids[0], greedy(16))])["g"])
    assert sampled(3, 1, top_k=1) == plain
    assert sampled(3, 1, top_p=1e-6) == plain
    penalised = SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.5)
    assert len(set(ids_of(run(engine, [GenRequest("p", "tiny-llama", ids[0], penalised)])["p"]))) >= len(set(plain))


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("params", [greedy(20), SEEDED], ids=["greedy", "seeded"])
def test_resume_from_produced_tokens_after_kv_loss(params, demo_models):
    engine = make_engine(demo_models, ["tiny-qwen3"])
    ids = prompt_ids(engine, "tiny-qwen3")[2]
    full = run(engine, [GenRequest("full", "tiny-qwen3", ids, params)])["full"]
    tokens = ids_of(full)
    resumed = run(engine, [GenRequest("again", "tiny-qwen3", ids, params, output_token_ids=tokens[:8])])["again"]
    assert ids_of(resumed) == tokens[8:]
    assert text_of(full[:8]) + text_of(resumed) == text_of(full)


# ---- KV accounting ----------------------------------------------------------------------------------
def test_kv_blocks_are_accounted_freed_and_host_slabs_reused(demo_models):
    slab = 64 * 1024
    engine = make_engine(demo_models, ["tiny-llama"], kv_bytes=8 * slab, device_slab_bytes=slab, host_slab_bytes=slab)
    ids = prompt_ids(engine, "tiny-llama")
    engine.activate("tiny-llama")
    reqs = [GenRequest(f"r{i}", "tiny-llama", p, SamplingParams(max_tokens=30, ignore_eos=True))
            for i, p in enumerate(ids[:3])]
    engine.prefill(reqs)
    block_bytes = 2 * 2 * 2 * 16 * 64 * 4  # layers, k/v, kv heads, tokens, head_dim, float32
    used = sum(-(-len(p) // 16) for p in ids[:3]) * block_bytes
    assert engine.stats().kv_device_used_bytes == used
    made = None
    for _ in range(3):
        engine.save_kv(["r0", "r1", "r2"])
        stats = engine.stats()
        assert (stats.kv_device_used_bytes, stats.kv_host_used_bytes) == (0, used)
        made = made or stats.kv_host_bytes
        assert stats.kv_host_bytes == made  # the same slabs, reused
        with pytest.raises(EngineError, match="restore_kv"):
            engine.decode_step(["r0"])
        engine.restore_kv(["r0", "r1", "r2"])
        assert (engine.stats().kv_device_used_bytes, engine.stats().kv_host_used_bytes) == (used, 0)
        engine.decode_step(["r0", "r1", "r2"])
    engine.release(["r0", "r1", "r2", "unknown"])
    stats = engine.stats()
    assert (stats.kv_device_used_bytes, stats.kv_host_used_bytes, stats.num_requests) == (0, 0, 0)


def test_out_of_kv_memory_changes_nothing(demo_models):
    slab = 64 * 1024  # 2 blocks of tiny-llama in float32
    engine = make_engine(demo_models, ["tiny-llama"], kv_bytes=slab, device_slab_bytes=slab)
    engine.activate("tiny-llama")
    short, long_ = [1, 2, 3], list(range(1, 40))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with pytest.raises(OutOfKvMemory):
        engine.prefill([GenRequest("a", "tiny-llama", short, params), GenRequest("b", "tiny-llama", long_, params)])
    assert engine.stats().kv_device_used_bytes == 0 and engine.stats().num_requests == 0
    engine.prefill([GenRequest("a", "tiny-llama", short, params)])
    assert engine.stats().num_requests == 1


def test_engine_refuses_calls_out_of_order(demo_models):
    engine = make_engine(demo_models, ["tiny-llama", "tiny-qwen2"])
    req = GenRequest("r", "tiny-llama", [5, 6, 7], SamplingParams(max_tokens=8))
    with pytest.raises(EngineError, match="not resident"):
        engine.prefill([req])
    with pytest.raises(EngineError, match="not loaded"):
        engine.activate("nope")
    engine.activate("tiny-llama")
    engine.prefill([req])
    with pytest.raises(EngineError, match="already"):
        engine.prefill([req])
    engine.activate("tiny-qwen2")
    with pytest.raises(EngineError, match="not resident"):
        engine.decode_step(["r"])
    with pytest.raises(EngineError, match="unknown request"):
        engine.decode_step(["ghost"])


# ---- weights and slots --------------------------------------------------------------------------------
def test_host_weight_cache_holds_one_contiguous_image(demo_models):
    cache = HostWeightCache()
    image = cache.load("tiny-qwen2", demo_models["tiny-qwen2"])
    assert cache.load("tiny-qwen2", demo_models["tiny-qwen2"]) is image and image.dtype == torch.bfloat16
    start, end = image.buffer.data_ptr(), image.buffer.data_ptr() + image.nbytes
    assert all(start <= v.data_ptr() < end for v in image.views().values())
    assert cache.total_bytes == image.nbytes


def test_prefetched_or_resident_models_switch_without_copying(demo_models):
    engine = make_engine(demo_models)
    sizes = {m: WEIGHTS.load(m, demo_models[m], torch.float32).nbytes for m in TINY}
    engine.activate("tiny-llama")
    engine.prefetch("tiny-qwen2")
    moved = engine.stats().bytes_h2d
    assert moved == sizes["tiny-llama"] + sizes["tiny-qwen2"]
    engine.activate("tiny-qwen2")
    engine.activate("tiny-llama")  # still in the other slot
    assert engine.stats().bytes_h2d == moved and engine.stats().num_switches == 3
    engine.activate("tiny-qwen3")  # overwrites the spare slot (tiny-qwen2)
    assert engine.stats().bytes_h2d == moved + sizes["tiny-qwen3"]
    assert set(engine.stats().extra["weights_on_device"]) == {"tiny-llama", "tiny-qwen3"}
    assert engine.stats().resident_models == ("tiny-qwen3",) and engine.stats().prefetched_model == "tiny-llama"
    small = make_engine(demo_models, ["tiny-llama"], max_model_bytes=1024)
    with pytest.raises(EngineError, match="max_model_bytes"):
        small.activate("tiny-llama")


# ---- allocators and text, in isolation ---------------------------------------------------------------
@given(st.lists(st.integers(0, 5000), max_size=30), st.integers(0, 40_000))
def test_bump_allocator_regions_never_overlap(sizes, capacity):
    bump = BumpAllocator(capacity, align=256)
    regions = []
    for i, size in enumerate(sizes):
        try:
            regions.append(bump.alloc(f"r{i}", size))
        except MemoryError:
            assert bump.used_bytes + size > capacity - 255
    for i, a in enumerate(regions):
        assert a.offset % 256 == 0 and a.end <= capacity
        assert not any(a.overlaps(b) for b in regions[i + 1:] if a.nbytes and b.nbytes)
    bump.reset(1)
    assert bump.regions == tuple(regions[:1]) and bump.used_bytes == (regions[0].end if regions else 0)


SHAPES = (KvShape(2, 2, 64, 16, torch.float32), KvShape(3, 1, 48, 16, torch.bfloat16))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 1), st.integers(1, 9)), max_size=40))
def test_slab_pool_blocks_never_overlap_and_slabs_hold_one_shape(ops):
    slab_bytes = 3 * SHAPES[0].block_bytes + 100  # not a multiple of any row: slabs pad their start
    pool = device_pool(torch.zeros(5 * slab_bytes, dtype=torch.uint8), slab_bytes)
    live: list[tuple[KvShape, list]] = []
    for do_alloc, which, n in ops:
        if do_alloc or not live:
            try:
                live.append((SHAPES[which], pool.allocate(SHAPES[which], n)))
            except OutOfKvMemory:
                pass
        else:
            shape, blocks = live.pop(n % len(live))
            pool.free(shape, blocks)
        spans = sorted((pool.first_row(s, b) * s.row_bytes, s.block_bytes, b.slab, s)
                       for s, blocks in live for b in blocks)
        assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert all(slab * slab_bytes <= off and off + size <= (slab + 1) * slab_bytes for off, size, slab, _ in spans)
        assert len({(slab, s) for _, _, slab, s in spans}) == len({slab for _, _, slab, _ in spans})
        assert pool.used_bytes() == sum(size for _, size, _, _ in spans)


def test_row_view_addresses_the_same_bytes_as_block_views():
    shape = SHAPES[1]
    slab_bytes = 4 * shape.block_bytes + 512
    region = torch.zeros(3 * slab_bytes, dtype=torch.uint8)
    pool = device_pool(region, slab_bytes)
    pool.allocate(SHAPES[0], 1)  # slab 0 takes the other shape
    blocks = pool.allocate(shape, 6)
    for n, ref in enumerate(blocks):
        block = pool.block(shape, ref)  # [L, 2, kvh, bs, hd]
        for layer, kind, head in [(0, 0, 0), (2, 1, 0), (1, 0, 0)]:
            block[layer, kind, head] = 100 * n + 10 * layer + kind
    view = row_view(region, shape)
    for n, ref in enumerate(blocks):
        first = pool.first_row(shape, ref)
        for layer, kind, head in [(0, 0, 0), (2, 1, 0), (1, 0, 0)]:
            row = first + (2 * layer + kind) * shape.num_kv_heads + head
            assert ref.slab > 0 and bool((view[row] == 100 * n + 10 * layer + kind).all())


class _CharTokenizer:
    """token id = one UTF-8 byte; decoding replaces incomplete characters, like byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stop=(), finish_at=None) -> list[str]:
    out = OutputText(_CharTokenizer(), stop)
    deltas = []
    for n, byte in enumerate(text.encode()):
        hit = out.push(byte)
        done = hit or n + 1 == finish_at
        deltas.append(out.take_delta(done))
        if done:
            break
    return deltas


def test_output_text_holds_back_possible_stop_strings_and_split_characters():
    deltas = _stream("hello world, bye", stop=["world"])
    assert "".join(deltas) == "hello " and deltas[-1] == ""
    assert all("w" not in d for d in deltas)
    assert "".join(_stream("naïve café")) == "naïve café"
    assert "\ufffd" not in "".join(_stream("naïve café"))
    assert "".join(_stream("say wo", stop=["world"], finish_at=6)) == "say wo"  # flushed at the end


# ---- benchmark ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gpu_benchmark_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_engine.py"), "--tiny", "--batches", "1", "4",
                           "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["models"]
    for model in result["models"].values():
        assert model["switch_s"] > 0 and model["decode"]


def test_decode_mix_benchmark_runs_tiny_on_cpu():
    """benchmarks/decode_mix.py's table on tiny shapes: per shape and batch, the mixed lengths' mean and longest, a
    one-length and a mixed step (synchronised and queued) and the cost model's step."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decode_mix.py"), "--device", "cpu", "--quick",
                           "--batches", "2,4", "--steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("tiny-")]
    assert [(r[0], int(r[1])) for r in rows] == [(s, b) for s in ("tiny-qwen2-a", "tiny-llama-a") for b in (2, 4)]
    for row in rows:
        mean, longest = int(row[2]), int(row[3])
        one, mixed, ratio = float(row[4].rstrip("m")), float(row[5].rstrip("m")), float(row[6])
        assert 4 <= mean <= longest and one > 0 and mixed > 0 and ratio == pytest.approx(mixed / one, abs=0.01)
        assert all(float(cell.rstrip("m")) > 0 for cell in row[7:10])
