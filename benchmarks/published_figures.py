"""The cost model against published measurements on GPUs we cannot run (issue 17, item 4).

Every row is a figure a public source states (URL in the row): a decode step
(TPOT) at a batch and context, a prefill (TTFT) at a prompt length, the time
to generate a fixed output after a prompt, or a model switch (vLLM sleep-mode
wake-up). For each the roofline (sims.costmodel, a shipped calibration
profile: `default` for CUDA-graph engines, `h200-eager` for eager ones)
predicts the same quantity on the catalogue GPU; the table gives published,
predicted and their ratio (predicted / published). Nothing here is fitted to
these rows: they are a second check of efficiencies measured on one H200 and
carried to other GPUs by their datasheet figures.

Quantities (times in seconds; what each source's figure means, as the source states it):
- tpot: mean decode step over output - 1 steps, batch requests, context batch * (input + 1) growing
  (as `modelpool estimate`); published TPOT excludes the first token.
- ttft: prefill of one prompt of `input` tokens alone (published TTFT also holds queueing and HTTP time).
- e2e: prefill of the batch + output - 1 decode steps (a whole batch-1 or batch-B generation).
- switch: copy the weights from pinned host memory (vLLM sleep level 1 wake-up copies them back).

    python benchmarks/published_figures.py [--out benchmarks/out/published_figures.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scheduler.catalog import ARCHS  # noqa: E402
from scheduler.fleet import GPUS, Arch  # noqa: E402
from sims.costmodel import RooflineCostModel  # noqa: E402
from sims.profiles import load_profile  # noqa: E402

Quantity = Literal["tpot", "ttft", "e2e", "switch"]
Mode = Literal["cuda-graphs", "eager"]

# Shapes the catalogue lacks, from the models' published config.json.
EXTRA_ARCHS: dict[str, dict[str, object]] = {
    "qwen3-0.6b": dict(family="qwen3", num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, tie_embeddings=True, max_context=40960),
    "qwen3-235b-a22b-fp8": dict(family="qwen3_moe", num_layers=94, hidden_size=4096, num_heads=64, num_kv_heads=4,
                                head_dim=128, intermediate_size=1536, num_experts=128, experts_per_token=8,
                                vocab_size=151936, total_params=235e9, dtype="fp8", max_context=40960),
}
PROFILE_FOR_MODE: dict[Mode, str] = {"cuda-graphs": "default", "eager": "h200-eager"}

TT_A100 = "https://github.com/tenstorrent/tt-inference-server/issues/340"
TT_H100 = "https://github.com/tenstorrent/tt-inference-server/issues/143"
QWEN3_SPEED = ("https://github.com/QwenLM/Qwen2.5/blob/ac7272455d45483d2f579a88295e81586d60ff6f/"
               "docs/source/getting_started/speed_benchmark.md")
QWEN25_SPEED = ("https://github.com/QwenLM/Qwen2.5/blob/010c37c33b13a1ac59944b349620e13404efe97d/"
                "docs/source/benchmark/speed_benchmark.rst")
SLEEP_BLOG = "https://blog.vllm.ai/2025/10/26/sleep-mode.html"
SLEEP_DATA = ("https://github.com/vllm-project/vllm-project.github.io/blob/93ea815ccd42d8da3041d01db835256c0f0c4d0c/"
              "assets/figures/2025-vllm-sleep-mode/plotly-switching-comparison.js")
VLLM_AWQ_EAGER = "https://github.com/vllm-project/vllm/issues/20469"
VLLM_CI = "https://buildkite.com/vllm/performance-benchmark/builds/9515"


@dataclass(frozen=True)
class Published:
    """One published figure, as its source states it."""

    id: str
    gpu: str  # catalogue key
    model: str  # catalogue arch key or EXTRA_ARCHS key
    tp: int
    engine: str
    mode: Mode
    quantity: Quantity
    batch: int
    input_tokens: int
    output_tokens: int
    figure: float  # the number in the source
    figure_unit: Literal["ms", "s", "tok/s"]  # tok/s: (input + output) / time, as the Qwen speed pages define it
    source: str
    note: str = ""

    def published_s(self) -> float:
        if self.figure_unit == "ms":
            return self.figure / 1e3
        if self.figure_unit == "s":
            return self.figure
        return (self.input_tokens + self.output_tokens) / self.figure


ROWS: tuple[Published, ...] = (
    # tenstorrent's GPU reference runs: vLLM on A100 / 2x H100, `vllm bench serve`, random prompts, concurrency 1
    Published("tt-a100-qwen3-1.7b-tpot", "a100-80gb", "qwen3-1.7b", 1, "vLLM", "cuda-graphs", "tpot", 1, 128, 128,
              4.6, "ms", TT_A100, "A100 variant not stated; vLLM defaults (CUDA graphs) assumed"),
    Published("tt-a100-qwen3-14b-tpot", "a100-80gb", "qwen3-14b", 1, "vLLM", "cuda-graphs", "tpot", 1, 128, 128,
              24.3, "ms", TT_A100, "A100 variant not stated"),
    Published("tt-a100-qwen3-30b-a3b-tpot", "a100-80gb", "qwen3-30b-a3b", 1, "vLLM", "cuda-graphs", "tpot", 1, 128, 128,
              9.6, "ms", TT_A100, "MoE, 8 of 128 experts a token"),
    Published("tt-a100-qwen3-30b-a3b-ttft", "a100-80gb", "qwen3-30b-a3b", 1, "vLLM", "cuda-graphs", "ttft", 1, 2048, 128,
              81.0, "ms", TT_A100, "MoE prefill"),
    Published("tt-h100-qwen2.5-72b-tpot", "h100", "qwen2.5-72b", 2, "vLLM", "cuda-graphs", "tpot", 1, 128, 128,
              30.9, "ms", TT_H100, "TP2; H100 variant not stated (SXM assumed)"),
    Published("tt-h100-qwen2.5-72b-ttft-1k", "h100", "qwen2.5-72b", 2, "vLLM", "cuda-graphs", "ttft", 1, 1024, 128,
              129.2, "ms", TT_H100, "TP2"),
    Published("tt-h100-qwen2.5-72b-ttft-8k", "h100", "qwen2.5-72b", 2, "vLLM", "cuda-graphs", "ttft", 1, 8192, 128,
              1063.8, "ms", TT_H100, "TP2"),
    # Qwen3 speed benchmark: one H20 96GB, batch 1, 2048 generated tokens, speed = (prompt + generated) / time
    Published("qwen-h20-qwen3-1.7b", "h20", "qwen3-1.7b", 1, "SGLang 0.4.6.post1", "cuda-graphs", "e2e", 1, 1, 2048,
              227.80, "tok/s", QWEN3_SPEED),
    Published("qwen-h20-qwen3-8b", "h20", "qwen3-8b", 1, "SGLang 0.4.6.post1", "cuda-graphs", "e2e", 1, 1, 2048,
              81.73, "tok/s", QWEN3_SPEED),
    Published("qwen-h20-qwen3-8b-6k", "h20", "qwen3-8b", 1, "SGLang 0.4.6.post1", "cuda-graphs", "e2e", 1, 6144, 2048,
              296.25, "tok/s", QWEN3_SPEED, "prefill of 6144 tokens + 2047 decode steps"),
    Published("qwen-h20-qwen3-32b", "h20", "qwen3-32b", 1, "SGLang 0.4.6.post1", "cuda-graphs", "e2e", 1, 1, 2048,
              20.72, "tok/s", QWEN3_SPEED),
    Published("qwen-h20-qwen3-30b-a3b", "h20", "qwen3-30b-a3b", 1, "SGLang 0.4.6.post1", "cuda-graphs", "e2e", 1, 1, 2048,
              137.18, "tok/s", QWEN3_SPEED, "MoE"),
    Published("qwen-h20-qwen3-8b-hf", "h20", "qwen3-8b", 1, "Transformers 4.51.3", "eager", "e2e", 1, 1, 2048,
              45.32, "tok/s", QWEN3_SPEED, "Hugging Face generate(), no CUDA graphs"),
    # Qwen2.5 speed benchmark: one A100 80GB, batch 1, 2048 generated tokens (input 1: prompt tokens are negligible)
    Published("qwen-a100-qwen2.5-7b", "a100-80gb", "qwen2.5-7b", 1, "vLLM 0.6.3", "cuda-graphs", "e2e", 1, 1, 2048,
              84.28, "tok/s", QWEN25_SPEED, "enforce_eager=False"),
    Published("qwen-a100-qwen2.5-14b", "a100-80gb", "qwen2.5-14b", 1, "vLLM 0.6.3", "cuda-graphs", "e2e", 1, 1, 2048,
              46.30, "tok/s", QWEN25_SPEED, "enforce_eager=False"),
    Published("qwen-a100-qwen2.5-14b-hf", "a100-80gb", "qwen2.5-14b", 1, "Transformers 4.46.0", "eager", "e2e", 1, 1, 2048,
              24.74, "tok/s", QWEN25_SPEED, "Hugging Face generate(), no CUDA graphs"),
    # a user's report: Qwen3-14B-AWQ with --enforce-eager on one A100 80GB, concurrency 1, 16000 in / 200 out
    Published("vllm20469-a100-qwen3-14b-awq-tpot", "a100-80gb", "qwen3-14b", 1, "vLLM 0.9.1", "eager", "tpot", 1, 16000, 200,
              20.63, "ms", VLLM_AWQ_EAGER, "AWQ int4 weights: the model has no int4 dtype and streams bf16 weights"),
    Published("vllm20469-a100-qwen3-14b-awq-ttft", "a100-80gb", "qwen3-14b", 1, "vLLM 0.9.1", "eager", "ttft", 1, 16000, 200,
              3345.37, "ms", VLLM_AWQ_EAGER, "AWQ int4 weights, 16k-token prompt"),
    # vLLM sleep mode (level 1: weights kept in pinned host memory), A100, vLLM 0.11.0: wake-up = weight copy back
    Published("sleep-a100-qwen3-0.6b", "a100-80gb", "qwen3-0.6b", 1, "vLLM 0.11.0", "cuda-graphs", "switch", 1, 0, 0,
              0.26, "s", SLEEP_BLOG, "level-1 wake, mean"),
    Published("sleep-a100-qwen3-coder-30b", "a100-80gb", "qwen3-30b-a3b", 1, "vLLM 0.11.0", "cuda-graphs", "switch", 1, 0, 0,
              2.867, "s", SLEEP_DATA, "Qwen3-Coder-30B-A3B (same shape); mean of 2.89, 2.86, 2.85 s"),
    Published("sleep-a100-qwen3-235b-fp8", "a100-80gb", "qwen3-235b-a22b-fp8", 4, "vLLM 0.11.0", "cuda-graphs", "switch",
              1, 0, 0, 5.407, "s", SLEEP_DATA, "FP8 weights, TP4; mean of 5.66, 5.29, 5.27 s"),
    # vLLM's own CI latency test on the H200 (the GPU the profile was measured on): batch 8, 32 in, 128 out
    Published("vllm-ci-h200-llama-3.1-8b", "h200", "llama-3.1-8b", 1, "vLLM (CI)", "cuda-graphs", "e2e", 8, 32, 128,
              833.421, "ms", VLLM_CI, "benchmark_latency mean; H200 is measured here, a cross-check"),
    Published("vllm-ci-h200-llama-3-70b", "h200", "llama-3.1-70b", 4, "vLLM (CI)", "cuda-graphs", "e2e", 8, 32, 128,
              2077.53, "ms", VLLM_CI, "Llama-3-70B (Llama-3.1-70B shape), TP4"),
)


def arch_of(model: str) -> Arch:
    return Arch.model_validate(EXTRA_ARCHS.get(model) or ARCHS[model])


def predict(row: Published) -> dict[str, Any]:
    """The cost model's figure for `row` (seconds) and what bounds it."""
    profile = load_profile(PROFILE_FOR_MODE[row.mode])
    costs = RooflineCostModel.for_models({row.model: (arch_of(row.model), row.tp)}, row.gpu, profile)
    m, batch = row.model, row.batch
    context = batch * (row.input_tokens + 1)
    steps = max(row.output_tokens - 1, 1)
    if row.quantity == "tpot":
        seconds = costs.decode_turn_s(m, batch, context, steps) / steps
    elif row.quantity == "ttft":
        seconds = costs.prefill_s(m, row.input_tokens, 1)
    elif row.quantity == "e2e":
        seconds = costs.prefill_s(m, batch * row.input_tokens, batch) + costs.decode_turn_s(m, batch, context, steps)
    else:
        seconds = costs.switch_s(m)
    bound = costs.decode_bound(m, batch, context) if row.quantity in ("tpot", "e2e") else ""
    return {"predicted_s": seconds, "profile": profile.name, "decode_bound": bound, "terms": profile.bases(row.gpu)}


def run() -> list[dict[str, Any]]:
    out = []
    for row in ROWS:
        published = row.published_s()
        prediction = predict(row)
        out.append({**asdict(row), "published_s": published, **prediction,
                    "ratio": prediction["predicted_s"] / published})
    return out


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def render(rows: list[dict[str, Any]]) -> str:
    head = "| row | GPU | model | TP | engine, mode | quantity | batch, in/out | published | predicted | pred/pub |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        shape = f"{r['batch']}, {r['input_tokens']}/{r['output_tokens']}" if r["quantity"] != "switch" else "-"
        figure = f"{r['figure']:g} {r['figure_unit']}" + ("" if r["figure_unit"] != "tok/s" else f" = {_fmt_s(r['published_s'])}")
        lines.append(f"| {r['id']} | {r['gpu'].upper()} | {r['model']} | {r['tp']} | {r['engine']}, {r['mode']} | "
                     f"{r['quantity']} | {shape} | {figure} | {_fmt_s(r['predicted_s'])} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio"] for r in rows]
    return {"rows": len(rows), "median_ratio": statistics.median(ratios),
            "within_25_percent": sum(0.75 <= x <= 1.25 for x in ratios),
            "by_quantity": {q: statistics.median([r["ratio"] for r in rows if r["quantity"] == q])
                            for q in sorted({r["quantity"] for r in rows})},
            "by_gpu": {g: statistics.median([r["ratio"] for r in rows if r["gpu"] == g])
                       for g in sorted({r["gpu"] for r in rows})}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "published_figures.json"))
    args = parser.parse_args(argv)
    rows = run()
    print(render(rows))
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": "python benchmarks/published_figures.py",
              "gpus": {g: GPUS[g].model_dump() for g in sorted({r["gpu"] for r in rows})},
              "summary": summary(rows), "rows": rows}
    s = result["summary"]
    print(f"\n{s['rows']} rows; median predicted/published {s['median_ratio']:.2f}; "
          f"{s['within_25_percent']} within 25%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
