"""Gateway + controller under load, on loopback, with the `sim` engine (bounded: it stops by itself).

    OMP_NUM_THREADS=1 python benchmarks/gateway_load.py [--duration 15] [--concurrency 1,16,64,256]
                                                        [--out benchmarks/out/gateway_load.json]

1. Added TTFT: a sim pool (one instance, one model, prefill 5 ms, decode
   2 ms a step) is called directly (`LivePool.submit`: time to the first
   token in the sink), then an identical pool behind the gateway in a server
   process is called by a streaming httpx client (time to the first content
   event), one request at a time. The difference of the medians is what the
   gateway adds, HTTP client included (target <= 2 ms at p50); a /health
   round trip before each request measures the HTTP stack alone.
2. Sustained load: `modelpool serve --engine sim --sim-time-scale 0` (the
   demo fleet: 4 models on 2 instances, engine calls that take no time, so
   gateway + controller are the whole cost) in a subprocess, and C
   concurrent streaming clients (aiohttp, one process) for `duration`
   seconds each: completed requests/s, streamed tokens/s, client TTFT, errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from pool.actor import EngineSpec  # noqa: E402
from pool.engines.base import SamplingParams  # noqa: E402
from pool.gateway import create_app  # noqa: E402
from pool.gateway.server import free_port  # noqa: E402
from pool.served import ServedModel, slot_instances  # noqa: E402
from pool.config import PoolConfig  # noqa: E402
from pool.service import LivePool  # noqa: E402
from scheduler import CostModel, ModelProfile  # noqa: E402

PROMPT = "Summarise the plot of a long novel about the sea in a few sentences, please."


class FixedCosts(CostModel):
    """Every prefill 5 ms, every decode step 2 ms, switches 10 ms."""

    def prefill_s(self, model: str, num_tokens: int, num_requests: int = 1) -> float:
        return 0.005

    def decode_step_s(self, model: str, batch_size: int, context_tokens: int) -> float:
        return 0.002

    def switch_s(self, model: str) -> float:
        return 0.01

    def kv_move_s(self, model: str, num_tokens: int) -> float:
        return 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# ---- 1. TTFT the gateway adds ------------------------------------------------------------------------------
def fixed_pool() -> LivePool:
    """One instance, one model, prefill 5 ms, decode 2 ms a step (the sim engine sleeps them)."""
    profile = ModelProfile("sim-7b", 1, 15e9, 57344, 32768, 10.0, 0.1)
    models = [ServedModel("sim-7b", Path("<sim>/sim-7b"), profile)]
    instances = slot_instances(1, models, 8 << 30)
    costs = FixedCosts()
    spec = EngineSpec("sim", {"costs": costs, "kv_bytes": int(instances[0].memory_bytes),
                              "kv_bytes_per_token": {"sim-7b": 57344}})
    return LivePool(models, instances, "token-level", costs, PoolConfig(engine=spec, backend="threads"))


def serve_fixed(port: int) -> None:
    """The gateway over `fixed_pool()` in the foreground (the benchmark's server process)."""
    import uvicorn

    from pool.gateway.server import uvicorn_config

    pool = fixed_pool().start()
    try:
        uvicorn.Server(uvicorn_config(create_app(pool), "127.0.0.1", port)).run()
    finally:
        pool.stop()


def direct_ttft(num_requests: int) -> list[float]:
    pool = fixed_pool().start()
    ids = pool.tokenizer("sim-7b")(PROMPT)["input_ids"]
    out = []
    for k in range(num_requests):
        first = threading.Event()
        stamp: list[float] = []

        def sink(item, stamp=stamp, first=first) -> None:
            if not stamp:
                stamp.append(time.perf_counter())
                first.set()

        started = time.perf_counter()
        pool.submit(f"direct-{k}", "sim-7b", ids, SamplingParams(max_tokens=4), sink)
        first.wait(10)
        out.append(stamp[0] - started)
        time.sleep(0.01)  # let the request finish: every call starts on an idle pool
    pool.stop()
    return out


def gateway_ttft(num_requests: int, floor: list[float]) -> list[float]:
    """Streamed chats through the gateway in a server process; `floor` gets /health round trips (HTTP alone)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve-fixed", str(port)], cwd=REPO)
    body = {"model": "sim-7b", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "stream": True}
    out = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the benchmark server did not start"
                time.sleep(0.2)
            for _ in range(num_requests):
                started = time.perf_counter()
                client.get("/health")
                floor.append(time.perf_counter() - started)
                time.sleep(0.01)
                started = time.perf_counter()
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    for line in response.iter_lines():
                        if '"content":"[sim]' in line:
                            out.append(time.perf_counter() - started)
                        if line == "data: [DONE]":
                            break
                time.sleep(0.01)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return out


def added_ttft(num_requests: int) -> dict:
    """Client in its own process (as in production); the direct path measured on an identical pool."""
    floor: list[float] = []
    direct, http = direct_ttft(num_requests), gateway_ttft(num_requests, floor)
    d50, h50, f50 = statistics.median(direct), statistics.median(http), statistics.median(floor)
    return {"requests_each": num_requests, "direct_p50_ms": d50 * 1e3, "gateway_p50_ms": h50 * 1e3,
            "added_p50_ms": (h50 - d50) * 1e3, "http_round_trip_p50_ms": f50 * 1e3,
            "added_beyond_http_p50_ms": (h50 - d50 - f50) * 1e3, "direct_p90_ms": pct(direct, 0.9) * 1e3,
            "gateway_p90_ms": pct(http, 0.9) * 1e3}


# ---- 2. sustained load -----------------------------------------------------------------------------------
async def _worker(session, url: str, models: list[str], stop_at: float, k: int, stats: dict) -> None:
    n = k
    while time.perf_counter() < stop_at:
        body = {"model": models[n % len(models)], "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 32, "stream": True}
        n += 1
        started, first, tokens = time.perf_counter(), None, 0
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    stats["errors"] += 1
                    await response.read()
                    continue
                async for raw in response.content:
                    line = raw.strip()
                    if line.startswith(b'data: {"id"') and b'"content":"' in line and b'"content":""' not in line:
                        tokens += 1
                        if first is None:
                            first = time.perf_counter() - started
                    elif line == b"data: [DONE]":
                        break
        except Exception:  # noqa: BLE001 - count and go on
            stats["errors"] += 1
            continue
        if time.perf_counter() <= stop_at:
            stats["done"] += 1
            stats["tokens"] += tokens
            if first is not None:
                stats["ttft"].append(first)


async def _load(url: str, models: list[str], concurrency: int, duration_s: float) -> dict:
    import aiohttp

    stats: dict = {"done": 0, "tokens": 0, "errors": 0, "ttft": []}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        stop_at = time.perf_counter() + duration_s
        await asyncio.gather(*(_worker(session, url, models, stop_at, k, stats) for k in range(concurrency)))
    return {"concurrency": concurrency, "duration_s": duration_s, "requests_per_s": stats["done"] / duration_s,
            "tokens_per_s": stats["tokens"] / duration_s, "completed": stats["done"], "errors": stats["errors"],
            "ttft_p50_ms": pct(stats["ttft"], 0.5) * 1e3, "ttft_p99_ms": pct(stats["ttft"], 0.99) * 1e3}


def sustained(levels: list[int], duration_s: float) -> list[dict]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "modelpool.cli", "serve", "--engine", "sim", "--sim-time-scale",
                             "0", "--no-warmup", "--port", str(port), "--max-queued-per-model", "100000",
                             "--max-requests", "100000"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "OpenAI-compatible endpoint" in line:
                break
        url = f"http://127.0.0.1:{port}"
        models = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        rows = []
        for level in levels:
            rows.append(asyncio.run(_load(url, models, level, duration_s)))
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per concurrency level")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--ttft-requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "gateway_load.json")
    parser.add_argument("--serve-fixed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fixed:
        serve_fixed(args.serve_fixed)
        return
    overhead = added_ttft(args.ttft_requests)
    print(json.dumps(overhead), flush=True)
    rows = sustained([int(c) for c in args.concurrency.split(",")], args.duration)
    result = {"date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
              "python": platform.python_version(), "added_ttft": overhead, "sustained": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
