"""Host time per decode step of the torch engine, by batch, with async decode off and on (CPU or GPU).

    OMP_NUM_THREADS=1 python benchmarks/decode_host.py [--batches 1 4 16 32] [--steps 200] [--out FILE]
    python benchmarks/decode_host.py --device cuda --hidden 896 --layers 24 --vocab 151936 --outside-ms 0.4

A tiny random-weight Qwen2 model (so the forward is short and the host's share shows) with the word
tokenizer of benchmarks/gpu_pool.py (every token decodes to text, as in the GPU pool run). Per batch and
mode: B greedy requests (ignore_eos) are prefilled, then the same batch is decoded `--steps` times back
to back, as a Decode turn does. The figures are the engine's own step timings (`StepTimings`, what
/pool/status reports in the live pool): period (call to call), forward (CUDA events on a GPU, the host
clock on CPU), host = period - forward, and in-engine = time inside `decode_step`. A second pass times the
parts of the engine's host work: building the step's inputs (`decode_inputs`) and emitting tokens
(`Stepper.emit`: token lists, detokenising, stop checks).

On CPU every op runs synchronously, so async decode cannot hide anything there: its "on" rows show that
the step launched ahead costs the host no more than the plain path. On a GPU the host work of one step
overlaps the next step's forward, so period approaches forward. `--outside-ms` spends that much host time
(a busy loop) between calls, standing in for what the live pool does between two steps (pickling the
tokens, the pipe, the controller's tick): async decode hides it too, while the forward is longer.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_pool import word_tokenizer  # noqa: E402

from pool.engines import step  # noqa: E402
from pool.engines.base import GenRequest, SamplingParams  # noqa: E402
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from pool.engines.weights import HostWeightCache  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, vocab_size=4096)  # the default tiny model
PROMPT = 32  # prompt tokens of each request
COLUMNS = [("batch", "batch"), ("async_decode", "async"), ("period_ms", "period ms"), ("forward_ms", "forward ms"),
           ("host_ms", "host ms"), ("in_engine_ms", "in-engine ms"), ("inputs_ms", "inputs ms"),
           ("emit_ms", "emit ms")]


def make_engine(device: str, async_decode: bool, shape: dict[str, int], max_tokens: int) -> TorchEngine:
    """The engine with the model active and its graphs captured; KV for `max_tokens` tokens (at least)."""
    from transformers import Qwen2Config

    cache = HostWeightCache(pin=device.startswith("cuda"))
    torch.manual_seed(0)
    vocab = shape["vocab_size"]
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
    image = cache.add_random("tiny", config, torch.bfloat16 if device.startswith("cuda") else torch.float32,
                             device=torch.device(device))
    kv_bytes = max(64 << 20, 2 * max_tokens * image.spec.num_layers * 2 * image.spec.num_kv_heads
                   * image.spec.head_dim * image.dtype.itemsize)
    engine = TorchEngine(TorchEngineConfig(device=device, async_decode=async_decode, kv_bytes=kv_bytes),
                         weight_cache=cache)
    engine.add_image(image, word_tokenizer(vocab))
    engine.activate("tiny")
    engine.warm_up(2048)
    return engine


def run(engine: TorchEngine, batch: int, steps: int, tag: str, outside_s: float = 0.0) -> list[str]:
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    requests = [GenRequest(f"{tag}-{i}", "tiny", [(7 * i + j) % 1000 + 2 for j in range(PROMPT)], params)
                for i in range(batch)]
    engine.prefill(requests)
    ids = [r.request_id for r in requests]
    for _ in range(steps):
        engine.decode_step(ids)
        until = time.perf_counter() + outside_s
        while time.perf_counter() < until:  # host work between two calls, as the live pool's
            pass
    engine.release(ids)
    return ids


class PartTimer:
    """Host seconds spent in `decode_inputs` and `Stepper.emit` (wrapped while it is installed)."""

    def __init__(self) -> None:
        self.inputs_s = self.emit_s = 0.0
        self._inputs, self._emit = step.decode_inputs, step.Stepper.emit

    def __enter__(self) -> PartTimer:
        def inputs(*args, **kwargs):
            started = time.perf_counter()
            try:
                return self._inputs(*args, **kwargs)
            finally:
                self.inputs_s += time.perf_counter() - started

        def emit(engine, *args, **kwargs):
            started = time.perf_counter()
            try:
                return self._emit(engine, *args, **kwargs)
            finally:
                self.emit_s += time.perf_counter() - started

        step.decode_inputs, step.Stepper.emit = inputs, emit
        return self

    def __exit__(self, *exc: object) -> None:
        step.decode_inputs, step.Stepper.emit = self._inputs, self._emit


def measure(device: str, batches: list[int], steps: int, shape: dict[str, int], outside_s: float) -> list[dict]:
    rows = []
    for async_decode in (False, True):
        engine = make_engine(device, async_decode, shape, max(batches) * (PROMPT + steps + 8))
        run(engine, 4, 8, "warm")
        for batch in batches:
            engine.timings.clear_decodes()
            run(engine, batch, steps, f"b{batch}", outside_s)
            figures = engine.timings.summary()["decode"]
            (bucket,) = [f for f in figures.values()]
            with PartTimer() as parts:
                run(engine, batch, steps, f"p{batch}")
            rows.append({"batch": batch, "async_decode": async_decode, "steps": bucket["steps"],
                         "period_ms": bucket["period_ms_p50"], "forward_ms": bucket["forward_ms_p50"],
                         "host_ms": bucket["overhead_ms_p50"], "host_ms_p90": bucket["overhead_ms_p90"],
                         "in_engine_ms": bucket["in_engine_ms_p50"],
                         "inputs_ms": round(parts.inputs_s / steps * 1e3, 4),
                         "emit_ms": round(parts.emit_s / steps * 1e3, 4)})
        extra = engine.stats().extra
        print(f"async_decode={async_decode}: {extra['decode_steps_ahead']} steps launched ahead, "
              f"{extra['decode_steps_discarded']} discarded", flush=True)
        engine.close()
    return rows


def print_table(rows: list[dict]) -> None:
    print(" | ".join(title for _, title in COLUMNS))
    for row in rows:
        print(" | ".join(str(row[key]) for key, _ in COLUMNS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=SHAPE["vocab_size"])
    parser.add_argument("--hidden", type=int, default=SHAPE["hidden_size"], help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--outside-ms", type=float, default=0.0, help="host time spent between two calls")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "decode_host.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    heads = max(1, args.hidden // 64)  # heads of 64, two KV heads where they divide
    shape = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": heads,
             "num_key_value_heads": 2 if heads % 2 == 0 else 1, "intermediate_size": 2 * args.hidden,
             "vocab_size": args.vocab}
    rows = measure(args.device, args.batches, args.steps, shape, args.outside_ms / 1e3)
    print_table(rows)
    result = {"device": args.device, "torch": torch.__version__, "machine": platform.machine(),
              "processor": platform.processor(), "model": shape, "outside_ms": args.outside_ms,
              "steps": args.steps, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
