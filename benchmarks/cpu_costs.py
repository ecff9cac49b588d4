"""What `modelpool.cpu_costs.CpuCosts` claims vs what the torch engine takes on this CPU, for the demo's models.

    OMP_NUM_THREADS=1 python benchmarks/cpu_costs.py [--prompts 32 128 512] [--batches 1 4 16] [--context 128]
                                                      [--repeats 3] [--steps 20] [--out FILE]

The demo deployment (`modelpool.deploy.demo_deployment`, `modelpool serve` without a GPU) plans its CPU slots
with CpuCosts: float32 torch engines, one core each (OMP_NUM_THREADS=1, as each slot process runs). This loads
the demo's models (SmolLM2-135M where installed, and the tiny random models) into one such engine, as
the deployment configures it, and times:

- prefill: one request of N prompt tokens (`Engine.prefill`), best of `--repeats`, vs `CpuCosts.prefill_s`;
- decode: B requests of `--context` tokens each decoded together (`Engine.decode_step`), the median of
  `--steps` steps, vs `CpuCosts.decode_step_s(model, B, B * context)` (the scheduler passes the batch's
  total context).

It prints one table (claimed, measured, claimed / measured: above 1 = CpuCosts overestimates) and writes
the rows as JSON with `--out`. The figures are wall-clock on a shared machine: run it when the machine is
quiet, and read ratios, not digits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from modelpool.cpu_costs import CpuCosts  # noqa: E402
from modelpool.deploy import CPU_SLOT_KV_BYTES  # noqa: E402
from pool.demo import build_demo_models, default_cache_dir  # noqa: E402
from pool.engines.base import GenRequest, SamplingParams  # noqa: E402
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from pool.service import served_model  # noqa: E402


def measure(engine: TorchEngine, model: str, vocab: int, prompts: list[int], batches: list[int], context: int,
            repeats: int, steps: int) -> list[dict]:
    engine.activate(model)
    rows: list[dict] = []
    ids = iter(range(10**9))

    def request(num_tokens: int, max_tokens: int) -> GenRequest:
        k = next(ids)
        tokens = [(7 + 13 * k + 31 * i) % (vocab - 10) + 5 for i in range(num_tokens)]
        return GenRequest(f"{model}-{k}", model, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    warm = request(16, 2)
    engine.prefill([warm])  # warm-up: first-call costs out of the way
    engine.release([warm.request_id])
    for n in prompts:
        times = []
        for _ in range(repeats):
            req = request(n, 2)
            start = time.perf_counter()
            engine.prefill([req])
            times.append(time.perf_counter() - start)
            engine.release([req.request_id])
        rows.append({"model": model, "kind": "prefill", "tokens": n, "batch": 1, "measured_s": min(times)})
    for b in batches:
        reqs = [request(context, steps + 2) for _ in range(b)]
        engine.prefill(reqs)
        rid = [r.request_id for r in reqs]
        engine.decode_step(rid)  # warm-up step
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.decode_step(rid)
            times.append(time.perf_counter() - start)
        engine.release(rid)
        rows.append({"model": model, "kind": "decode", "tokens": context, "batch": b,
                     "measured_s": statistics.median(times)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="*", help="a subset of the demo's models (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    folders = build_demo_models(default_cache_dir())
    names = [m for m in folders if not args.models or m in args.models]
    models = [served_model(name, folders[name], dtype="float32") for name in names]
    costs = CpuCosts({m.name: m.profile for m in models})
    engine = TorchEngine(TorchEngineConfig(dtype="float32", kv_bytes=CPU_SLOT_KV_BYTES))
    rows: list[dict] = []
    for m in models:  # all loaded first: the model slot is sized by the largest (as in the demo's instances)
        engine.load(m.name, folders[m.name])
    for m in models:
        vocab = len(engine.tokenizer(m.name))
        rows += measure(engine, m.name, vocab, args.prompts, args.batches, args.context, args.repeats, args.steps)
        engine.deactivate(m.name)
    for row in rows:
        model, n, b = row["model"], row["tokens"], row["batch"]
        row["claimed_s"] = (costs.prefill_s(model, n) if row["kind"] == "prefill"
                            else costs.decode_step_s(model, b, b * n))
        row["ratio"] = row["claimed_s"] / row["measured_s"]
    print(f"CpuCosts vs the torch engine on {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; ratio = claimed / measured")
    print(f"{'model':<16} {'step':<8} {'tokens':>6} {'batch':>5} {'claimed ms':>11} {'measured ms':>12} {'ratio':>6}")
    for row in rows:
        print(f"{row['model']:<16} {row['kind']:<8} {row['tokens']:>6} {row['batch']:>5} "
              f"{row['claimed_s'] * 1e3:>11.1f} {row['measured_s'] * 1e3:>12.1f} {row['ratio']:>6.2f}")
    if args.out:
        args.out.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                        "context": args.context, "rows": rows}, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
