"""Our simulator on Vidur's own kind of workload (issue 3, item 6), timed like Vidur's event loop.

Vidur (microsoft/vidur, MLSys'24) simulates one model's replicas. Its workload
here: one Llama-2-70B replica at TP2 on A100-80GB, Sarathi chunked prefill
(chunk 512 tokens, batch cap 128), the first 10,000 requests of the Azure 2023
conversation trace as Vidur ships it (data/processed_traces/splitwise_conv.csv,
our `vidur-conv`), arrivals stretched to 1 req/s, and Vidur's 4,096-token cap
(prompts cut so that prompt + output <= 4096, as its trace replay does).

Ours: the `dedicated` policy with `chunked_prefill_tokens=512`,
`max_batch_size=128` on one TP2 instance, the roofline cost model for
llama-2-70b on a100-80gb (default calibration profile: estimated, not
measured, on A100). Reported: wall time of the event loop, requests/s and
model iterations/s (every Decode step, mixed or not, counts one).

    OMP_NUM_THREADS=1 python benchmarks/vidur_compare.py [--repeat 3] [--write-vidur-trace PATH]

`--write-vidur-trace` writes the same 10k requests as a Vidur trace CSV
(`arrived_at,num_prefill_tokens,num_decode_tokens`) for
`python -m vidur.main --request_generator_config_type trace_replay
--trace_request_generator_config_trace_file PATH ...` (BENCHMARKS.md has the
full command). `--write-vidur-attention` writes a stand-in for Vidur's
data/profiling/compute/a100/meta-llama/Llama-2-70b-hf/attention.csv, which
the mirrored Vidur repository lacks: the same input grid as Vidur's attention
profiler (max_seq_len 4096, batch 1-128) with roofline times, so that Vidur
can train its predictors and run. It changes Vidur's simulated latencies a
little, not the work its event loop does per iteration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Vidur gives a replica 80 GiB x (1 - 0.1 margin) = 77.3e9 bytes per GPU: 0.966 of the catalogue's 80 GB
FLEET = """
pool: {gpu: a100-80gb, num_gpus: 2, gpus_per_node: 8, gpu_memory_utilization: 0.966, max_batch_size: 128}
models:
  - {name: llama-2-70b, arch: llama-2-70b, tp: 2}
"""
NUM_REQUESTS, RATE_RPS, MAX_TOKENS, CHUNK = 10_000, 1.0, 4096, 512


def comparison_workload():  # -> Workload
    """The first 10k requests of vidur-conv at 1 req/s, capped like Vidur's trace replay."""
    from sims.traces import load_workload

    workload = load_workload("vidur-conv", ["llama-2-70b"]).head(NUM_REQUESTS)
    workload = workload.scale_rate(RATE_RPS * float(workload.arrival_s[-1]) / len(workload))
    prompt = workload.input_tokens.astype(np.int64)
    output = workload.output_tokens.astype(np.int64)
    prompt = np.maximum(prompt - np.maximum(prompt + output - MAX_TOKENS, 0), 1)
    return dataclasses.replace(workload, input_tokens=prompt.astype(np.int32))


def run_once(workload) -> dict[str, float]:  # noqa: ANN001
    from modelpool.config import parse_fleet
    from sims.run import simulate

    fleet = parse_fleet(FLEET, "vidur_compare")
    result = simulate(fleet, workload, "dedicated", num_gpus=2, chunked_prefill_tokens=CHUNK)
    m = result.metrics
    return {"event_loop_s": result.sim_wall_s, "event_loop_cpu_s": result.sim_cpu_s, "metrics_s": result.metrics_wall_s,
            "iterations": result.num_decode_steps, "events": result.num_events, "completed": m["completed"],
            "failed": m["failed"], "p50_ttft_ms": m["p50_ttft_ms"], "p99_ttft_ms": m["p99_ttft_ms"],
            "p50_tpot_ms": m["p50_tpot_ms"], "p99_tpot_ms": m["p99_tpot_ms"], "gpu_busy_share": m["gpu_busy_share"],
            "makespan_s": m["duration"]}


def write_vidur_attention(path: Path) -> None:
    """Attention times (ms) for Llama-2-70B on A100-80GB at TP 1/2/4/8 on Vidur's profiling grid, by roofline:
    312 TFLOP/s bf16 at 55%, 2.04 TB/s at 70%, 8 us launch per kernel."""
    flops, bandwidth, launch = 312e12 * 0.55, 2.039e12 * 0.70, 8e-6
    chunks = [c for c in [*range(64, 129, 16), *range(128, 1025, 32), *range(1024, 4097, 64)] if c <= 4096]
    lengths = [n for n in [*range(0, 1025, 32), *range(1024, 4097, 64)] if n < 4096]
    grid = [(c, k, 1) for c in chunks for k in range(0, 4096 - c + 1, c)] + [(n, 0, 1) for n in lengths if n]
    grid += [(0, k, b) for k in lengths if k for b in range(1, 129)]
    columns = ["time_stats.attn_prefill.median", "time_stats.attn_decode.median", "time_stats.attn_kv_cache_save.median",
               "n_embd", "n_q_head", "n_kv_head", "block_size", "num_tensor_parallel_workers", "max_model_len",
               "batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill", "attention_backend"]
    with path.open("w") as out:
        out.write(",".join(columns) + "\n")
        for tp in (1, 2, 4, 8):
            q_heads, kv_bytes = 64 // tp, 2 * max(1, 8 // tp) * 128 * 2  # K and V, fp16, per token per layer
            for chunk, kv, batch in grid:
                if chunk:
                    attn = 4 * q_heads * 128 * chunk * (kv + chunk / 2) / flops + (kv + chunk) * kv_bytes / bandwidth
                    times = (attn + launch, 0.0, chunk * kv_bytes / bandwidth + 3e-6)
                else:
                    attn = batch * kv * kv_bytes / bandwidth + 4 * q_heads * 128 * batch * kv / flops
                    times = (0.0, attn + launch, batch * kv_bytes / bandwidth + 3e-6)
                row = [f"{t * 1e3:.6g}" for t in times] + ["8192", "64", "8", "16", str(tp), "4096", str(batch),
                                                           str(chunk), str(kv), str(bool(chunk)), "roofline"]
                out.write(",".join(row) + "\n")


def write_vidur_trace(workload, path: Path) -> None:  # noqa: ANN001
    with path.open("w") as out:
        out.write("arrived_at,num_prefill_tokens,num_decode_tokens\n")
        for at, num_in, num_out in zip(workload.arrival_s.tolist(), workload.input_tokens.tolist(),
                                       workload.output_tokens.tolist()):
            out.write(f"{at:.6f},{num_in},{num_out}\n")


def run_vidur(command: str) -> dict[str, float]:
    """Run Vidur through vidur_timed_main.py and return its VIDUR_TIMING figures."""
    done = subprocess.run(command, shell=True, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("VIDUR_TIMING ")]
    if done.returncode or not lines:
        raise SystemExit(f"vidur command failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    timing = json.loads(lines[-1].removeprefix("VIDUR_TIMING "))
    print(f"vidur: event loop {timing['event_loop_s']} s wall, {timing['event_loop_cpu_s']} s CPU, "
          f"{timing['batches']} iterations")
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs; the median is reported")
    parser.add_argument("--write-vidur-trace", type=Path, help="also write the workload as a Vidur trace CSV")
    parser.add_argument("--write-vidur-attention", type=Path, help="also write the stand-in attention.csv for Vidur")
    parser.add_argument("--vidur-event-loop-s", type=float, default=12.0,
                        help="Vidur's event-loop seconds on the same workload (default: the figure in issue 3)")
    parser.add_argument("--vidur-iterations", type=int, default=97_000,
                        help="Vidur's model iterations on the same workload (default: ~8.1k/s x 12 s, issue 3)")
    parser.add_argument("--vidur-label", default="issue 3's figure", help="where the Vidur numbers come from")
    parser.add_argument("--vidur-command", help="run Vidur now, side by side (a shell command ending in "
                        "benchmarks/vidur_timed_main.py and Vidur's options; BENCHMARKS.md has it), and use its timing")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/out/vidur_compare.json")
    args = parser.parse_args()
    workload = comparison_workload()
    if args.write_vidur_attention:
        write_vidur_attention(args.write_vidur_attention)
        print(f"wrote {args.write_vidur_attention}")
    if args.write_vidur_trace:
        write_vidur_trace(workload, args.write_vidur_trace)
        print(f"wrote {args.write_vidur_trace}")
    vidur_cpu_s = None
    if args.vidur_command:
        timing = run_vidur(args.vidur_command)
        args.vidur_event_loop_s, args.vidur_iterations = timing["event_loop_s"], timing["batches"]
        vidur_cpu_s = timing["event_loop_cpu_s"]
        args.vidur_label = "measured in this run"
    runs = [run_once(workload) for _ in range(args.repeat)]
    loop_s = statistics.median(r["event_loop_s"] for r in runs)
    ours = {**runs[0], "event_loop_s": loop_s, "event_loop_cpu_s": statistics.median(r["event_loop_cpu_s"] for r in runs),
            "requests_per_s": len(workload) / loop_s, "iterations_per_s": runs[0]["iterations"] / loop_s,
            "all_event_loop_s": [round(r["event_loop_s"], 3) for r in runs]}
    vidur = {"event_loop_s": args.vidur_event_loop_s, "event_loop_cpu_s": vidur_cpu_s,
             "requests_per_s": len(workload) / args.vidur_event_loop_s,
             "iterations_per_s": args.vidur_iterations / args.vidur_event_loop_s, "source": args.vidur_label}
    speedup = {"wall": ours["requests_per_s"] / vidur["requests_per_s"],
               "cpu": vidur_cpu_s / ours["event_loop_cpu_s"] if vidur_cpu_s else None}
    print(f"workload: {len(workload)} requests over {workload.duration_s:.0f} s, mean prompt "
          f"{workload.input_tokens.mean():.0f}, mean output {workload.output_tokens.mean():.0f} tokens")
    print(f"{'':8} {'event loop s':>12} {'requests/s':>11} {'iterations/s':>13}")
    for name, row in (("ours", ours), (f"vidur ({args.vidur_label})", vidur)):
        print(f"{name:8} {row['event_loop_s']:>12.2f} {row['requests_per_s']:>11,.0f} {row['iterations_per_s']:>13,.0f}")
    cpu = f", {speedup['cpu']:.1f}x by event-loop CPU time" if speedup["cpu"] else ""
    print(f"speed-up: {speedup['wall']:.1f}x requests/s{cpu}; ours: {ours['completed']} "
          f"completed, TTFT p50/p99 {ours['p50_ttft_ms']:.0f}/{ours['p99_ttft_ms']:.0f} ms, TPOT p50/p99 "
          f"{ours['p50_tpot_ms']:.1f}/{ours['p99_tpot_ms']:.1f} ms, busy {ours['gpu_busy_share']:.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "ours": ours, "vidur": vidur, "speedup": speedup,
                                    "command": " ".join(sys.argv)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
