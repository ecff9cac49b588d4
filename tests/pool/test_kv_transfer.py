"""Requests moving between engines (`export_kv` -> `import_kv`): token-for-token the same as staying put.

Each engine here is a separate `TorchEngine` with its own device buffer and
host KV pool (as two instances would be); only the host weight cache is
shared, as it is within one node. All in float32, as in test_torch_engine.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from pool.engines.base import EngineError, GenRequest, KvExport, OutOfKvMemory, SamplingParams, TokenOut
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
from pool.engines.weights import HostWeightCache

MODEL = "tiny-llama"
PROMPTS = ("Once upon a time a lighthouse keeper", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256", "x")
WEIGHTS = HostWeightCache()
SLAB = 64 * 1024
BLOCK_BYTES = 2 * 2 * 2 * 16 * 64 * 4  # tiny-llama: layers, k/v, kv heads, 16 tokens, head_dim, float32


def make_engine(demo_models: dict[str, Path], names=(MODEL,), **config) -> TorchEngine:
    config.setdefault("dtype", "float32")
    config.setdefault("kv_bytes", 16 * SLAB)
    config.setdefault("device_slab_bytes", SLAB)
    config.setdefault("host_slab_bytes", SLAB)
    engine = TorchEngine(TorchEngineConfig(**config), weight_cache=WEIGHTS)
    for name in names:
        engine.load(name, demo_models[name])
    return engine


def ids(engine: TorchEngine, prompt: str) -> list[int]:
    return engine.tokenizer(MODEL)(prompt)["input_ids"]


def run(engine: TorchEngine, requests: list[GenRequest]) -> dict[str, list[TokenOut]]:
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


def tokens(outs: list[TokenOut]) -> list[int]:
    return [o.token_id for o in outs]


def text(outs: list[TokenOut]) -> str:
    return "".join(o.text for o in outs)


def kv_used(engine: TorchEngine) -> tuple[int, int, int]:
    s = engine.stats()
    return s.kv_device_used_bytes, s.kv_host_used_bytes, s.num_requests


def move(src: TorchEngine, dst: TorchEngine, rids: list[str], pickled: bool = True) -> list[KvExport]:
    exports = src.export_kv(rids)
    if pickled:
        exports = pickle.loads(pickle.dumps(exports))
    dst.import_kv(exports)
    return exports


def decode_all(engine: TorchEngine, rids: list[str], outs: dict[str, list[TokenOut]], steps: int | None = None) -> None:
    """Decode the live ones of `rids` for `steps` steps (or until all finish)."""
    live = [rid for rid in rids if not outs[rid][-1].finished]
    while live and steps != 0:
        for out in engine.decode_step(live):
            outs[out.request_id].append(out)
        live = [rid for rid in live if not outs[rid][-1].finished]
        steps = None if steps is None else steps - 1


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)
PENALISED = SamplingParams(temperature=0.7, top_k=20, seed=3, repetition_penalty=1.3, max_tokens=24, ignore_eos=True)


# ---- prefill on A, decode on B -------------------------------------------------------------------------
def prefilled_on_a(demo_models, params: SamplingParams, block_b: int, **a_config):
    """Engine A (`a_config`) with PROMPTS prefilled, an engine B of `block_b`-token blocks, and what one engine
    alone produces: (a, b, prompts' token ids, expected outputs, A's first tokens by request id)."""
    a = make_engine(demo_models, **a_config)
    b = make_engine(demo_models, block_size=block_b)
    prompts = [ids(a, p) for p in PROMPTS]
    requests = [GenRequest(f"r{i}", MODEL, p, params) for i, p in enumerate(prompts)]
    expected = run(make_engine(demo_models), requests)
    a.activate(MODEL)
    return a, b, prompts, expected, {o.request_id: [o] for o in a.prefill(requests)}


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALISED], ids=["greedy", "seeded", "penalised"])
@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("block_b", [16, 8])
def test_prefill_on_a_decode_on_b_equals_one_engine(params, where, block_b, demo_models):
    a, b, prompts, expected, outs = prefilled_on_a(demo_models, params, block_b)
    rids = list(outs)
    if where == "host":
        a.save_kv(rids)
    move(a, b, rids)
    assert kv_used(a) == (0, 0, 0)
    assert kv_used(b)[1:] == (sum(-(-len(p) // block_b) for p in prompts) * BLOCK_BYTES * block_b // 16, 3)
    b.activate(MODEL)
    with pytest.raises(EngineError, match="restore_kv"):
        b.decode_step(rids)
    b.restore_kv(rids)
    decode_all(b, rids, outs)
    for rid in rids:
        assert tokens(outs[rid]) == tokens(expected[rid]), rid
        assert text(outs[rid]) == text(expected[rid])
        assert outs[rid][-1].finish_reason == "length"
    assert kv_used(b) == (0, 0, 0)


def test_unseeded_request_keeps_its_drawn_seed(demo_models):
    a, b = make_engine(demo_models), make_engine(demo_models)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)  # seed drawn at admission
    prompt = ids(a, PROMPTS[0])
    a.activate(MODEL)
    first = a.prefill([GenRequest("u", MODEL, prompt, params)])
    export = move(a, b, ["u"])[0]
    b.activate(MODEL)
    b.restore_kv(["u"])
    outs = {"u": first}
    decode_all(b, ["u"], outs)
    # replaying with the seed it drew reproduces every token
    replay = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=export.seed)
    assert tokens(outs["u"]) == tokens(run(a, [GenRequest("v", MODEL, prompt, replay)])["v"])


# ---- moving back and forth --------------------------------------------------------------------------------
def test_a_to_b_to_a_through_a_relay_that_never_runs(demo_models):
    a = make_engine(demo_models)
    relay = make_engine(demo_models, block_size=4)  # never activated: holds host KV only
    prompt = ids(a, PROMPTS[1])
    req = GenRequest("r", MODEL, prompt, SEEDED)
    expected = run(make_engine(demo_models), [req])["r"]
    a.activate(MODEL)
    outs = {"r": a.prefill([req])}
    decode_all(a, ["r"], outs, steps=5)
    a.save_kv(["r"])
    move(a, relay, ["r"])
    assert kv_used(a) == (0, 0, 0) and kv_used(relay)[1:] == (BLOCK_BYTES * -(-(len(prompt) + 5) // 4) // 4, 1)
    move(relay, a, ["r"])
    assert kv_used(relay) == (0, 0, 0) and relay.stats().device_buffer_bytes == 0
    a.restore_kv(["r"])
    decode_all(a, ["r"], outs)
    assert tokens(outs["r"]) == tokens(expected) and text(outs["r"]) == text(expected)


def test_ping_pong_every_step_keeps_tokens_text_and_held_back_stop_text(demo_models):
    ref = make_engine(demo_models)
    prompt = ids(ref, PROMPTS[0])
    pieces = [o.text for o in run(ref, [GenRequest("f", MODEL, prompt, SamplingParams(max_tokens=32,
                                                                                      ignore_eos=True))])["f"]]
    full = "".join(pieces)
    # `partial` is held back whenever the text ends with a piece of it and released by the next token;
    # `stop` straddles two tokens (held back after the first) and ends the request.
    partial = pieces[7] + "\x01"
    ends = [len("".join(pieces[: k + 1])) for k in range(len(pieces))]
    k = next(k for k in range(9, len(pieces) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2
             and full.find(pieces[k][-2:] + pieces[k + 1][:2]) == ends[k] - 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    assert "\x01" not in full and len(pieces[7]) >= 2
    params = SamplingParams(max_tokens=32, ignore_eos=True, stop=[stop, partial])
    expected = run(ref, [GenRequest("s", MODEL, prompt, params)])["s"]
    assert expected[-1].finish_reason == "stop" and text(expected) == full[: full.find(stop)]

    engines = [make_engine(demo_models), make_engine(demo_models, block_size=8)]
    engines[0].activate(MODEL)
    outs = {"s": engines[0].prefill([GenRequest("s", MODEL, prompt, params)])}
    held_back, turn = 0, 0
    while not outs["s"][-1].finished:
        src, dst = engines[turn % 2], engines[(turn + 1) % 2]
        turn += 1
        if turn % 3 == 0:
            src.save_kv(["s"])  # sometimes from host memory, otherwise straight off the device
        export = move(src, dst, ["s"])[0]
        held_back += export.text_emitted < len(export.text)
        dst.activate(MODEL)
        dst.restore_kv(["s"])
        decode_all(dst, ["s"], outs, steps=1)
    assert tokens(outs["s"]) == tokens(expected) and [o.text for o in outs["s"]] == [o.text for o in expected]
    assert held_back > 0  # some moves carried text not yet streamed
    assert all(kv_used(e) == (0, 0, 0) for e in engines)


# ---- the export value ----------------------------------------------------------------------------------------
def test_export_pickles_compactly_and_frees_only_what_it_moves(demo_models):
    a, b = make_engine(demo_models), make_engine(demo_models)
    prompts = [ids(a, p) for p in PROMPTS[:2]]
    a.activate(MODEL)
    a.prefill([GenRequest(f"r{i}", MODEL, p, GREEDY) for i, p in enumerate(prompts)])
    a.save_kv(["r0"])
    blocks = [-(-len(p) // 16) for p in prompts]
    assert kv_used(a) == (blocks[1] * BLOCK_BYTES, blocks[0] * BLOCK_BYTES, 2)
    export = a.export_kv(["r0"])[0]
    assert kv_used(a) == (blocks[1] * BLOCK_BYTES, 0, 1)  # r1 untouched
    a.export_kv(["r1"])
    assert kv_used(a) == (0, 0, 0)
    with pytest.raises(EngineError, match="unknown request"):
        a.export_kv(["r0"])

    n = len(prompts[0])
    assert export.num_tokens == n and export.kv_shape == (2, 2, 2, n, 64) and export.kv_dtype == "float32"
    assert export.kv_bytes == n * BLOCK_BYTES // 16 <= blocks[0] * BLOCK_BYTES
    assert tuple(export.request.prompt_token_ids) == tuple(prompts[0]) and len(export.request.output_token_ids) == 1
    blob = pickle.dumps(export)
    assert export.kv_bytes < len(blob) < export.kv_bytes + 2048
    # protocol 5 (Ray's object store): the KV goes out of band as one buffer, the rest is small
    buffers: list[pickle.PickleBuffer] = []
    small = pickle.dumps(export, protocol=5, buffer_callback=buffers.append)
    assert len(small) < 2048 and [b.raw().nbytes for b in buffers] == [export.kv_bytes]
    readonly = pickle.loads(small, buffers=[bytes(b.raw()) for b in buffers])  # as Ray hands it back
    assert torch.equal(readonly.kv_tensor(), export.kv_tensor())
    b.import_kv([readonly])
    assert kv_used(b) == (0, blocks[0] * BLOCK_BYTES, 1)


# ---- import errors -------------------------------------------------------------------------------------------
def _one_export(demo_models, rid="r", prompt=PROMPTS[1]) -> KvExport:
    a = make_engine(demo_models)
    a.activate(MODEL)
    a.prefill([GenRequest(rid, MODEL, ids(a, prompt), GREEDY)])
    return a.export_kv([rid])[0]


def test_import_needs_the_model_loaded_and_a_matching_shape(demo_models):
    export = _one_export(demo_models)
    other = make_engine(demo_models, names=("tiny-qwen2",))
    with pytest.raises(EngineError, match=r"'r'.*'tiny-llama'.*not loaded"):
        other.import_kv([export])
    assert kv_used(other) == (0, 0, 0)
    bf16 = TorchEngine(TorchEngineConfig(), weight_cache=WEIGHTS)  # the checkpoint's bf16
    bf16.load(MODEL, demo_models[MODEL])
    with pytest.raises(EngineError, match="does not fit"):
        bf16.import_kv([export])
    b = make_engine(demo_models)
    b.import_kv([export])
    with pytest.raises(EngineError, match="already"):
        b.import_kv([export])
    with pytest.raises(EngineError, match="duplicate"):
        make_engine(demo_models).import_kv([export, export])
    with pytest.raises(EngineError, match="duplicate"):
        b.export_kv(["r", "r"])
    assert kv_used(b)[1:] == (-(-export.num_tokens // 16) * BLOCK_BYTES, 1)


def test_import_out_of_host_memory_changes_nothing(demo_models):
    small = _one_export(demo_models, "small", PROMPTS[2])
    big = _one_export(demo_models, "big", PROMPTS[1] * 3)  # several blocks
    assert big.num_tokens > 2 * 16
    b = make_engine(demo_models, host_slab_bytes=2 * BLOCK_BYTES, max_host_kv_bytes=2 * BLOCK_BYTES)
    with pytest.raises(OutOfKvMemory):
        b.import_kv([small, big])
    assert kv_used(b) == (0, 0, 0)
    b.import_kv([small])
    assert kv_used(b) == (0, BLOCK_BYTES, 1)
    b.activate(MODEL)
    b.restore_kv(["small"])
    assert len(b.decode_step(["small"])) == 1


# ---- CUDA: copies on streams, pinned host slabs, graphs ----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_requests_move_between_engines_mid_swap(graphs, demo_models):
    config = {"device": "cuda", "cuda_graphs": graphs}
    ref = make_engine(demo_models, **config)
    params = [GREEDY, SEEDED, PENALISED]
    requests = [GenRequest(f"r{i}", MODEL, ids(ref, p), params[i]) for i, p in enumerate(PROMPTS)]
    expected = run(ref, requests)
    engines = [make_engine(demo_models, **config), make_engine(demo_models, block_size=8, **config)]
    for engine in (ref, *engines):
        engine.warm_up()
    engines[0].activate(MODEL)
    outs = {o.request_id: [o] for o in engines[0].prefill(requests)}
    rids, turn = list(outs), 0
    while live := [rid for rid in rids if not outs[rid][-1].finished]:
        src, dst = engines[turn % 2], engines[(turn + 1) % 2]
        turn += 1
        if turn % 3 == 0:
            src.save_kv(live)  # exported straight after a swap-out still in flight
        move(src, dst, live)
        dst.activate(MODEL)
        dst.restore_kv(live)
        if turn % 4 == 0:
            continue  # moved on again while its swap-in is in flight
        decode_all(dst, live, outs, steps=1)
    for rid in rids:
        assert tokens(outs[rid]) == tokens(expected[rid]), rid
    assert all(engine.stats().extra["graph_misses"] == 0 for engine in engines)
    for engine, block_size in zip(engines, (16, 8)):
        # nothing held but the block that padded graph rows and padded prefill tokens (CUDA pads prefills) write
        # to, once anything wrote there (with graphs: warm_up; eager: a padded prefill, on engines[0] only)
        scratch = BLOCK_BYTES * block_size // 16 * len(engine.residency.kv_store()._scratch)
        if graphs:
            assert len(engine.residency.kv_store()._scratch) == 1  # warm_up's captures wrote there
        assert kv_used(engine) == (scratch, 0, 0)


# ---- hand-offs staged in device memory (pool.engines.handoff) ---------------------------------------------------
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("block_b", [16, 8])
def test_staged_hand_off_lands_on_the_device_and_equals_one_engine(params, block_b, demo_models):
    a, b, prompts, expected, outs = prefilled_on_a(demo_models, params, block_b, handoff_bytes=1 << 20)
    rids = list(outs)
    exports = a.export_kv(rids)
    assert all(e.staged for e in exports)
    assert kv_used(a) == (0, 0, 0)  # out of its KV blocks at once ...
    staged = sum(e.kv_bytes for e in exports)
    assert a.stats().extra["handoff_staged_bytes"] >= staged  # ... into its arena until released
    blob = pickle.dumps(exports)
    assert len(blob) < 3 * 2048  # names a region: no KV bytes travel
    b.import_kv(pickle.loads(blob))
    blocks = sum(-(-len(p) // block_b) for p in prompts)
    assert kv_used(b) == (blocks * BLOCK_BYTES * block_b // 16, 0, 3)  # straight onto b's device
    a.release(rids)
    assert a.stats().extra["handoff_staged_bytes"] == 0
    b.activate(MODEL)
    b.restore_kv(rids)  # a no-op: already there
    decode_all(b, rids, outs)
    for rid in rids:
        assert tokens(outs[rid]) == tokens(expected[rid]), rid
        assert text(outs[rid]) == text(expected[rid])
    assert kv_used(b) == (0, 0, 0)
    timings = b.stats().extra["timings"]["kv"]
    assert timings["import_kv(device)"]["requests"] == 3 and "import_kv" not in timings


def test_a_full_arena_hands_off_through_host_memory(demo_models):
    a = make_engine(demo_models, handoff_bytes=BLOCK_BYTES)  # room for one short prompt's KV
    b = make_engine(demo_models)
    prompts = [ids(a, PROMPTS[2]), ids(a, PROMPTS[1])]
    assert len(prompts[0]) < 16 < len(prompts[1])
    a.activate(MODEL)
    a.prefill([GenRequest(f"r{i}", MODEL, p, GREEDY) for i, p in enumerate(prompts)])
    small, big = a.export_kv(["r0", "r1"])
    assert small.staged and not big.staged and isinstance(big.kv, np.ndarray)
    b.import_kv([small, big])  # one call, each its way
    assert kv_used(b) == (BLOCK_BYTES, -(-len(prompts[1]) // 16) * BLOCK_BYTES, 2)


def test_a_refused_staged_import_takes_nothing(demo_models):
    a = make_engine(demo_models, handoff_bytes=1 << 20, kv_bytes=64 * SLAB)
    b = make_engine(demo_models, kv_bytes=2 * SLAB)
    a.activate(MODEL)
    a.prefill([GenRequest("long", MODEL, ids(a, PROMPTS[1] * 8), GREEDY)])
    export = a.export_kv(["long"])[0]
    assert export.staged and export.kv_bytes > 2 * SLAB
    with pytest.raises(OutOfKvMemory):
        b.import_kv([export])
    assert kv_used(b) == (0, 0, 0)
    a.release(["long"])
    assert a.stats().extra["handoff_staged_bytes"] == 0


def _staging_child(conn, models: dict[str, Path], device: str, requests: list[GenRequest]) -> None:
    """Another process's prefill engine: prefill, export staged, then release when told (and report)."""
    a = make_engine(models, device=device, handoff_bytes=1 << 22)
    a.activate(MODEL)
    first = a.prefill(requests)
    conn.send(pickle.dumps((first, a.export_kv([r.request_id for r in requests]))))
    conn.recv()
    staged_before = a.stats().extra["handoff_staged_bytes"]
    a.release([r.request_id for r in requests])
    conn.send((staged_before, a.stats().extra["handoff_staged_bytes"]))
    conn.recv()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_hand_off_staged_in_another_process(device, demo_models):
    """The processes backend's case: the arena opened from another process (CUDA IPC; a shared-memory file on CPU)."""
    import multiprocessing as mp

    ref = make_engine(demo_models, device=device)
    requests = [GenRequest(f"r{i}", MODEL, ids(ref, p), GREEDY) for i, p in enumerate(PROMPTS)]
    expected = run(ref, requests)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_staging_child, args=(child, demo_models, device, requests), daemon=True)
    process.start()
    try:
        assert parent.poll(120), "the exporting process did not answer"
        first, exports = pickle.loads(parent.recv())
        assert all(e.staged and e.kv.arena.pid == process.pid for e in exports)
        b = make_engine(demo_models, device=device, block_size=8)
        b.import_kv(exports)
        parent.send("release")
        staged_before, staged_after = parent.recv()
        assert staged_before >= sum(e.kv_bytes for e in exports) and staged_after == 0
        b.activate(MODEL)
        outs = {o.request_id: [o] for o in first}
        decode_all(b, list(outs), outs)
        for rid, want in expected.items():
            assert tokens(outs[rid]) == tokens(want), rid
    finally:
        parent.send("bye")
        process.join(30)
    assert process.exitcode == 0
    from pool.engines.handoff import opened_arenas

    assert process.pid in opened_arenas().values()  # opened here, from the exporter's process ...
    b.stats()
    assert process.pid not in opened_arenas().values()  # ... and closed at the next stats once it is gone


def test_a_hand_off_arena_too_small_for_one_region_is_refused_in_the_config():
    from pool.engines.handoff import ALIGN
    from pool.engines.torch_engine import TorchEngineConfig

    with pytest.raises(ValueError, match="handoff_bytes = 100 must be 0 or >= "):
        TorchEngineConfig(handoff_bytes=100)  # not at the first export, writing the instance off
    assert TorchEngineConfig(handoff_bytes=ALIGN).handoff_bytes == ALIGN


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 48, 50, 90])
def test_write_blocks_lays_out_what_write_tokens_does(tokens):
    """The staged import's writer (every whole block in one indexed copy through the region's row view, then the
    partial last block) against the block-by-block one, into blocks out of order across two slabs, some adjacent
    and some not, as decode's growth and frees leave them."""
    from pool.engines.kv import KvShape, device_pool, host_pool, row_view
    from pool.engines.kvstore import write_blocks, write_tokens

    shape = KvShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    kv = torch.randn(2, 2, 2, tokens, 8)
    region = torch.empty(16 * shape.block_bytes, dtype=torch.uint8)
    pool, host = device_pool(region, 8 * shape.block_bytes), host_pool(8 * shape.block_bytes, 64 * shape.block_bytes, pin=False)
    taken = pool.allocate(shape, 14)  # both slabs; picked: descending, a run of three, then the other slab
    for ref in taken:  # garbage where the tail's zeros must land
        pool.block(shape, ref).fill_(float("nan"))
    picked = [taken[k] for k in (5, 2, 3, 4, 0, 9, 13)][: shape.blocks_for(tokens)]
    expected = host.allocate(shape, len(picked))
    write_tokens(kv, host, shape, expected)
    write_blocks(kv, row_view(region, shape), shape, [pool.first_row(shape, ref) for ref in picked])
    for a, b in zip(expected, picked):
        assert torch.equal(host.block(shape, a), pool.block(shape, b))
    others = [ref for ref in taken if ref not in picked]
    assert all(torch.isnan(pool.block(shape, ref)).all() for ref in others)  # nothing written beside them
    with pytest.raises(ValueError, match="fill"):
        write_blocks(kv, row_view(region, shape), shape, [pool.first_row(shape, r) for r in picked + picked[:1]])


@pytest.mark.parametrize("tokens", [0, 1, 15, 16, 17, 48, 50, 90])
def test_read_blocks_gathers_what_read_tokens_does(tokens):
    """The staged export's gather (every whole block in one indexed read through the region's row view, then the
    partial last block) against the block-by-block one, from blocks out of order across two slabs, into a new
    tensor and into a given one (an arena region); more blocks than the tokens fill are fine, fewer are refused."""
    from pool.engines.kv import KvShape, device_pool, row_view
    from pool.engines.kvstore import read_blocks, read_tokens

    shape = KvShape(num_layers=2, num_kv_heads=3, head_dim=8, block_size=16, dtype=torch.float32)
    region = torch.empty(16 * shape.block_bytes, dtype=torch.uint8)
    pool = device_pool(region, 8 * shape.block_bytes)
    taken = pool.allocate(shape, 14)
    for ref in taken:
        pool.block(shape, ref).copy_(torch.randn(shape.dims))
    picked = [taken[k] for k in (5, 2, 3, 4, 0, 9, 13)]
    rows, firsts = row_view(region, shape), [pool.first_row(shape, ref) for ref in picked]
    want = read_tokens(pool, shape, picked, tokens)
    assert torch.equal(read_blocks(rows, shape, firsts, tokens), want)
    out = torch.full((2, 2, 3, tokens, 8), float("nan"))
    assert read_blocks(rows, shape, firsts, tokens, out=out) is out and torch.equal(out, want)
    with pytest.raises(ValueError, match="do not fit"):
        read_blocks(rows, shape, firsts[:1], 17)
