"""Decode steps at mixed context lengths vs one length of the same mean, on the real engine.

`modelpool calibrate` times decode steps of requests that all have one context length. A served batch mixes
lengths (ShareGPT prompts run from tens to thousands of tokens). This times, per shape and batch, a decode step
of requests whose contexts are drawn from a scenario's length distribution (prompt + half its output, clipped to
12k tokens on CUDA) against the same batch at the mean context, both timed step by step (synchronised, as
calibrate times) and back to back (the steps queued, as the serving loop runs them), beside the cost model's step
at that batch and total context (the calibrated profile given, else the default one).

    python benchmarks/decode_mix.py --device cuda [--profile measured.json] [--scenario eight-poisson]
    python benchmarks/decode_mix.py --device cpu --quick      # tiny shapes: a smoke run of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default=None, help="a measurements file or profile for the cost model column")
    ap.add_argument("--scenario", default="eight-poisson", help="whose length distribution to draw contexts from")
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, short contexts (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from modelpool.measure import Calibration, hf_config, plan_for, shapes_for
    from pool.engines.base import GenRequest, SamplingParams
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile
    from sims.scenarios import scenario

    cuda = args.device.startswith("cuda")
    batches = tuple(int(b) for b in args.batches.split(","))
    shapes = shapes_for(cuda, quick=True)
    if cuda:  # KV of 64 requests of up to 8k tokens fits an 80 GB card beside these weights
        shapes = {k: v for k, v in shapes.items() if k in ("qwen2.5-0.5b", "qwen2.5-3b")}
        longest = 12000
    else:
        shapes = dict(list(shapes.items())[:2])
        longest = 90
    spec = scenario(args.scenario)
    load = spec.workload(4.0, 60.0, args.seed, None)
    raw = (load.input_tokens + load.output_tokens // 2).astype(int)
    ctx = np.minimum(raw, longest) if cuda else np.maximum(4, raw * longest // max(1, int(raw.max())))
    rng = np.random.default_rng(args.seed)
    drawn = {b: [int(x) for x in rng.choice(ctx, size=b)] for b in batches}
    plan = dataclasses.replace(plan_for(cuda, quick=True), decode_batches=batches, decode_contexts=(int(max(ctx)),),
                               prefill_lengths=(min(256, longest),), kv_batches=(1,), kv_contexts=(16,))
    cal = Calibration(shapes, args.device, plan, seed=args.seed)
    for name, arch in shapes.items():
        cal.images[name] = cal.cache.add_random(name, hf_config(arch), cal.dtype, seed=args.seed, device=cal.device)
    # KV for the longest batch drawn (one batch is held at a time), not plan.decode_contexts' longest for every row
    cal.engine = cal._engine(cal.kv_bytes_for(max(sum(lengths) for lengths in drawn.values())
                                              + max(batches) * (2 * args.steps + 40)))
    if cuda:
        cal.engine.warm_up(int(max(ctx)) + 64)  # every (batch, width) graph the steps below replay
    engine = cal.engine
    profile = load_profile(args.profile) if args.profile else None
    gpu = profile.calibration.gpu if profile is not None and profile.calibration is not None else "h100"
    cost = RooflineCostModel.for_models({k: (a, 1) for k, a in shapes.items()}, gpu, profile)
    ids = 0

    def admit(name: str, lengths: list[int]) -> list[str]:
        nonlocal ids
        out = []
        for length in sorted(lengths):
            ids += 1
            prompt = rng.integers(0, shapes[name].vocab_size, int(length)).tolist()
            req = GenRequest(f"mix{ids}", name, prompt, SamplingParams(max_tokens=1 << 20, ignore_eos=True))
            engine.prefill([req])
            out.append(req.request_id)
        return out

    def timed(request_ids: list[str]) -> tuple[float, float]:
        """(median step synchronised, as calibrate times it; mean step of `steps` queued back to back)."""
        engine.decode_step(request_ids)
        each = [cal._timed(lambda: engine.decode_step(request_ids)) for _ in range(args.steps)]
        cal._sync()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.decode_step(request_ids)
        cal._sync()
        return statistics.median(each), (time.perf_counter() - started) / args.steps

    extra = engine.stats().extra
    print(f"graphs captured {extra.get('graph_captures')}; block widths {engine.config.graph_block_widths}")
    print(f"{'shape':14s} {'batch':>5s} {'ctx mean':>8s} {'ctx max':>7s} {'one len':>8s} {'mixed':>8s} "
          f"{'ratio':>6s} {'queued 1':>8s} {'queued m':>8s} {'model':>8s}")
    for name in shapes:
        engine.activate(name)
        for batch in batches:
            lengths = drawn[batch]
            mean = int(round(sum(lengths) / batch))
            results = {}
            for label, lens in (("one", [mean] * batch), ("mixed", lengths)):
                request_ids = admit(name, [max(1, n - 2 * args.steps - 4) for n in lens])
                results[label] = timed(request_ids)
                engine.release(request_ids)
            model = cost.decode_step_s(name, batch, mean * batch)
            (one, one_q), (mixed, mixed_q) = results["one"], results["mixed"]
            print(f"{name:14s} {batch:5d} {mean:8d} {max(lengths):7d} {one * 1e3:7.3f}m {mixed * 1e3:7.3f}m "
                  f"{mixed / one:6.2f} {one_q * 1e3:7.3f}m {mixed_q * 1e3:7.3f}m {model * 1e3:7.3f}m", flush=True)
    extra = engine.stats().extra
    print(f"graph replays {extra.get('graph_replays')}, misses {extra.get('graph_misses')}")


if __name__ == "__main__":
    main()
