"""End to end: `modelpool serve` on one GPU, a multi-model Poisson trace through the gateway, live vs simulator.

    python benchmarks/gpu_pool.py --out DIR --backend processes --rate 1 --rate 6 --duration 90   # the GPU box
    python benchmarks/gpu_pool.py --tiny --out /tmp/gpu_pool --rate 2 --duration 15               # anywhere (CPU)

What it does, as a new user would:
1. builds random-weight models of real shapes (Qwen2.5 1.5B/3B/7B; `--tiny`: a few MB) as folders with a
   config, a tokenizer and `random_weights.json` (the engine generates the weights; nothing is downloaded),
   and a fleet file for them (`gpu:` this machine's GPU type, e.g. h200 or h100);
2. starts `modelpool serve --fleet ...` with the default layout for one GPU (token-level: one prefill and
   one decode instance sharing it) on the chosen backend;
3. replays a Poisson trace over the models (prompt and output lengths uniform, `ignore_eos`) through the
   gateway with streaming clients (`/v1/completions`, prompt token ids), recording per request its arrival,
   first token, every token's time and any error; saves the trace in the generic CSV;
4. reads `/pool/status` and `/metrics` (switches, graph captures and misses, engine step timings: prefill
   seconds by length, decode period vs forward, i.e. the host overhead per step), samples GPU utilisation;
5. after the server stops, times the engine's standalone prefill at the lengths the live pool ran (the
   1.25x target) and runs the simulator on the very trace, fleet and instance layout (`--profile`: a
   `modelpool calibrate` profile), and prints live and simulated side by side, per request and in aggregate.
Writes one JSON per (backend, rate) and a summary JSON under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_pool_calls import load as load_calls  # noqa: E402
from benchmarks.gpu_pool_calls import plan_summary, prefill_rounds, write_run  # noqa: E402
from benchmarks.gpu_pool_calls import call_gaps, load_kv, prefill_overlaps, run_kv_calls, switch_times, ttft_parts  # noqa: E402
from benchmarks.gpu_pool_sim import quantiles  # noqa: E402
from modelpool.replay import (fresh_status, free_port, per_request, replay, stop_server, wait_ready,  # noqa: E402,F401
                             word_tokenizer)
from modelpool.replay import start_server as serve_process  # noqa: E402
from scheduler.fleet import catalogue_arch, hf_shape  # noqa: E402

# Qwen2.5 shapes from the arch catalogue (scheduler/catalog.py), as Qwen2Config keys; "tiny" for CPU runs
QWEN = {size: hf_shape(catalogue_arch(f"qwen2.5-{size}")) for size in ("1.5b", "3b", "7b")} | {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=2048, tie_word_embeddings=False),
}
FLEET = [("m1-1.5b", "1.5b"), ("m2-1.5b", "1.5b"), ("m3-3b", "3b"), ("m4-3b", "3b"), ("m5-7b", "7b")]
TINY_FLEET = [(f"t{k}", "tiny") for k in range(1, 4)]
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.05  # Aegaeon-style tight SLOs (0.2x and 0.5x of its 10 s / 100 ms): the heavy load is where they fail


# ---- models and fleet ---------------------------------------------------------------------------------------
def build_models(folder: Path, fleet: list[tuple[str, str]], gpu: str, num_gpus: int = 1) -> Path:
    """Model folders (config, tokenizer, random_weights.json) and a fleet file; returns the fleet file."""
    from transformers import Qwen2Config

    from pool.engines.weights import RANDOM_WEIGHTS_FILE

    folder.mkdir(parents=True, exist_ok=True)
    lines = ["pool:", f"  gpu: {'h200' if gpu == 'cpu' else gpu}", f"  num_gpus: {num_gpus}", f"  gpus_per_node: {num_gpus}",
             "  host_kv_gb: 16",
             f"  default_slo: {{ttft_s: {TTFT_SLO_S}, tpot_s: {TPOT_SLO_S}}}", "models:"]
    for seed, (name, shape) in enumerate(fleet):
        target = folder / name
        target.mkdir(exist_ok=True)
        config = Qwen2Config(**QWEN[shape], max_position_embeddings=32768, rope_theta=1e6,
                             torch_dtype="bfloat16" if gpu != "cpu" else "float32")
        config.save_pretrained(target)
        word_tokenizer(QWEN[shape]["vocab_size"]).save_pretrained(target)
        (target / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))
        lines.append(f"  - {{name: {name}, arch: ./{name}, weights: ./{name}}}")
    path = folder / "fleet.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def this_gpu() -> str:
    """The catalogue key of this machine's GPU 0 (h100, h200, ...): the fleet's memory plan is cut from it."""
    from modelpool.gpus import gpu_key

    return gpu_key(None)


def make_trace(models: list[str], rate: float, duration_s: float, prompt: tuple[int, int], output: tuple[int, int],
               seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows, at = [], 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= duration_s:
            return rows
        rows.append({"timestamp_s": round(at, 4), "model": rng.choice(models),
                     "input_tokens": rng.randint(*prompt), "output_tokens": rng.randint(*output)})


def write_trace(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w") as f:
        f.write("timestamp_s,model,input_tokens,output_tokens\n")
        for r in rows:
            f.write(f"{r['timestamp_s']},{r['model']},{r['input_tokens']},{r['output_tokens']}\n")


# ---- the server ---------------------------------------------------------------------------------------------
def start_server(fleet: Path, backend: str, port: int, log_path: Path, extra: list[str],
                 prefix: list[str] = (), host_profile_s: float | None = None,
                 slow_call_ms: float | None = None) -> subprocess.Popen:
    calls = log_path.with_suffix(".calls")  # each instance's engine calls, timed (processes backend), at the end
    calls.mkdir(exist_ok=True)
    env = {"MODELPOOL_CALL_LOG_DIR": str(calls)}
    if host_profile_s:  # each engine process's host time, sampled, a report per window (pool.procs.HostProfile)
        env["MODELPOOL_HOST_PROFILE_S"] = str(host_profile_s)
    if slow_call_ms:  # the stacks of engine calls slower than this (pool.procs.SlowCalls)
        env["MODELPOOL_SLOW_CALL_MS"] = str(slow_call_ms)
    return serve_process(fleet, port, log_path, backend, extra, env, prefix)


class GpuSampler:
    """GPU utilisation (%) every 0.25 s through NVML, while running (nothing on a machine without it)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML here
            return self

        def run() -> None:
            while not self._stop.wait(0.25):
                self.samples.append((time.monotonic(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def mean(self, start: float, end: float) -> float | None:
        picked = [u for t, u in self.samples if start <= t <= end]
        return round(float(np.mean(picked)), 1) if picked else None


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of `pid`, of each process below it ('child <pid>') and of its busiest
    thread, from /proc (empty where there is none): a process near one second per second of wall time is
    bound by its GIL or its one event loop."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    out: dict[str, float] = {}
    try:
        out["process"] = stat(f"/proc/{pid}/stat")
        out["busiest_thread"] = max(stat(f"/proc/{pid}/task/{tid}/stat") for tid in os.listdir(f"/proc/{pid}/task"))
        todo = [pid]
        while todo:
            parent = todo.pop()
            for tid in os.listdir(f"/proc/{parent}/task"):
                for child in Path(f"/proc/{parent}/task/{tid}/children").read_text().split():
                    out[f"child {child}"] = stat(f"/proc/{child}/stat")
                    todo.append(int(child))
    except (OSError, ValueError, IndexError):  # no /proc, or a process gone meanwhile
        pass
    return out


def cpu_use(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each process (and the serve process's busiest thread) kept busy between two `cpu_seconds`."""
    return {key: round((after[key] - before.get(key, 0.0)) / seconds, 3) for key in after if seconds > 0}


# ---- the replay ---------------------------------------------------------------------------------------------
def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    served = [r for r in rows if r["served"]]
    tpots = [r["tpot_s"] for r in served if r.get("tpot_s") is not None]
    itls = [x for r in served for x in r.get("itl_s", [])]
    attained = [r for r in served if r["ttft_s"] <= TTFT_SLO_S and (r.get("tpot_s") or 0) <= TPOT_SLO_S]
    return {"requests": len(rows), "served": len(served), "failed": len(rows) - len(served),
            "ttft_s": quantiles([r["ttft_s"] for r in served]), "tpot_s": quantiles(tpots), "itl_s": quantiles(itls),
            "slo_attainment": round(len(attained) / len(rows), 4) if rows else None}


# ---- one live run -------------------------------------------------------------------------------------------
LAYOUTS = {"pd": None, "mixed": 1}  # the default for one GPU (1 prefill + 1 decode instance), one mixed instance


def run_tag(backend: str, layout: str, rate: float) -> str:
    return f"{backend}-{layout}-r{rate:g}"


def live_runs(args: argparse.Namespace, fleet: Path, backend: str, layout: str, out_dir: Path) -> list[dict[str, Any]]:
    """One server for the (backend, layout); each rate's trace replayed on it in turn (lightest first)."""
    import httpx

    names = [name for name, _ in (TINY_FLEET if args.tiny else FLEET)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out_dir / f"serve-{backend}-{layout}.log"
    layout_args = [] if LAYOUTS[layout] is None else ["--instances", str(LAYOUTS[layout])]
    prefix = [part.replace("{tag}", f"{backend}-{layout}") for part in shlex.split(args.serve_prefix)]
    proc = start_server(fleet, backend, port, log_path, layout_args + args.serve_arg, prefix, args.host_profile_s,
                        args.slow_call_ms)
    results = []
    try:
        ready_s = wait_ready(url, proc, args.start_timeout)
        repeats: dict[float, int] = {}  # a rate given twice replays its trace again: run-...-r22-2.json
        for rate in sorted(args.rate):
            print(f"== {backend} {layout} at {rate:g} req/s", flush=True)
            rows = make_trace(names, rate, args.duration, args.prompt, args.output, args.seed)
            repeats[rate] = repeats.get(rate, 0) + 1
            tag = run_tag(backend, layout, rate) + (f"-{repeats[rate]}" if repeats[rate] > 1 else "")
            trace_path = out_dir / f"trace-{tag}.csv"
            write_trace(rows, trace_path)
            before = fresh_status(url)
            with GpuSampler() as gpu:
                cpu_before, client_before = cpu_seconds(proc.pid), time.process_time()
                started = time.monotonic()
                replayed, t0 = asyncio.run(replay(url, rows, args.prompt_vocab, args.seed, args.request_timeout))
                ended = time.monotonic()
                cpu = cpu_use(cpu_before, cpu_seconds(proc.pid), ended - started)
                cpu["client (this process)"] = round((time.process_time() - client_before) / (ended - started), 3)
            status = fresh_status(url)  # once every engine's stats are from after the run (asked every 2 s)
            metrics_text = httpx.get(f"{url}/metrics", timeout=30).text
            result = phase_result(backend, layout, rate, args, before, status, metrics_text, replayed,
                                  ended - started, gpu.mean(started, ended), trace_path.name)
            result["ready_s"] = round(ready_s, 1)
            result["tag"] = tag
            result["replay_t0_monotonic"] = round(t0, 6)  # requests' sent_s / first_s + this: the call logs' clock
            result["plans_range"] = [before["plans"], status["plans"]]  # its lines of the plan log (one a Plan)
            result["cpu_cores"] = cpu  # the serve process, its engine processes, the replaying client
            # the serve arguments, and whether its engine processes ran as MPS clients (the banner says so)
            result["serve_args"] = list(args.serve_arg)
            result["mps"] = "their engine processes are clients of a" in log_path.read_text(errors="replace")
            results.append(result)
            print(f"   {json.dumps(result['aggregate'])}", flush=True)
            print(f"   cpu cores: {json.dumps(cpu)}", flush=True)
            write_run(out_dir / f"run-{tag}.json", result)
            if proc.poll() is not None:
                break
    finally:
        stop_server(proc)
    plans = log_path.with_suffix(".plans.jsonl")
    if plans.exists():  # complete once the server stopped: what each run's Plans ordered (gpu_pool_sim.py's `plans`)
        lines = plans.read_text().splitlines()
        for result in results:
            start, end = result["plans_range"]
            result["plan_summary"] = plan_summary(lines[start:end])
            # the lines before the run say which model each instance held as it began
            result["prefill_rounds"] = prefill_rounds(lines[:end], first=start)
    if any(log_path.with_suffix(".calls").glob("calls-*.json")):  # written as the engine processes stopped
        logs, kv_logs = load_calls(log_path.with_suffix(".calls")), load_kv(log_path.with_suffix(".calls"))
        for result in results:  # each request's TTFT split: admission, queue and switch, prefill, delivery
            result["ttft_parts"] = ttft_parts(logs, result)
            result["prefill_overlap"] = prefill_overlaps(logs, result)  # each prefill sample beside decode steps
            result["kv_calls"] = run_kv_calls(kv_logs, result)  # each KV call: method, requests, seconds
            result["call_gaps"] = call_gaps(logs, result)  # the host between two calls, by the pair of methods
            if plans.exists():  # each Switch's activate, by model (gpu_pool_sim.py: beside the simulator's)
                start, end = result["plans_range"]
                result["switch_times"] = switch_times(lines, logs, start, end)
    return results


def phase_result(backend: str, layout: str, rate: float, args: argparse.Namespace, before: dict, status: dict,
                 metrics_text: str, replayed: list[dict], replay_s: float, gpu_util: float | None,
                 trace_name: str) -> dict[str, Any]:
    rows_out = per_request(replayed)
    engines = {iid: {"engine": info.get("engine", {}), "extra": info.get("engine_extra", {})}
               for iid, info in status["instances"].items()}
    old = {iid: {"engine": info.get("engine", {}), "extra": info.get("engine_extra", {})}
           for iid, info in before["instances"].items()}

    def delta(part: str, key: str) -> dict[str, Any]:
        return {iid: (e[part].get(key) or 0) - (old.get(iid, {}).get(part, {}).get(key) or 0)
                for iid, e in engines.items()}

    def call_seconds(iid: str) -> dict[str, dict[str, float]]:
        """This run's engine calls of one instance by method: how many, seconds inside the engine."""
        now = engines[iid]["extra"].get("timings", {}).get("calls") or {}
        then = old.get(iid, {}).get("extra", {}).get("timings", {}).get("calls") or {}
        out = {}
        for method, figures in now.items():
            was = then.get(method, {})
            if figures["calls"] > was.get("calls", 0):
                out[method] = {"calls": figures["calls"] - was.get("calls", 0),
                               "s": round(figures["s"] - was.get("s", 0.0), 4)}
        return out

    return {"backend": backend, "layout": layout, "rate_rps": rate, "duration_s": args.duration,
            "replay_s": round(replay_s, 1), "trace": trace_name, "aggregate": aggregate(rows_out),
            "gpu_util_mean": gpu_util, "switches_planned": (status.get("switches") or 0) - (before.get("switches") or 0),
            "restarts": status.get("restarts"), "lost_instances": status.get("lost_instances"),
            "switches_by_engine": delta("engine", "num_switches"), "switch_s_by_engine": delta("engine", "switch_s"),
            "bytes_h2d_by_engine": delta("engine", "bytes_h2d"), "bytes_d2h_by_engine": delta("engine", "bytes_d2h"),
            "weight_bytes_h2d_by_engine": delta("extra", "weight_bytes_h2d"),
            "kv_host_used_bytes": {iid: e["engine"].get("kv_host_used_bytes") for iid, e in engines.items()},
            "kv_host_bytes": {iid: e["engine"].get("kv_host_bytes") for iid, e in engines.items()},
            "graph_captures": {iid: e["extra"].get("graph_captures") for iid, e in engines.items()},
            "graph_capture_s": {iid: e["extra"].get("graph_capture_s") for iid, e in engines.items()},
            "graph_captures_after_warmup": delta("extra", "graph_captures"),
            "graph_misses": delta("extra", "graph_misses"), "graph_replays": delta("extra", "graph_replays"),
            "decode_timings": {iid: e["extra"].get("timings", {}).get("decode") for iid, e in engines.items()},
            # per model: what its decode step costs live, by batch (the cost model's decode terms to check against)
            "decode_timings_by_model": {iid: e["extra"].get("timings", {}).get("decode_by_model")
                                        for iid, e in engines.items()},
            # async decode: steps queued ahead of the host, and those a call other than their batch's threw away
            "decode_steps_ahead": delta("extra", "decode_steps_ahead"),
            "decode_steps_discarded": delta("extra", "decode_steps_discarded"),
            "alloc_retries": delta("extra", "alloc_retries"),
            "input_stage_grown": delta("extra", "input_stage_grown"),
            "prefill_samples": {iid: e["extra"].get("timings", {}).get("prefills") for iid, e in engines.items()},
            # KV calls in each engine (the P/D hand-off: export_kv on the prefill instance, import_kv on the decoder)
            "kv_timings": {iid: e["extra"].get("timings", {}).get("kv") for iid, e in engines.items()},
            # the collector's pauses in each engine process since start (under the call log: gc-<instance>.json)
            "gc_timings": {iid: e["extra"].get("timings", {}).get("gc") for iid, e in engines.items()},
            # every engine call by method since the engine started (calls, seconds inside the engine): where each
            # instance's time went; diff two runs of one serve for one run's share
            "call_timings": {iid: e["extra"].get("timings", {}).get("calls") for iid, e in engines.items()},
            "call_s_by_engine": {iid: call_seconds(iid) for iid in engines},  # this run's share of them
            "errors": sorted({str(r["error"])[:200] for r in rows_out if r["error"]})[:10],
            "requests": rows_out,
            "metrics_graph_lines": [line for line in metrics_text.splitlines() if line.startswith("modelpool_graph")]}


# ---- standalone engine prefill at the live lengths --------------------------------------------------------
def standalone_prefill(fleet_folder: Path, samples: list[list], device: str, reps: int = 3) -> dict[str, Any]:
    """Median seconds of the engine's own prefill for each (model, tokens, batch) the live pool ran."""
    import torch

    from modelpool.config import load_fleet
    from pool.engines.base import GenRequest, SamplingParams
    from pool.engines.torch_engine import TorchEngine, TorchEngineConfig

    # configured as `modelpool serve` configures the pool's engines (on a GPU: padded prefills, warmed up to the
    # pool's max_prefill_tokens), less the decode graphs
    warm = load_fleet(fleet_folder / "fleet.yaml").pool.max_prefill_tokens if device != "cpu" else 0
    engine = TorchEngine(TorchEngineConfig(device=device, kv_bytes=8 << 30 if device != "cpu" else 256 << 20,
                                           cuda_graphs=False, dtype=None if device != "cpu" else "float32",
                                           warm_prefill_tokens=warm))
    for name in sorted({s[0] for s in samples}):
        engine.load(name, fleet_folder / name)
    engine.warm_up()
    out, counter = {}, 0
    for model, tokens, batch in sorted({(s[0], s[1], s[2]) for s in samples}):
        engine.activate(model)
        per = max(1, tokens // batch)
        times = []
        for _ in range(reps + 1):
            ids = [f"sa{counter}-{i}" for i in range(batch)]
            counter += 1
            requests = [GenRequest(rid, model, tuple(range(10, 10 + per)), SamplingParams(max_tokens=2, ignore_eos=True))
                        for rid in ids]
            if device != "cpu":
                torch.cuda.synchronize()
            started = time.perf_counter()
            engine.prefill(requests)
            times.append(time.perf_counter() - started)
            engine.release(ids)
        # the first run of a length pays what a fresh length costs the engine (the live pool's case: each
        # prompt length is new); the median of the rest is the engine at its best
        out[f"{model}|{tokens}|{batch}"] = (times[0], float(np.median(times[1:])))
    engine.close()
    return out


def prefill_ratios(live: list[list], alone: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Live prefill seconds over the standalone engine's, against its first (fresh-length) run and its best."""
    picked = [(s[3], alone[f"{s[0]}|{s[1]}|{s[2]}"]) for s in live if f"{s[0]}|{s[1]}|{s[2]}" in alone]
    if not picked:
        return {"samples": 0}
    fresh = [t / a[0] for t, a in picked]
    best = [t / a[1] for t, a in picked]
    return {"samples": len(picked), "ratio_p50": round(float(np.median(fresh)), 3),
            "ratio_p90": round(float(np.percentile(fresh, 90)), 3),
            "ratio_vs_best_p50": round(float(np.median(best)), 3),
            "ratio_vs_best_p90": round(float(np.percentile(best, 90)), 3),
            "live_ms_p50": round(float(np.median([t for t, _ in picked])) * 1e3, 2),
            "standalone_fresh_ms_p50": round(float(np.median([a[0] for _, a in picked])) * 1e3, 2),
            "standalone_best_ms_p50": round(float(np.median([a[1] for _, a in picked])) * 1e3, 2),
            # per shape the engine's first run less its repeats: what a shape it had not run costs it on top
            "standalone_fresh_extra_ms_p50": round(float(np.median([a[0] - a[1] for _, a in picked])) * 1e3, 3)}


# ---- the simulator on the same trace ----------------------------------------------------------------------
def simulated(fleet_path: Path, trace_path: Path, profile: Path | None, tiny: bool, layout: str,
              num_gpus: int = 1) -> dict[str, Any]:
    """The simulator's per-request TTFT/TPOT for the trace, with the live pool's layout on `num_gpus` GPUs."""
    from benchmarks.gpu_pool_sim import simulate_live_layout

    return simulate_live_layout(fleet_path, trace_path, profile, cpu=tiny, num_instances=LAYOUTS[layout],
                                num_gpus=num_gpus)


def compare(live_rows: list[dict], sim_rows: dict[int, dict]) -> dict[str, Any]:
    """Per-request live/sim ratios (median, p10, p90) and log-correlation of TTFT and TPOT."""
    out: dict[str, Any] = {}
    for key in ("ttft_s", "tpot_s"):
        pairs = [(r[key], sim_rows[r["index"]][key]) for r in live_rows
                 if r["served"] and r.get(key) and sim_rows.get(r["index"], {}).get(key)]
        if len(pairs) < 3:
            out[key] = {"pairs": len(pairs)}
            continue
        live, sim = np.array(pairs).T
        ratio = live / sim
        out[key] = {"pairs": len(pairs), "ratio_p10": round(float(np.percentile(ratio, 10)), 3),
                    "ratio_p50": round(float(np.median(ratio)), 3), "ratio_p90": round(float(np.percentile(ratio, 90)), 3),
                    "log_corr": round(float(np.corrcoef(np.log(live), np.log(sim))[0, 1]), 3),
                    "live": quantiles(list(live)), "sim": quantiles(list(sim))}
    return out


# ---- main -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny models on CPU (a smoke run anywhere)")
    parser.add_argument("--backend", action="append", help="processes | threads | ray (repeatable)")
    parser.add_argument("--rate", type=float, action="append", help="req/s over all models (repeatable)")
    parser.add_argument("--layout", action="append", choices=sorted(LAYOUTS),
                        help="pd: the default one-GPU layout (a prefill and a decode instance); mixed: one instance")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of the box (2: the pd layout puts the prefill "
                        "instance on one and the decode instance on the other; the simulator is told the same)")
    parser.add_argument("--prompt", type=int, nargs=2, default=None, help="prompt tokens, uniform [lo, hi]")
    parser.add_argument("--output", type=int, nargs=2, default=None, help="output tokens, uniform [lo, hi]")
    parser.add_argument("--prompt-vocab", type=int, default=2000, help="prompt token ids drawn below this")
    parser.add_argument("--profile", type=Path, default=None, help="calibration profile for the simulator")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `modelpool serve` argument")
    parser.add_argument("--host-profile-s", type=float, help="processes backend: sample each engine process's host "
                        "time with pyinstrument, a text report per window of this many seconds beside the call logs")
    parser.add_argument("--slow-call-ms", type=float, help="processes backend: the stacks of engine calls that run "
                        "longer than this, sampled (slow-<instance>.json beside the call logs; quick calls untouched)")
    parser.add_argument("--serve-prefix", default="", help="a command the server runs under, e.g. a profiler "
                        "(`py-spy record -o /tmp/spy-{tag}.txt --format raw --`; {tag} is backend-layout)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--no-standalone", action="store_true", help="skip the standalone prefill timing")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator comparison")
    args = parser.parse_args(argv)
    args.backend = args.backend or ["processes"]
    args.rate = args.rate or [1.0]
    args.layout = args.layout or ["pd"]
    args.prompt = tuple(args.prompt or ((20, 200) if args.tiny else (200, 2000)))
    args.output = tuple(args.output or ((8, 32) if args.tiny else (64, 512)))
    args.out.mkdir(parents=True, exist_ok=True)
    fleet = build_models(args.out / "models", TINY_FLEET if args.tiny else FLEET, "cpu" if args.tiny else this_gpu(),
                         args.gpus)
    device = "cpu" if args.tiny else "cuda"
    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:], "runs": []}
    all_prefills: list[list] = []
    runs = []
    for backend, layout in [(b, lay) for b in args.backend for lay in args.layout]:
        try:
            results = live_runs(args, fleet, backend, layout, args.out)
        except Exception as exc:  # one failed server must not lose the others' results
            print(f"   failed: {exc!r}", flush=True)
            summary["runs"].append({"backend": backend, "layout": layout, "rate_rps": 0, "failed": repr(exc)})
            continue
        runs += results
        for result in results:
            for samples in result["prefill_samples"].values():
                all_prefills += samples or []
    alone = {} if args.no_standalone or not all_prefills else standalone_prefill(
        args.out / "models", all_prefills[-400:] if args.tiny else _spread(all_prefills, 60), device)
    for result in runs:
        samples = [s for v in result["prefill_samples"].values() for s in (v or [])]
        result["prefill_vs_standalone"] = prefill_ratios(samples, alone)
        if not args.no_sim:
            try:
                sim = simulated(fleet, args.out / result["trace"], args.profile, args.tiny, result["layout"], args.gpus)
                result["sim_aggregate"] = sim["aggregate"]
                result["fidelity"] = compare(result["requests"], sim["requests"])
                result["sim_switches"] = sim["switches"]
                result["sim_profile"] = sim["profile"]
                for row in result["requests"]:  # side by side, per request
                    row["sim_ttft_s"], row["sim_tpot_s"] = (sim["requests"].get(row["index"], {}).get(k)
                                                            for k in ("ttft_s", "tpot_s"))
            except Exception as exc:
                result["sim_error"] = repr(exc)
        write_run(args.out / f"run-{result['tag']}.json", result)
        summary["runs"].append({k: v for k, v in result.items() if k not in ("requests", "prefill_samples")})
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print_table(summary["runs"])
    return 0 if runs else 1


def _spread(samples: list[list], k: int) -> list[list]:
    """At most `k` samples spread over the (model, length) range."""
    ordered = sorted(samples, key=lambda s: (s[0], s[1]))
    step = max(1, len(ordered) // k)
    return ordered[::step][:k]


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"\n{'backend':16s} {'rate':>5s} {'served':>7s} {'fail':>5s} {'TTFT p50/p90/p99 ms':>22s} "
          f"{'TPOT p50/p90 ms':>16s} {'attain':>7s} {'gpu%':>5s} {'sw':>5s} {'capt+':>5s} {'miss':>5s} "
          f"{'pf x':>5s} {'host ms':>7s}")
    for r in runs:
        if "failed" in r:
            print(f"{r['backend'] + '/' + r['layout']:16s} {r['rate_rps']:5g} failed: {r['failed'][:80]}")
            continue
        a = r["aggregate"]
        ms = lambda q: "-" if q is None else f"{q * 1e3:.0f}"  # noqa: E731
        ttft = "/".join(ms(a["ttft_s"][p]) for p in ("p50", "p90", "p99"))
        tpot = "/".join(ms(a["tpot_s"][p]) for p in ("p50", "p90"))
        # the host time a step adds (issue 16's <= 0.5 ms, batch 1-32), on the instance that decoded most, over
        # the batch buckets of 20 steps or more
        decoder = max(r["decode_timings"].values(), key=lambda t: sum(b.get("steps", 0) for b in t.values()),
                      default={}) or {}
        overhead = [b.get("added_ms_p50", b.get("overhead_ms_p50")) for key, b in decoder.items()
                    if int(key.removeprefix("<=")) <= 32 and b.get("steps", 0) >= 20]
        print(f"{r['backend'] + '/' + r['layout']:16s} {r['rate_rps']:5g} {a['served']:7d} {a['failed']:5d} {ttft:>22s} {tpot:>16s} "
              f"{a['slo_attainment']:7.3f} {str(r['gpu_util_mean']):>5s} {str(r['switches_planned']):>5s} "
              f"{sum(r['graph_captures_after_warmup'].values()):5d} "
              f"{sum(v or 0 for v in r['graph_misses'].values()):5d} "
              f"{str(r.get('prefill_vs_standalone', {}).get('ratio_p50', '-')):>5s} "
              f"{str(max(overhead) if overhead else '-'):>7s}")
        fid = r.get("fidelity")
        if fid:
            for key in ("ttft_s", "tpot_s"):
                f = fid[key]
                if "ratio_p50" in f:
                    print(f"    {key} live/sim per request p10/p50/p90 {f['ratio_p10']}/{f['ratio_p50']}/"
                          f"{f['ratio_p90']}, log-corr {f['log_corr']}; live p50/p90/p99 "
                          f"{'/'.join(ms(f['live'][p]) for p in ('p50', 'p90', 'p99'))} ms, sim "
                          f"{'/'.join(ms(f['sim'][p]) for p in ('p50', 'p90', 'p99'))} ms")
        sim = r.get("sim_aggregate")
        if sim:
            print(f"    sim ({r['sim_profile']}) attainment {sim['slo_attainment']} (live {a['slo_attainment']}), "
                  f"switches {r['sim_switches']} (live {r['switches_planned']}); all requests: TTFT p50/p90/p99 "
                  f"{'/'.join(ms(sim['ttft_s'][p]) for p in ('p50', 'p90', 'p99'))} ms, TPOT "
                  f"{'/'.join(ms(sim['tpot_s'][p]) for p in ('p50', 'p90', 'p99'))} ms")


if __name__ == "__main__":
    raise SystemExit(main())
