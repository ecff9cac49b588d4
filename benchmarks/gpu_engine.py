"""Benchmark the swap-native torch engine: switch time vs the PCIe floor, KV swap, decode, prefetch interference.

    python benchmarks/gpu_engine.py --out benchmarks/out/h200-engine.json      # on a GPU (7B and 14B shapes)
    python benchmarks/gpu_engine.py --tiny --out /tmp/engine.json        # anywhere, seconds, tiny shapes

Models are random bf16 weights built in memory from Qwen2.5-7B/14B-shaped
configs (no files, no network). Measured:
- pinned host<->device bandwidth (a large buffer), and from it the switch floor = weight bytes / H2D;
- whole-model switch (`activate` of a model not on the device), and `activate` after a finished prefetch;
- KV swap bandwidth: `save_kv` / `restore_kv` of a batch at the decode context;
- decode step time (engine step: inputs, forward, sampling) at batch 1/8/32, with and without CUDA graphs,
  through the fused Triton decode kernels (CUDA default) and, with --compare-unfused, the plain torch ops;
- kernels launched by one decode forward (profiler, eager), fused and plain;
- decode step time while another model's prefetch is in flight, against the same steps without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pool.engines.base import GenRequest, SamplingParams  # noqa: E402
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from pool.engines.weights import HostWeightCache  # noqa: E402
from scheduler.fleet import catalogue_arch, hf_shape  # noqa: E402

GiB = 1 << 30
# Qwen2.5 shapes from the arch catalogue (scheduler/catalog.py), as Qwen2Config keys
SHAPES = {f"{key}-shape": hf_shape(catalogue_arch(key)) for key in ("qwen2.5-7b", "qwen2.5-14b")}
TINY_SHAPES = {
    "tiny-a": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=512, vocab_size=1024, tie_word_embeddings=False),
    "tiny-b": dict(hidden_size=384, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                   intermediate_size=768, vocab_size=1024, tie_word_embeddings=False),
}


def qwen2_config(shape: dict[str, int]):
    from transformers import Qwen2Config

    return Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6)


def sync(device: torch.device, compute_only: bool = False) -> None:
    """Wait for the device; `compute_only` waits for the compute stream alone (not a prefetch in flight)."""
    if device.type == "cuda":
        if compute_only:
            torch.cuda.current_stream(device).synchronize()
        else:
            torch.cuda.synchronize(device)


def timed(fn, device: torch.device, compute_only: bool = False) -> float:
    sync(device, compute_only)
    start = time.perf_counter()
    fn()
    sync(device, compute_only)
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """Pinned host <-> device GB/s (on CPU: memcpy between two buffers)."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(2)
    h2d = min(timed(lambda: dev.copy_(host, non_blocking=True), device) for _ in range(reps))
    d2h = min(timed(lambda: host.copy_(dev, non_blocking=True), device) for _ in range(reps))
    return {"bytes": nbytes, "h2d_GBps": nbytes / h2d / 1e9, "d2h_GBps": nbytes / d2h / 1e9}


def make_requests(prefix: str, model: str, batch: int, prompt_len: int, vocab: int) -> list[GenRequest]:
    gen = torch.Generator().manual_seed(len(prefix) + batch)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    return [GenRequest(f"{prefix}{i}", model, torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
            for i in range(batch)]


def decode_ms(engine: TorchEngine, ids: list[str], steps: int) -> float:
    engine.decode_step(ids)  # warm-up (and graph capture)
    return timed(lambda: [engine.decode_step(ids) for _ in range(steps)], engine.device) / steps * 1e3


def kernels_per_step(engine: TorchEngine, ids: list[str]) -> int | None:
    """CUDA kernels (and copies) one eager decode step launches, counted by the profiler; None off CUDA."""
    if not engine.streams.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.use_cuda_graphs = engine.use_cuda_graphs, False
    try:
        engine.decode_step(ids)  # compile / warm up outside the profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.decode_step(ids)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    except Exception as exc:  # the profiler is optional here
        print(f"kernel count failed: {exc!r}", flush=True)
        return None
    finally:
        engine.use_cuda_graphs = graphs


def bench_switch(engine: TorchEngine, model: str, reps: int) -> dict[str, object]:
    times = []
    for _ in range(reps):
        engine.deactivate(model)
        engine.drop_resident(model)
        times.append(engine.activate(model))
    engine.deactivate(model)
    engine.drop_resident(model)
    engine.prefetch(model)
    engine.synchronize()
    after_prefetch = engine.activate(model)
    return {"switch_s": statistics.median(times), "switch_s_all": times, "activate_after_prefetch_s": after_prefetch}


def bench_model(engine: TorchEngine, model: str, args, vocab: int, bw: dict[str, float]) -> dict[str, object]:
    nbytes = engine.model_bytes(model)
    out: dict[str, object] = {"weight_bytes": nbytes, "floor_s": nbytes / (bw["h2d_GBps"] * 1e9),
                              "weights_pinned": engine.weights_pinned(model)}
    out.update(bench_switch(engine, model, args.switch_reps))
    out["switch_over_floor"] = out["switch_s"] / out["floor_s"]
    prompt_len = args.ctx - args.steps - 2  # stay inside one block-table bucket while timing
    rows = []
    for batch in args.batches:
        reqs = make_requests(f"{model}/b{batch}/", model, batch, prompt_len, vocab)
        ids = [r.request_id for r in reqs]
        engine.prefill(reqs)
        modes: list[tuple[bool, bool | None]] = [(False, None)]  # (CUDA graphs, fused); None: the default
        if engine.streams.cuda:
            modes.append((True, None))
        if args.compare_unfused and engine.streams.cuda:
            modes.append((True, False))
        for graphs, fused in modes:
            engine.use_cuda_graphs, engine.fused = graphs, fused
            row = {"batch": batch, "ctx": args.ctx, "graphs": graphs,
                   "fused": engine.residency.decoder(engine.residency.models.require(model)).fused,
                   "step_ms": decode_ms(engine, ids, args.steps)}
            if batch == min(args.batches) and not graphs:
                out["kernels_per_step"] = kernels_per_step(engine, ids)
                if args.compare_unfused and engine.streams.cuda:
                    engine.fused = False
                    out["kernels_per_step_unfused"] = kernels_per_step(engine, ids)
                    engine.fused = fused
            if graphs:  # the forward alone: replay the graph just used (engine internals, benchmark only)
                graph = next(reversed(engine.graphs.graphs._graphs.values())).graph
                row["replay_ms"] = timed(lambda: [graph.replay() for _ in range(args.steps)], engine.device) \
                    / args.steps * 1e3
            rows.append(row)
            engine.release(ids)
            engine.prefill(reqs)  # same context length for the next mode
        if batch == max(args.batches):
            kv = engine.stats().kv_device_used_bytes
            engine.save_kv(ids)  # warm-up: first copies and slab assignment
            engine.restore_kv(ids)
            save = timed(lambda: engine.save_kv(ids), engine.device)
            restore = timed(lambda: engine.restore_kv(ids), engine.device)
            out["kv_swap"] = {"bytes": kv, "save_s": save, "restore_s": restore,
                              "save_GBps": kv / save / 1e9, "restore_GBps": kv / restore / 1e9}
        engine.release(ids)
    engine.use_cuda_graphs = engine.streams.cuda and engine.config.cuda_graphs
    engine.fused = None
    out["decode"] = rows
    return out


def bench_interference(engine: TorchEngine, active: str, other: str, args, vocab: int) -> dict[str, object]:
    """Decode `active` while `other` is being prefetched into the spare slot."""
    engine.deactivate(other)
    engine.drop_resident(other)
    engine.activate(active)
    reqs = make_requests(f"{active}/int/", active, 8, args.ctx - 5 * args.steps, vocab)  # one graph bucket
    ids = [r.request_id for r in reqs]
    engine.prefill(reqs)
    base = decode_ms(engine, ids, args.steps)
    prefetch_alone = timed(lambda: engine.prefetch(other), engine.device)
    engine.drop_resident(other)
    sync(engine.device)
    start = time.perf_counter()
    engine.prefetch(other)
    concurrent = not engine.weights_ready(other)  # CPU prefetches synchronously
    step_times = [timed(lambda: engine.decode_step(ids), engine.device, compute_only=True)]
    while len(step_times) < 3 * args.steps and not engine.weights_ready(other):
        step_times.append(timed(lambda: engine.decode_step(ids), engine.device, compute_only=True))
    sync(engine.device)
    prefetch_s = time.perf_counter() - start
    engine.release(ids)
    during = statistics.mean(step_times) * 1e3
    return {"active": active, "prefetched": other, "batch": 8, "base_step_ms": base, "during_prefetch_step_ms": during,
            "slowdown": during / base, "steps_during_prefetch": len(step_times), "prefetch_alone_s": prefetch_alone,
            "prefetch_with_decode_s": prefetch_s, "concurrent": concurrent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (runs on CPU in seconds)")
    parser.add_argument("--device", default=None, help="default: cuda when available (and not --tiny), else cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--switch-reps", type=int, default=5)
    parser.add_argument("--compare-unfused", action="store_true",
                        help="also time CUDA-graph decode through the plain torch ops (the pre-fusion path)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.tiny:
        args.ctx, args.steps, args.switch_reps = min(args.ctx, 96), min(args.steps, 5), min(args.switch_reps, 3)
    torch.manual_seed(0)
    cache = HostWeightCache(pin=device.type == "cuda")
    images = {}
    for name, shape in shapes.items():
        start = time.perf_counter()
        images[name] = cache.add_random(name, qwen2_config(shape), torch.bfloat16, device=device)
        print(f"built {name}: {images[name].nbytes / GiB:.2f} GiB in {time.perf_counter() - start:.1f} s", flush=True)
    cuda = device.type == "cuda"
    engine = TorchEngine(TorchEngineConfig(
        device=str(device), block_size=16,
        kv_bytes=(16 * GiB if cuda else 64 << 20), device_slab_bytes=(64 << 20 if cuda else 1 << 20),
        host_slab_bytes=(GiB if cuda else 4 << 20), max_host_kv_bytes=(32 * GiB if cuda else 256 << 20),
        host_kv_prealloc_bytes=(8 * GiB if cuda else 16 << 20),
        max_model_bytes=max(i.nbytes for i in images.values())), weight_cache=cache)
    for image in images.values():
        engine.add_image(image)
    bw = copy_bandwidth(device, (4 * GiB if cuda else 64 << 20), reps=3)
    result: dict[str, object] = {
        "device": device.type, "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "torch": torch.__version__, "ctx": args.ctx, "pinned": bw, "models": {}}
    for name, shape in shapes.items():
        result["models"][name] = bench_model(engine, name, args, shape["vocab_size"], bw)  # type: ignore[index]
        print(f"measured {name}", flush=True)
    first, second = list(shapes)[:2]
    result["prefetch_interference"] = bench_interference(engine, first, second, args, shapes[first]["vocab_size"])
    stats = engine.stats()
    result["engine"] = {"device_buffer_bytes": stats.device_buffer_bytes, "bytes_h2d": stats.bytes_h2d,
                        "bytes_d2h": stats.bytes_d2h, "num_switches": stats.num_switches, **stats.extra}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    bw = result["pinned"]
    print(f"\ndevice {result['device']} {result['gpu'] or ''}  pinned H2D {bw['h2d_GBps']:.1f} GB/s, "
          f"D2H {bw['d2h_GBps']:.1f} GB/s")
    print(f"{'model':20s} {'GiB':>6s} {'switch s':>9s} {'floor s':>8s} {'x floor':>8s} {'after pf s':>10s} "
          f"{'KV out GB/s':>11s} {'KV in GB/s':>10s}")
    for name, m in result["models"].items():
        kv = m.get("kv_swap", {})
        print(f"{name:20s} {m['weight_bytes'] / GiB:6.2f} {m['switch_s']:9.4f} {m['floor_s']:8.4f} "
              f"{m['switch_over_floor']:8.2f} {m['activate_after_prefetch_s']:10.4f} "
              f"{kv.get('save_GBps', 0):11.2f} {kv.get('restore_GBps', 0):10.2f}")
    print(f"\n{'model':20s} {'batch':>5s} {'ctx':>5s} {'graphs':>6s} {'fused':>6s} {'step ms':>8s} {'replay ms':>9s}")
    for name, m in result["models"].items():
        for row in m["decode"]:
            replay = f"{row['replay_ms']:9.2f}" if "replay_ms" in row else f"{'-':>9s}"
            graphs, fused = str(row["graphs"]), str(row.get("fused"))
            print(f"{name:20s} {row['batch']:5d} {row['ctx']:5d} {graphs:>6s} {fused:>6s} {row['step_ms']:8.2f} "
                  f"{replay}")
        print(f"{name:20s} kernels per eager step: {m.get('kernels_per_step')} fused, "
              f"{m.get('kernels_per_step_unfused')} plain")
    p = result["prefetch_interference"]
    print(f"\ndecode {p['active']} (batch {p['batch']}) while prefetching {p['prefetched']}: "
          f"{p['base_step_ms']:.2f} -> {p['during_prefetch_step_ms']:.2f} ms/step (x{p['slowdown']:.2f}, "
          f"{p['steps_during_prefetch']} steps); prefetch {p['prefetch_alone_s']:.3f} s alone, "
          f"{p['prefetch_with_decode_s']:.3f} s with decode; concurrent={p['concurrent']}")


if __name__ == "__main__":
    raise SystemExit(main())
