"""Where live prefill time goes: the torch engine's eager prefill alone, at repeated and fresh lengths, under
the profiler, while another engine decodes on the same GPU (another process, or another thread), and while
another process only copies weights onto it (whole-model host-to-device copies back to back, as a decode
instance's switches and prefetches do: session 10 saw prefills overlapping such copies run ~2x slower).

    python benchmarks/gpu_prefill_probe.py --out probe.json           # on the GPU
    python benchmarks/gpu_prefill_probe.py --tiny --out /tmp/p.json    # anywhere
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_pool import QWEN  # noqa: E402
from pool.engines.base import GenRequest, SamplingParams  # noqa: E402
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from pool.engines.weights import HostWeightCache  # noqa: E402
from pool.mps import PIPE_ENV  # noqa: E402


def engine_with(shapes: dict[str, str], device: str, graphs: bool, kv_bytes: int, warm_prefill: int = 0) -> TorchEngine:
    from transformers import Qwen2Config

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    cache = HostWeightCache()
    engine = TorchEngine(TorchEngineConfig(device=device, kv_bytes=kv_bytes, cuda_graphs=graphs,
                                           warm_prefill_tokens=warm_prefill), weight_cache=cache)
    for seed, (name, shape) in enumerate(shapes.items()):
        config = Qwen2Config(**QWEN[shape], max_position_embeddings=32768, rope_theta=1e6)
        engine.add_image(cache.add_random(name, config, dtype, seed=seed, device=device))
    return engine


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


counter = [0]


def prefill_once(engine: TorchEngine, model: str, tokens: int, device: str) -> float:
    counter[0] += 1
    rid = f"p{counter[0]}"
    request = GenRequest(rid, model, tuple(random.randrange(10, 2000) for _ in range(tokens)),
                         SamplingParams(max_tokens=4, ignore_eos=True))
    sync(device)
    started = time.perf_counter()
    engine.prefill([request])
    took = time.perf_counter() - started
    engine.release([rid])
    return took


def series(engine, model, lengths, device) -> list[float]:
    engine.activate(model)
    return [round(prefill_once(engine, model, n, device) * 1e3, 3) for n in lengths]


def profile_one(engine, model, tokens, device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine.activate(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=activities) as prof:
        took = prefill_once(engine, model, tokens, device)
    events = prof.key_averages()
    key = "self_cpu_time_total"
    top_cpu = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:12]
    out = {"ms": round(took * 1e3, 3), "ops": sum(e.count for e in events),  # host ops the call ran
           "top_cpu": [(e.key, e.count, round(getattr(e, key) / 1e3, 3)) for e in top_cpu]}
    if device != "cpu":
        attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        top_gpu = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:12]
        out["top_gpu"] = [(e.key, e.count, round(getattr(e, attr) / 1e3, 3)) for e in top_gpu]
        out["gpu_total_ms"] = round(sum(getattr(e, attr) for e in events) / 1e3, 3)
        out["kernels"] = sum(e.count for e in events if e.device_type.name == "CUDA" and getattr(e, attr) > 0)
    return out


def decode_loop(shapes, device, seconds, ready, batch=4):
    engine = engine_with(shapes, device, True, 4 << 30)
    engine.warm_up(4096)
    model = next(iter(shapes))
    engine.activate(model)
    ids = [f"d{i}" for i in range(batch)]
    engine.prefill([GenRequest(r, model, tuple(range(10, 500)), SamplingParams(max_tokens=100000, ignore_eos=True))
                    for r in ids])
    ready.set()
    end = time.time() + seconds
    steps = 0
    while time.time() < end:
        engine.decode_step(ids)
        steps += 1
    return steps


def _proc_decode(shapes, device, seconds, ready):
    torch.set_num_threads(1)
    decode_loop(shapes, device, seconds, ready)


def _proc_prefill(shapes, device, seconds, ready, done):
    """Prefills of the largest model at fresh lengths (200-2000 tokens), back to back, as a busy prefill instance:
    a few seconds alone first (before `ready`), then `seconds` beside the caller's work; their mean ms to `done`."""
    torch.set_num_threads(1)
    engine = engine_with(shapes, device, False, 4 << 30, warm_prefill=2048 if device != "cpu" else 0)
    engine.warm_up()  # every padded prefill size up to 2048 run once, as serve's engines are
    model = list(shapes)[-1]
    engine.activate(model)
    rng = random.Random(1)
    for n in (512, 1024, 2048):  # first touch
        prefill_once(engine, model, n, device)
    out = {}
    for phase, span in (("alone", min(5.0, seconds)), ("beside", seconds)):
        if phase == "beside":
            ready.set()
        end, times = time.time() + span, []
        while time.time() < end:
            times.append(prefill_once(engine, model, rng.randint(200, 2000), device))
        out[phase] = {"prefills": len(times), "ms_mean": round(statistics.mean(times) * 1e3, 3) if times else None}
    done.put(out)


def decode_ms(engine: TorchEngine, model: str, ids: list[str], steps: int, device: str) -> float:
    """Milliseconds per decode step of the batch `ids` (CUDA-graph steps, as the pool's decode instance runs)."""
    engine.activate(model)
    engine.decode_step(ids)
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.decode_step(ids)
    sync(device)
    return round((time.perf_counter() - started) / steps * 1e3, 4)


def decode_share(shapes, device, ctx, tiny: bool, sm_percents: list[int]) -> dict:
    """Decode steps (batch 32, ~1000-token contexts, CUDA graphs) alone and while another process prefills back to
    back: what a decode instance pays beside a busy prefill instance (gpu_share_decode_slowdown). Under MPS, each
    of `sm_percents` limits the prefilling process to that share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE;
    100: no limit) in turn."""
    engine = engine_with(shapes, device, True, (8 << 30) if not tiny else (256 << 20))
    engine.warm_up(2048)
    batch = {model: [f"{model}-d{i}" for i in range(32 if not tiny else 4)] for model in shapes}
    rng = random.Random(2)
    for model, ids in batch.items():
        engine.activate(model)
        engine.prefill([GenRequest(rid, model, tuple(rng.randrange(10, 2000) for _ in range(rng.randint(800, 1200))),
                                   SamplingParams(max_tokens=100000, ignore_eos=True)) for rid in ids])
    steps = 300 if not tiny else 5
    out: dict = {"batch": len(next(iter(batch.values()))), "steps": steps, "steps_beside": steps // 3,
                 "alone": {m: [decode_ms(engine, m, ids, steps, device) for _ in range(3)] for m, ids in batch.items()}}
    seconds = 20 if not tiny else 6
    for percent in sm_percents:
        ready, done = ctx.Event(), ctx.Queue()
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)  # the child's, as it starts
        other = ctx.Process(target=_proc_prefill, args=(shapes, device, seconds, ready, done), daemon=True)
        other.start()
        del os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
        ready.wait(240)
        beside = {m: [decode_ms(engine, m, ids, steps // 3, device) for _ in range(3)] for m, ids in batch.items()}
        key = "beside_prefill_process" + ("" if percent == 100 else f"_sm{percent}")
        out[key] = beside
        out[key.replace("beside", "prefills")] = done.get(timeout=seconds + 120)
        other.join(60)
    return out


def _proc_copy(device, seconds, ready, gb=4.0):
    """Whole-model weight copies from pinned memory, back to back, and nothing else."""
    torch.set_num_threads(1)
    nbytes = int(gb * 1e9)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device != "cpu")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream() if device != "cpu" else None
    ready.set()
    end = time.time() + seconds
    while time.time() < end:
        if stream is None:
            target.copy_(host)
            continue
        with torch.cuda.stream(stream):
            target.copy_(host, non_blocking=True)
        stream.synchronize()


def under_mps() -> bool:
    """Whether this process (and the ones it starts) are clients of an MPS daemon (pool.mps's environment)."""
    return bool(os.environ.get(PIPE_ENV))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--alone", action="store_true",
                        help="only the prefill alone, fused kernels against the torch ops (no profiles, no neighbours)")
    parser.add_argument("--decode-share", action="store_true",
                        help="only the decode steps alone and beside a prefilling process (see --sm-percent)")
    parser.add_argument("--sm-percent", type=int, action="append", default=[],
                        help="under MPS: the prefilling process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (repeat; "
                             "default 100, no limit)")
    parser.add_argument("--share", action="store_true",
                        help="only what gpu_share_slowdown is fitted to: the prefill alone and beside a decoding process")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shapes = {"a": "tiny", "b": "tiny"} if args.tiny else {"m1-1.5b": "1.5b", "m5-7b": "7b"}
    random.seed(0)
    if args.decode_share:
        share = decode_share(shapes, device, mp.get_context("spawn"), args.tiny, args.sm_percent or [100])
        args.out.write_text(json.dumps({"decode_share": share, "mps": under_mps()}, indent=1))
        for key, value in share.items():
            print(key, value)
        return 0
    engine = engine_with(shapes, device, False, 256 << 20 if args.tiny else 30 << 30)
    result: dict = {}
    fresh = [random.randint(200, 2000) for _ in range(12)]
    for model in shapes:
        series(engine, model, [512] * 2, device)  # first touch
        result[model] = {"repeated_1024_ms": series(engine, model, [1024] * 6, device),
                         "fresh": list(zip(fresh, series(engine, model, fresh, device))),
                         "fresh_again": list(zip(fresh, series(engine, model, fresh, device)))}
        if args.share:
            continue
        engine.fused = False  # the torch ops (the eager prefill before the fused one), same lengths again
        unfused = [n + 1 for n in fresh]
        result[model]["torch_ops"] = {"fresh": list(zip(unfused, series(engine, model, unfused, device))),
                                      "fresh_again": list(zip(unfused, series(engine, model, unfused, device)))}
        engine.fused = None
        if args.alone:
            continue
        result[model]["profile_fresh"] = profile_one(engine, model, 1537, device)
        result[model]["profile_repeat"] = profile_one(engine, model, 1537, device)
    if args.alone:
        args.out.write_text(json.dumps(result, indent=1))
        for model in shapes:
            r, t = result[model], result[model]["torch_ops"]
            print(model, "prefill ms, median over the fresh lengths (first run / again): fused",
                  statistics.median(x for _, x in r["fresh"]), "/", statistics.median(x for _, x in r["fresh_again"]),
                  "| torch ops", statistics.median(x for _, x in t["fresh"]), "/",
                  statistics.median(x for _, x in t["fresh_again"]))
        return 0
    # while another process decodes on the same GPU
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    other = ctx.Process(target=_proc_decode, args=(shapes, device, 40 if not args.tiny else 8, ready), daemon=True)
    other.start()
    ready.wait(240)
    model = list(shapes)[-1]
    result["with_decode_process"] = {model: list(zip(fresh, series(engine, model, fresh, device)))}
    other.join(60)
    if args.share:
        del engine
        result["decode_share"] = decode_share(shapes, device, ctx, args.tiny, args.sm_percent or [100])
        result["mps"] = under_mps()
        args.out.write_text(json.dumps(result, indent=1))
        alone = statistics.median(t for _, t in result[model]["fresh_again"])
        beside = statistics.median(t for _, t in result["with_decode_process"][model])
        print(model, f"prefill ms, median over the lengths: alone {alone}, beside a decoding process {beside}")
        share = result["decode_share"]
        for m in shapes:
            print(m, f"decode step ms (batch {share['batch']}): alone {share['alone'][m]}, beside a prefilling "
                     f"process {share['beside_prefill_process'][m]}")
        return 0
    # while another process only copies weights onto the GPU
    ready_c = ctx.Event()
    copier = ctx.Process(target=_proc_copy, args=(device, 30 if not args.tiny else 4, ready_c,
                                                  4.0 if not args.tiny else 0.05), daemon=True)
    copier.start()
    ready_c.wait(120)
    result["with_copy_process"] = {model: list(zip(fresh, series(engine, model, fresh, device)))}
    copier.join(60)
    # while another thread of this process decodes
    ready_t = threading.Event()
    thread = threading.Thread(target=decode_loop, args=(shapes, device, 30 if not args.tiny else 6, ready_t), daemon=True)
    thread.start()
    ready_t.wait(240)
    result["with_decode_thread"] = {model: list(zip(fresh, series(engine, model, fresh, device)))}
    thread.join(60)
    args.out.write_text(json.dumps(result, indent=1))
    for model in shapes:
        r = result[model]
        print(model, "repeated 1024:", r["repeated_1024_ms"], "| fresh median", statistics.median(t for _, t in r["fresh"]),
              "again", statistics.median(t for _, t in r["fresh_again"]))
        for kind in ("profile_fresh", "profile_repeat"):
            p = r[kind]
            print(f"  {kind}: {p['ms']} ms, gpu {p.get('gpu_total_ms')} ms; top cpu {p['top_cpu'][:6]}")
            print(f"     top gpu {p.get('top_gpu', [])[:6]}")
    for kind in ("with_decode_process", "with_copy_process", "with_decode_thread"):
        print(kind, {m: statistics.median(t for _, t in v) for m, v in result[kind].items()}, result[kind])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
