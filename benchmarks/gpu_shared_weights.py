"""Issue 35's 7B fleet on one 80 GB GPU: `modelpool serve` with its default layout, each model once per GPU.

    python benchmarks/gpu_shared_weights.py --out DIR                          # the GPU box (~3 min)
    python benchmarks/gpu_shared_weights.py --tiny --out DIR --duration 10     # anywhere (CPU: tiny models)

1. builds eight random-weight models of real shapes, 1.5B-7B (qwen2.5, qwen3, llama; ~61 GB of bf16 weights)
   and a fleet file for one `gpu: h100` (modelpool.validate.build_fleet; nothing is downloaded);
2. serves it with `modelpool serve --fleet` and its default layout (token-level: a prefill and a decode
   instance sharing the GPU, mapping one shared weights region: pool.engines.shared_weights);
3. replays Poisson arrivals over the models (Zipf popularity) through the gateway as streaming clients;
4. records requests served and failed, switches (the pool's and each engine's, with the weight copies they
   made), each instance's resident models over the run (/pool/status, polled) and the GPU's peak memory in
   use (nvidia-smi). The pool plans memory for the fleet file's h100 (80 GB at its 0.9 utilisation); on a
   larger GPU the peak in use says whether the pool stayed within an 80 GB card.
Writes DIR/shared_weights.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modelpool.replay import free_port, per_request, replay, start_server, stop_server, wait_ready  # noqa: E402
from modelpool.validate import build_fleet  # noqa: E402
from sims.scenarios import FleetSpec  # noqa: E402

FLEET = FleetSpec("issue35", "8 models, 1.5B-7B, qwen2.5/qwen3/llama shapes (~61 GB), Zipf(0.8)",
                  (("q1-1.5b", "qwen2.5-1.5b"), ("q2-qwen3-1.7b", "qwen3-1.7b"), ("q3-3b", "qwen2.5-3b"),
                   ("q4-llama3b", "llama-3.2-3b"), ("q5-qwen3-4b", "qwen3-4b"), ("q6-7b", "qwen2.5-7b"),
                   ("q7-7b", "qwen2.5-7b"), ("q8-1.5b", "qwen2.5-1.5b")), zipf_s=0.8)


def gpu_memory_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return int(out[0]) if out else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


class Watcher:
    """Polls /pool/status and nvidia-smi once a second: the most models resident per instance, peak GPU memory."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.max_resident: dict[str, list[str]] = {}
        self.peak_mib = 0
        self.last: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import httpx

        while not self._stop.wait(1.0):
            try:
                self.last = httpx.get(f"{self.url}/pool/status", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                continue
            for iid, inst in self.last.get("instances", {}).items():
                resident = list(inst.get("engine", {}).get("resident_models") or ())
                if len(resident) > len(self.max_resident.get(iid, [])):
                    self.max_resident[iid] = resident
            self.peak_mib = max(self.peak_mib, gpu_memory_used_mib() or 0)


def workload(rate: float, duration_s: float, seed: int, prompt: tuple[int, int], output: tuple[int, int],
             names: tuple[str, ...], weights: np.ndarray) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows, at = [], 0.0
    while True:
        at += rng.exponential(1.0 / rate)
        if at > duration_s:
            return rows
        rows.append({"timestamp_s": at, "model": str(rng.choice(names, p=weights)),
                     "input_tokens": int(rng.integers(prompt[0], prompt[1] + 1)),
                     "output_tokens": int(rng.integers(output[0], output[1] + 1))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny models of the same families (CPU smoke run)")
    parser.add_argument("--rate", type=float, default=2.0, help="req/s over all models")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--prompt", type=int, nargs=2, default=(200, 2000))
    parser.add_argument("--output", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--backend", default="threads", help="threads: one host weight cache for both engines "
                        "(two engine processes would pin the 61 GB of host images twice)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `modelpool serve` argument")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fleet = build_fleet(FLEET, args.out / "models", "h100", tiny=args.tiny)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.out / "serve.log"
    started = time.monotonic()
    proc = start_server(fleet, port, log, backend=args.backend, extra=args.serve_arg)
    result: dict[str, Any] = {"fleet": FLEET.description, "models": dict(FLEET.models), "rate": args.rate,
                              "duration_s": args.duration, "backend": args.backend, "gpu_plan": "h100 (80 GB)"}
    try:
        result["start_s"] = round(wait_ready(url, proc, args.start_timeout), 1)
        result["gpu_mib_after_start"] = gpu_memory_used_mib()
        rows = workload(args.rate, args.duration, 1, tuple(args.prompt), tuple(args.output), FLEET.names,
                        FLEET.weights())
        with Watcher(url) as watcher:
            results, _ = asyncio.run(replay(url, rows, 2000, 1, args.request_timeout))
            time.sleep(2.0)  # one more status poll after the last request
        served = per_request(results)
        status = watcher.last
        errors = [r["error"] for r in served if not r["served"]]
        result.update({
            "requests": len(rows), "served": sum(r["served"] for r in served), "failed": len(errors),
            "errors": sorted({str(e)[:200] for e in errors})[:10],
            "ttft_p50_s": float(np.percentile([r["ttft_s"] for r in served if r["served"]] or [0], 50)),
            "tpot_p50_s": float(np.percentile([r["tpot_s"] for r in served if r.get("tpot_s")] or [0], 50)),
            "switches": status.get("switches"), "restarts": status.get("restarts"),
            "lost_instances": status.get("lost_instances"),
            "instances": {iid: {"role": inst["role"],
                                "resident_at_end": inst["engine"].get("resident_models"),
                                "most_resident": watcher.max_resident.get(iid),
                                "engine_switches": inst["engine"].get("num_switches"),
                                "weight_copies": inst["engine"].get("num_weight_copies"),
                                "kv_device_bytes": inst["engine"].get("kv_device_bytes"),
                                "device_buffer_bytes": inst["engine"].get("device_buffer_bytes")}
                          for iid, inst in status.get("instances", {}).items()},
            "gpu_peak_mib": watcher.peak_mib or None, "wall_s": round(time.monotonic() - started, 1)})
    except Exception as exc:  # the log's tail says why; the JSON still records what was measured
        result["error"] = repr(exc)
        result["serve_log_tail"] = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    finally:
        stop_server(proc)
    (args.out / "shared_weights.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("models",)}, indent=1))


if __name__ == "__main__":
    main()
