"""Decode-graph bookkeeping, the device gate, step timings and the one-GPU layout - the CPU-testable parts of
running several instances on one GPU (the captures themselves run on CUDA: tests marked gpu)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from pool.engines.device import GATE, DeviceGate, held_device_bytes
from pool.engines.graphs import BATCH_SIZES, GraphBuckets, batch_sizes_up_to
from pool.engines.timings import StepTimings
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
from pool.engines.weights import RANDOM_WEIGHTS_FILE, HostWeightCache


def test_buckets_pick_the_smallest_padded_shape_or_none() -> None:
    buckets = GraphBuckets((1, 2, 4, 8), (16, 64))
    assert buckets.pick(1, 1) == (1, 16)
    assert buckets.pick(3, 17) == (4, 64)
    assert buckets.pick(8, 64) == (8, 64)
    assert buckets.pick(9, 4) is None and buckets.pick(2, 65) is None  # outside the set: eager, counted as a miss


def test_graph_batch_sizes_cover_every_batch_up_to_the_schedulers_max() -> None:
    assert batch_sizes_up_to(256) == BATCH_SIZES == GraphBuckets().batch_sizes == TorchEngineConfig().graph_batch_sizes
    assert batch_sizes_up_to(100) == (1, 2, 4, 8, 16, 32, 64, 96, 100)
    assert batch_sizes_up_to(1) == (1,) and batch_sizes_up_to(512)[-2:] == (256, 512)
    buckets = GraphBuckets(batch_sizes_up_to(100))
    assert all(buckets.pick(batch, 1) is not None for batch in range(1, 101)) and buckets.pick(101, 1) is None
    with pytest.raises(ValueError, match="max_batch"):
        batch_sizes_up_to(0)


def test_buckets_capture_only_widths_a_request_can_need() -> None:
    buckets = GraphBuckets((1, 2), (16, 64, 256))
    assert buckets.shapes(10) == [(1, 16), (2, 16)]
    assert buckets.shapes(16) == [(1, 16), (2, 16)]
    assert buckets.shapes(100) == [(1, 16), (2, 16), (1, 64), (2, 64), (1, 256), (2, 256)]
    assert buckets.shapes(10_000) == buckets.shapes(256)  # past the widest: all of them, no more


@pytest.mark.parametrize("field, value", [("batch_sizes", ()), ("batch_sizes", (4, 2)), ("block_widths", (0, 16)),
                                          ("block_widths", (16, 16))])
def test_bad_bucket_sets_are_refused_by_name(field, value) -> None:
    with pytest.raises(ValueError, match=f"GraphBuckets.{field}"):
        GraphBuckets(**{field: value})
    with pytest.raises(ValueError, match="GraphBuckets"):
        TorchEngineConfig(**{"graph_" + ("batch_sizes" if field == "batch_sizes" else "block_widths"): value})


def test_gate_capture_waits_for_calls_and_holds_new_ones_off() -> None:
    gate = DeviceGate()
    order: list[str] = []
    in_call, release = threading.Event(), threading.Event()

    def call() -> None:
        with gate.shared():
            order.append("call start")
            in_call.set()
            release.wait(5)
            order.append("call end")

    def capture() -> None:
        with gate.exclusive():
            order.append("capture")
            time.sleep(0.05)
            order.append("capture end")

    def late_call() -> None:
        with gate.shared():
            order.append("late call")

    first = threading.Thread(target=call)
    first.start()
    assert in_call.wait(5)
    grab = threading.Thread(target=capture)
    grab.start()
    time.sleep(0.05)  # the capture is waiting now; a new call must queue behind it
    late = threading.Thread(target=late_call)
    late.start()
    time.sleep(0.05)
    assert order == ["call start"]
    release.set()
    for t in (first, grab, late):
        t.join(5)
    assert order == ["call start", "call end", "capture", "capture end", "late call"]


def test_cpu_engine_captures_nothing_and_reports_its_graph_figures(tiny_engine) -> None:
    assert tiny_engine.warm_up() == 0  # no CUDA graphs on CPU
    extra = tiny_engine.stats().extra
    assert (extra["graph_captures"], extra["graph_misses"], extra["graph_replays"]) == (0, 0, 0)
    assert extra["held_device_bytes"] == held_device_bytes("cpu")


def test_close_frees_the_device_buffer(tiny_engine) -> None:
    import gc

    gc.collect()  # engines of earlier tests
    before = held_device_bytes("cpu")
    mine = tiny_engine.stats().device_buffer_bytes
    assert mine > 0
    tiny_engine.close()
    gc.collect()
    assert held_device_bytes("cpu") == before - mine


def test_step_timings_split_a_decode_period_into_forward_and_host() -> None:
    timings = StepTimings(cuda=False)
    timings.decode(("a", "b"), 0.000, 0.0030, model="m7")
    timings.decode(("a", "b"), 0.004, 0.0030, model="m7")  # period 4 ms, forward 3 ms: 1 ms of host
    timings.decode(("a", "b"), 0.0085, 0.0030, model="m7")  # 4.5 ms: 1.5 ms of host
    timings.other()  # a switch in between: the next step starts a new run
    timings.decode(("a", "b"), 1.0, 0.0030, model="m7")
    timings.decode(("c",), 1.004, 0.0020, model="m1")  # another batch: no period across batches
    timings.decode(("c",), 1.007, 0.0020, model="m1")
    timings.prefill("m", 512, 1, 0.012)
    summary = timings.summary()
    assert summary["decode"]["<=4"]["steps"] == 2 and summary["decode"]["<=1"]["steps"] == 1
    assert summary["decode"]["<=4"]["overhead_ms_p50"] == pytest.approx(1.25)
    assert summary["prefills"] == [["m", 512, 1, 0.012, 0]]
    # each model's steps apart, the period's and forward's means (what a model's step costs live, by batch)
    by_model = summary["decode_by_model"]
    assert by_model["m7"] == {"<=4": {"steps": 2, "batch_mean": 2.0, "forward_ms_mean": 3.0, "period_ms_mean": 4.25}}
    assert by_model["m1"]["<=1"]["period_ms_mean"] == pytest.approx(3.0) and set(by_model) == {"m7", "m1"}


@pytest.fixture()
def tiny_engine():
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=512)
    cache = HostWeightCache(pin=False)
    engine = TorchEngine(TorchEngineConfig(dtype="float32", kv_bytes=4 << 20), weight_cache=cache)
    engine.add_image(cache.add_random("tiny", config, torch.float32))
    engine.activate("tiny")
    return engine


def test_random_weight_folders_load_seeded_and_reject_a_bad_marker(tmp_path) -> None:
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, torch_dtype="float32")
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        config.save_pretrained(tmp_path / name)
        (tmp_path / name / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))
    cache = HostWeightCache(pin=False)
    a, b, c = (cache.load(n, tmp_path / n) for n in "abc")
    assert torch.equal(a.buffer, b.buffer) and not torch.equal(a.buffer, c.buffer)
    assert a.buffer.float().abs().sum() > 0
    config.save_pretrained(tmp_path / "bad")
    (tmp_path / "bad" / RANDOM_WEIGHTS_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad/random_weights.json"):
        cache.load("bad", tmp_path / "bad")


def test_the_gate_is_process_wide() -> None:
    assert isinstance(GATE, DeviceGate)


def test_one_gpu_layout_is_a_prefill_and_a_decode_instance_sharing_it() -> None:
    from modelpool.gpu_memory import GPU_HEADROOM_BYTES, gpu_kv_bytes, gpu_layout

    count, devices, share = gpu_layout(1, None, "token-level")
    assert (count, devices, share) == (2, {"slot0": "cuda:0", "slot1": "cuda:0"}, 0.5)
    assert gpu_layout(1, None, "request-level") == (1, {"slot0": "cuda:0"}, 1.0)
    assert gpu_layout(4, 8, "token-level")[1]["slot5"] == "cuda:1"
    usable, biggest = 120 * 10**9, 15 * 10**9
    kv = gpu_kv_bytes(usable, 2, biggest)
    assert 2 * (kv + 2 * biggest + GPU_HEADROOM_BYTES) <= usable  # both instances fit on the GPU
    assert gpu_kv_bytes(usable, 1, biggest) > 2 * kv


def test_the_engine_times_its_kv_calls_with_their_bytes(tiny_engine, tmp_path) -> None:
    """save/restore/export/import each leave (requests, bytes, seconds) in the step timings' summary, which the
    live pool reports per engine (/pool/status) and benchmarks/gpu_pool.py records: the hand-off's cost; and
    call by call in the KV call log a benchmark dumps (which hand-off took long, and in which part)."""
    import json
    import time

    from pool.engines.base import GenRequest, SamplingParams

    other = TorchEngine(TorchEngineConfig(dtype="float32", kv_bytes=4 << 20), weight_cache=tiny_engine.weights)
    other.add_image(tiny_engine.weights.add_random("tiny", None, torch.float32))  # the cached image, as built
    other.activate("tiny")
    request = GenRequest("r", "tiny", tuple(range(5, 45)), SamplingParams(max_tokens=8, ignore_eos=True))
    tiny_engine.prefill([request])
    tiny_engine.save_kv(["r"])
    tiny_engine.restore_kv(["r"])
    exports = tiny_engine.export_kv(["r"])
    other.import_kv(exports)
    kv = tiny_engine.stats().extra["timings"]["kv"]
    assert set(kv) == {"save_kv", "restore_kv", "export_kv"}
    assert all(kv[m]["calls"] == 1 and kv[m]["requests"] == 1 and kv[m]["ms_max"] >= 0 for m in kv)
    assert all(kv[m]["ms_mean"] == kv[m]["ms_p50"] == kv[m]["ms_max"] for m in kv)  # one call each
    # nothing waited for: the whole call came before any wait
    assert all(kv[m]["launch_ms_max"] == pytest.approx(kv[m]["ms_max"], abs=1e-3) for m in kv)
    assert all(kv[m]["wait_ms_max"] == 0.0 for m in kv)  # on CPU nothing is queued on a device stream
    assert kv["save_kv"]["mb"] == kv["restore_kv"]["mb"] > 0  # the same blocks out and back
    assert kv["export_kv"]["mb"] == pytest.approx(exports[0].kv_bytes / 1e6, abs=1e-3)
    imported = other.stats().extra["timings"]["kv"]["import_kv"]
    assert imported["requests"] == 1 and imported["mb"] == kv["export_kv"]["mb"]
    tiny_engine.timings.dump_kv_calls(str(tmp_path / "kv.json"))
    rows = json.loads((tmp_path / "kv.json").read_text())
    assert [row[0] for row in rows] == ["save_kv", "restore_kv", "export_kv"]
    assert [row[1] for row in rows] == [1, 1, 1] and rows[2][2] == exports[0].kv_bytes
    started = [row[3] for row in rows]
    assert started == sorted(started) and time.monotonic() - 60 < started[0] <= time.monotonic()
    assert all(row[4] >= row[5] + row[6] - 1e-6 and row[5] == 0.0 for row in rows)


def test_backends_time_every_engine_call_by_method(tiny_engine) -> None:
    """call_engine (every backend's way into an engine) books each call's time in the engine's StepTimings; the
    summary's `calls` says where an instance's time went (benchmarks/gpu_pool.py's call_timings)."""
    from pool.calls import DecodeStep, Prefill
    from pool.engines.base import GenRequest, SamplingParams
    from pool.engines.timings import call_engine

    tiny_engine.activate("tiny")
    request = GenRequest("c", "tiny", tuple(range(5, 25)), SamplingParams(max_tokens=4, ignore_eos=True))
    call_engine(tiny_engine, Prefill((request,)))
    for _ in range(2):
        call_engine(tiny_engine, DecodeStep(("c",)))
    with pytest.raises(Exception, match="unknown request"):
        call_engine(tiny_engine, DecodeStep(("nobody",)))  # a failing call is timed too
    calls = tiny_engine.stats().extra["timings"]["calls"]
    assert calls["prefill"]["calls"] == 1 and calls["decode_step"]["calls"] == 3
    assert calls["decode_step"]["s"] > 0 and calls["decode_step"]["ms_max"] >= calls["decode_step"]["ms_p50"] > 0
    assert "activate" not in calls  # called directly, not through a backend
    by_model = tiny_engine.stats().extra["timings"]["decode_by_model"]  # the engine names each step's model
    assert by_model["tiny"]["<=1"]["steps"] == 1 and set(by_model) == {"tiny"}


def test_a_weight_copy_lands_byte_for_byte(tiny_engine) -> None:
    """A model's image goes to its place in the region as it is, and nothing past it is written."""
    image = tiny_engine.residency.models["tiny"].image
    tiny_engine.residency.slots.region.zero_()
    tiny_engine.residency.slots._copy(image, 512)
    assert torch.equal(tiny_engine.residency.slots.region[512 : 512 + image.nbytes], image.buffer)
    assert not tiny_engine.residency.slots.region[:512].any() and not tiny_engine.residency.slots.region[512 + image.nbytes :].any()


def test_step_timings_time_the_collectors_pauses(tmp_path) -> None:
    """watch_gc (an engine process under a benchmark's call log): every collection of the cyclic collector, by
    generation, in the summary and the dumped log - a collection inside an engine call stalls that call."""
    import gc
    import json

    from pool.engines.timings import StepTimings

    timings = StepTimings(cuda=False)
    timings.watch_gc()
    timings.watch_gc()  # once only
    try:
        assert gc.callbacks.count(timings._gc_phase) == 1
        gc.collect()
        gc.collect(0)
    finally:
        gc.callbacks.remove(timings._gc_phase)
    assert [g for g, _, _ in timings.gc_pauses][-2:] == [2, 0]
    summary = timings.summary()["gc"]
    assert summary["gen2"]["collections"] >= 1 and summary["gen2"]["ms_max"] > 0
    assert summary["gen0"]["ms_sum"] >= summary["gen0"]["ms_max"] > 0
    timings.dump_gc(str(tmp_path / "gc.json"))
    rows = json.loads((tmp_path / "gc.json").read_text())
    assert len(rows) == len(timings.gc_pauses) and rows[-1][0] == 0 and rows[-1][2] > 0
