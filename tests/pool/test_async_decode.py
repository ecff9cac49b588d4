"""Async decode: `TorchEngine.decode_step` queues a greedy batch's next step before it emits this one's tokens.

On CPU nothing overlaps (ops run synchronously), but the logic is the same as on CUDA: these tests drive an
engine with it and one without it through the same calls, chosen at random - decode steps of the same batch
(the step launched ahead is taken) or of another one, finishes mid-batch (max_tokens, stop tokens, stop
strings), a sampled request in the batch (no step ahead), swaps, exports and imports, cancels, a switch - and
require every result, every exported KV byte and the KV accounting after every other call to be identical.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pool.engines.base import GenRequest, KvExport, SamplingParams, TokenOut
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
from pool.engines.weights import HostWeightCache

WEIGHTS = HostWeightCache()
MODELS = ("tiny-llama", "tiny-qwen2")
SLAB = 128 * 1024


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def make_engine(demo_models: dict[str, Path], async_decode: bool, block_size: int = 16,
                device: str = "cpu") -> TorchEngine:
    engine = TorchEngine(TorchEngineConfig(device=device, dtype="float32", async_decode=async_decode,
                                           kv_bytes=24 * SLAB, device_slab_bytes=SLAB, host_slab_bytes=SLAB,
                                           block_size=block_size), weight_cache=WEIGHTS)
    for name in MODELS:
        engine.load(name, demo_models[name])
    engine.activate(MODELS[0])
    engine.activate(MODELS[1], evict=False)  # both resident: a step may hold a batch of each
    engine.warm_up(256)  # CUDA graphs (none on CPU)
    return engine


def greedy_run(engine: TorchEngine, request: GenRequest) -> list[TokenOut]:
    outs = engine.prefill([request])
    while not outs[-1].finished:
        outs += engine.decode_step([request.request_id])
    return outs


def make_requests(engine: TorchEngine, rng: random.Random, tag: str) -> list[GenRequest]:
    """Greedy requests of both models (plain, with a stop token, with a stop string that their greedy text
    holds) and one seeded sampled one."""
    requests = []
    for i in range(7):
        model = MODELS[i % 2]
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))]
        plain = SamplingParams(max_tokens=rng.randrange(4, 40), ignore_eos=True)
        params = plain
        if i in (2, 3, 4):  # stop where its uninterrupted greedy run shows a token or a text
            probe = greedy_run(engine, GenRequest(f"{tag}-probe{i}", model, prompt, SamplingParams(max_tokens=30,
                                                                                               ignore_eos=True)))
            text = "".join(o.text for o in probe)
            if i == 2:
                params = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[probe[12].token_id])
            elif len(text) > 12:
                params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[text[8:11]])
        if i == 6:
            params = SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)  # few steps without ahead
        requests.append(GenRequest(f"{tag}-{i}", model, prompt, params))
    return requests


class Twins:
    """An engine with async decode and one without, given the same calls; every result must match."""

    def __init__(self, demo_models: dict[str, Path], device: str = "cpu") -> None:
        # 4-token blocks: a step ahead often grows a block, which a discard must give back
        self.fast, self.plain = (make_engine(demo_models, flag, 4, device) for flag in (True, False))
        assert self.fast.async_decode and not self.plain.async_decode

    def call(self, method: str, *args) -> tuple:
        got, want = getattr(self.fast, method)(*args), getattr(self.plain, method)(*args)
        if method == "activate":
            pass  # it returns the seconds it took
        elif method == "export_kv":
            assert [_export_key(e) for e in got] == [_export_key(e) for e in want]
        else:
            assert got == want, method
        if method != "decode_step":  # KV held is the same once the step ahead is discarded (its block given back)
            self.fast.synchronize(), self.plain.synchronize()  # and blocks freed behind a copy are back (CUDA)
            for field in ("kv_device_used_bytes", "kv_host_used_bytes", "num_requests"):
                assert getattr(self.fast.stats(), field) == getattr(self.plain.stats(), field), (method, field)
        return got, want


def _export_key(export: KvExport) -> tuple:
    return (export.request, export.num_tokens, export.text, export.text_emitted, export.detok_offsets,
            np.asarray(export.kv).tobytes())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_async_decode_gives_the_same_results_through_any_calls(seed, device, demo_models):
    rng = random.Random(seed)
    twins = Twins(demo_models, device)
    requests = make_requests(twins.plain, rng, f"s{seed}")
    live: dict[str, GenRequest] = {}
    on_host: set[str] = set()
    batch: list[str] = []

    def admitted(results: tuple) -> None:
        for out in results[0]:
            if out.finished:
                live.pop(out.request_id)
                on_host.discard(out.request_id)

    for request in requests[:4]:
        live[request.request_id] = request
        admitted(twins.call("prefill", [request]))
    pending = requests[4:]
    for _ in range(400):
        if not live and not pending:
            break
        on_device = [rid for rid in live if rid not in on_host]
        roll = rng.random()
        if pending and (roll < 0.05 or not live):
            request = pending.pop()
            live[request.request_id] = request
            admitted(twins.call("prefill", [request]))
        elif roll < 0.75 and on_device:
            batch = [rid for rid in batch if rid in on_device]  # the batch less those that finished (or left)
            if not batch or rng.random() < 0.1:  # mostly the same batch
                batch = rng.sample(on_device, rng.randint(1, len(on_device)))
            admitted(twins.call("decode_step", batch))
        elif roll < 0.80:
            assert twins.fast.stats().num_requests == twins.plain.stats().num_requests  # keeps the step ahead
        elif roll < 0.86 and on_device:
            moved = rng.sample(on_device, rng.randint(1, len(on_device)))
            twins.call("save_kv", moved)
            on_host.update(moved)
        elif roll < 0.91 and on_host:
            twins.call("restore_kv", sorted(on_host))
            on_host.clear()
        elif roll < 0.95 and live:
            moved = rng.sample(sorted(live), rng.randint(1, len(live)))
            fast_exports, plain_exports = twins.call("export_kv", moved)
            twins.fast.import_kv(fast_exports)  # each takes back what it gave (they were equal)
            twins.plain.import_kv(plain_exports)
            on_host.update(moved)
        elif roll < 0.97 and live:
            gone = rng.choice(sorted(live))
            twins.call("release", [gone])
            live.pop(gone)
            on_host.discard(gone)
        else:
            twins.call("activate", rng.choice(MODELS), False)  # a switch that leaves both resident
    assert not live and not pending
    fast = twins.fast.stats().extra
    # the test saw both sides of it: steps taken ahead, and steps discarded by another call
    assert fast["decode_steps_ahead"] > fast["decode_steps_discarded"] > 0
    assert twins.plain.stats().extra["decode_steps_ahead"] == 0
    # nothing left but the scratch block per KV shape that padded graph rows and padded prefills write to
    scratch = sum(shape.block_bytes for shape in twins.plain.residency.kv._scratch)
    assert twins.fast.stats().kv_device_used_bytes == twins.plain.stats().kv_device_used_bytes == scratch


def test_a_step_ahead_is_taken_by_the_same_batch_only(demo_models):
    engine = make_engine(demo_models, True)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.prefill([GenRequest("a", MODELS[0], [5, 6, 7], params), GenRequest("b", MODELS[0], [8, 9], params)])
    extra = lambda: (engine.stats().extra["decode_steps_ahead"], engine.stats().extra["decode_steps_discarded"])
    engine.decode_step(["a", "b"])
    engine.decode_step(["a", "b"])  # takes the step launched by the first call
    assert extra() == (2, 0)
    engine.decode_step(["b", "a"])  # another order is another batch: the step ahead is discarded
    assert extra() == (3, 1)
    engine.decode_step(["b", "a"])
    engine.stats()
    engine.decode_step(["b", "a"])  # stats changes nothing: taken
    assert extra() == (5, 1)
    engine.save_kv(["a"])
    assert extra() == (5, 2)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    engine.prefill([GenRequest("s", MODELS[0], [4, 4], sampled)])
    engine.decode_step(["b", "s"])  # a sampled row: no step ahead
    assert extra() == (5, 2)
    short = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.prefill([GenRequest("c", MODELS[0], [3, 3], short)])
    assert engine.decode_step(["c"])[0].finish_reason == "length"  # ends by its length now: nothing ahead
    assert extra() == (5, 2)
    engine.prefill([GenRequest("d", MODELS[0], [3, 3], short), GenRequest("e", MODELS[0], [2, 2], params)])
    assert [o.finished for o in engine.decode_step(["e", "b", "d"])] == [False, False, True]
    # d ends by its length: the step ahead is the batch less d, a step of its own two rows (not the rows of a
    # three-row step, whose numbers could differ in the last bits), fed e's and b's ids from the device
    assert extra() == (6, 2)
    engine.decode_step(["e", "b"])  # the rest of the turn, in order: takes it
    assert extra() == (7, 2)


def test_async_decode_is_off_on_cpu_by_default_and_for_tensor_parallel_ranks():
    assert not TorchEngine(TorchEngineConfig()).async_decode
    assert TorchEngine(TorchEngineConfig(async_decode=True)).async_decode
    assert not TorchEngine(TorchEngineConfig(async_decode=True), rank=object()).async_decode


def test_every_other_call_discards_the_step_ahead(demo_models):
    engine = make_engine(demo_models, True)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    engine.prefill([GenRequest("a", MODELS[0], [5, 6, 7], params)])
    calls = [("activate", MODELS[0], False), ("prefetch", MODELS[1]),
             ("prefill", [GenRequest("b", MODELS[0], [1], params)]), ("release", ["b"]), ("save_kv", ["a"]),
             ("restore_kv", ["a"]), ("deactivate", MODELS[1]), ("activate", MODELS[1], False),
             ("drop_resident", "nothing"), ("warm_up",)]
    for method, *args in calls + [("export_kv", ["a"])]:
        engine.decode_step(["a"])
        discarded = engine.stats().extra["decode_steps_discarded"]
        exports = getattr(engine, method)(*args)
        assert engine.stats().extra["decode_steps_discarded"] == discarded + 1, method
        if method == "save_kv":
            engine.restore_kv(["a"])
    engine.import_kv(exports)
    engine.restore_kv(["a"])
    engine.decode_step(["a"])
    engine.import_kv([])
    assert engine.stats().extra["decode_steps_discarded"] == 12
    engine.decode_step(["a"])
    engine.close()
    assert engine.stats().extra["decode_steps_discarded"] == 13


def test_serve_switches_async_decode_off_in_the_engine_it_builds():
    import typer.main

    from modelpool.cli import app
    from modelpool.serve import with_async_decode
    from pool.actor import EngineSpec
    from pool.actor import make_engine as build

    serve = typer.main.get_command(app).commands["serve"]
    for argv, want in (([], None), (["--no-async-decode"], False), (["--async-decode"], True)):
        assert serve.make_context("serve", list(argv)).params["async_decode"] is want
    spec = EngineSpec("torch", {"dtype": "float32", "kv_bytes": 1 << 20})
    assert build(with_async_decode(spec, False)).async_decode is False
    assert build(with_async_decode(spec, True)).async_decode is True
    assert with_async_decode(spec, None) == spec
    sim = EngineSpec("sim", {"time_scale": 0.0})
    assert with_async_decode(sim, False) == sim  # only the torch engine has it


def test_decode_host_benchmark_runs_both_modes(tmp_path):
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_host.py"
    spec = importlib.util.spec_from_file_location("decode_host", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "decode_host.json"
    argv = ["--device", "cpu", "--batches", "1", "4", "--steps", "12", "--vocab", "512", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["async_decode"]) for r in rows] == [(1, False), (4, False), (1, True), (4, True)]
    assert all(r["steps"] == 11 and r["period_ms"] > r["forward_ms"] > 0 and r["emit_ms"] > 0 for r in rows)


def test_a_step_launched_ahead_adds_its_period_less_its_forward_to_the_engines_step():
    """StepTimings: a plain step adds the time outside the engine's call to the engine's step; one launched ahead
    overlapped all host work with the device, so it adds period - forward."""
    from pool.engines.timings import StepTimings

    timings = StepTimings(cuda=False)
    for at, ahead in ((0.0, False), (0.004, True), (0.008, True)):
        timings.decode(("a",), at, 0.003, ahead)
    assert [row[4] for row in timings.decodes] == [0, 1]  # each period is its earlier call's step
    plain, fast = StepTimings(cuda=False), StepTimings(cuda=False)
    plain.decodes.extend([(2, 0.0040, 0.0030, 0.0035, 0)] * 3)  # 0.5 ms outside the call
    fast.decodes.extend([(2, 0.0031, 0.0030, 0.0029, 1)] * 3)  # the call waited on the device; 0.2 ms outside
    for timed, added, outside, share in ((plain, 0.5, 0.5, 0.0), (fast, 0.1, 0.2, 1.0)):
        bucket = timed.summary()["decode"]["<=4"]
        assert bucket["added_ms_p50"] == pytest.approx(added) and bucket["outside_ms_p50"] == pytest.approx(outside)
        assert bucket["ahead_share"] == share
    stalled = StepTimings(cuda=False)  # nine steps that added 0.1 ms, one that waited 10.1 ms on a stats() call
    stalled.decodes.extend([(2, 0.0031, 0.0030, 0.0029, 1)] * 9 + [(2, 0.0131, 0.0030, 0.0029, 1)])
    bucket = stalled.summary()["decode"]["<=4"]
    assert bucket["added_ms_p50"] == pytest.approx(0.1) and bucket["added_ms_mean"] == pytest.approx(1.1)


def test_a_prefill_says_whether_it_came_after_a_discarded_step(demo_models):
    """Its timing row's last field: 1 when a step launched ahead was discarded since the last prefill or decode
    call (the device ran that step inside the prefill's time), whichever call discarded it."""
    engine = make_engine(demo_models, True)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    flags = lambda: [row[4] for row in engine.stats().extra["timings"]["prefills"]]  # noqa: E731
    engine.prefill([GenRequest("a", MODELS[0], [5, 6, 7], params)])
    engine.prefill([GenRequest("b", MODELS[0], [1, 2], params)])  # nothing launched ahead yet
    engine.decode_step(["a"])
    engine.prefill([GenRequest("c", MODELS[0], [3], params)])  # discards a's step
    engine.decode_step(["a"])
    engine.activate(MODELS[0], False)  # this call discards it; the prefill after still waits for it
    engine.prefill([GenRequest("d", MODELS[0], [4], params)])
    engine.decode_step(["a"])
    engine.decode_step(["b"])  # another batch: a's step discarded, then synchronised with this step
    engine.prefill([GenRequest("e", MODELS[0], [9], params)])  # discards b's
    engine.decode_step(["b"])
    engine.decode_step(["b"])  # takes it and launches the next
    engine.release(["b"])
    engine.prefill([GenRequest("f", MODELS[0], [8], params)])
    assert flags() == [0, 0, 1, 1, 1, 1]
    sync = make_engine(demo_models, False)
    sync.prefill([GenRequest("a", MODELS[0], [5, 6, 7], params)])
    sync.decode_step(["a"])
    sync.prefill([GenRequest("b", MODELS[0], [1], params)])
    assert [row[4] for row in sync.stats().extra["timings"]["prefills"]] == [0, 0]
