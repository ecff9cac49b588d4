"""Soak: a bounded loopback load against a real gateway for a long time, with the server's RSS sampled.

    OMP_NUM_THREADS=1 python benchmarks/soak.py [--duration 1800] [--warmup 120] [--clients 4]
                                                [--sample-s 5] [--time-scale 1] [--out benchmarks/out/soak.json]

`modelpool serve --engine sim` runs in a subprocess on 127.0.0.1 with a
four-model fleet on two simulated H20s (tokens timed by the roofline cost
model, `--time-scale` times as long). `--clients` asyncio clients in this
process send chats and completions in turn, streamed and not, to every
model; every `--cancel-every`-th request is abandoned (a stream closed after
its first tokens, or a plain request given up after a fraction of a second).
Every answer is checked: status 200, labelled sim text, `[DONE]` at the end
of a stream, as many tokens as asked for. When the load stops, the pool must
drain to nothing (no request, queue or KV left) and have no tick errors.

The server's RSS (psutil) is sampled every `--sample-s` seconds. Pass: after
the warm-up, RSS never exceeds its first post-warm-up sample by more than
`--max-growth` (10%), and no error of any kind. Exit status 1 on a fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import psutil  # noqa: E402

FLEET = """\
pool:
  gpu: h20
  num_gpus: 2
models:
  - {name: qwen2.5-1.5b-chat, arch: qwen2.5-1.5b}
  - {name: qwen3-4b-support, arch: qwen3-4b}
  - {name: qwen2.5-7b-chat, arch: qwen2.5-7b}
  - {name: llama-3.1-8b-code, arch: llama-3.1-8b}
"""
PROMPTS = ("What is the capital of France?", "Write a haiku about memory leaks.",
           "Summarise the plot of a long novel about the sea in a few sentences, please. " * 4,
           "List three prime numbers.")
KINDS = ("chat-stream", "chat", "completion-stream", "completion")


@dataclass
class Tally:
    requests: Counter[str] = field(default_factory=Counter)  # by kind, cancellations included
    completed: int = 0
    cancelled: int = 0
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: list[str] = field(default_factory=list)

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.error_examples) < 20:
            self.error_examples.append(f"{kind}: {detail[:300]}")


# ---- the server ----------------------------------------------------------------------------------------------
def start_server(folder: Path, port: int, time_scale: float) -> subprocess.Popen[bytes]:
    fleet = folder / "fleet.yaml"
    fleet.write_text(FLEET)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = (folder / "server.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "modelpool.cli", "serve", "--engine", "sim", "--fleet", str(fleet),
                             "--port", str(port), "--no-warmup", "--sim-time-scale", str(time_scale)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]]
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} was not ready after {timeout_s:.0f} s")


# ---- the clients ---------------------------------------------------------------------------------------------
def _body(kind: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": kind.endswith("-stream")}
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": prompt}]
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _text_of(event: dict[str, Any]) -> str | None:
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    return choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], max_tokens: int, cancel: bool,
                  tally: Tally) -> None:
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            tally.error(f"http_{response.status_code}", (await response.aread()).decode(errors="replace"))
            return
        text, num_events, done = "", 0, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                tally.error("stream_error_event", line)
                return
            piece = _text_of(event)
            if piece:
                text += piece
                num_events += 1
                if cancel and num_events >= 2:  # leave mid-stream: the server must cancel and free the KV
                    tally.cancelled += 1
                    return
        if not done:
            tally.error("stream_without_done", text)
        elif not text.startswith("[sim]"):
            tally.error("bad_text", text)
        else:
            tally.completed += 1
            tally.tokens += max_tokens


async def _plain(client: httpx.AsyncClient, path: str, body: dict[str, Any], max_tokens: int, cancel: bool,
                 tally: Tally) -> None:
    if cancel:  # give up before the answer: the connection closes, the server sees the disconnect
        try:
            await asyncio.wait_for(client.post(path, json=body), timeout=0.2)
        except (asyncio.TimeoutError, TimeoutError):
            tally.cancelled += 1
            return
    response = await client.post(path, json=body)
    if response.status_code != 200:
        tally.error(f"http_{response.status_code}", response.text)
        return
    answer = response.json()
    choice = answer["choices"][0]
    text = choice.get("text") if "text" in choice else choice["message"]["content"]
    if not text.startswith("[sim]") or answer["usage"]["completion_tokens"] != max_tokens:
        tally.error("bad_body", response.text)
        return
    tally.completed += 1
    tally.tokens += max_tokens


async def client_loop(url: str, models: list[str], stop_at: float, seed: int, cancel_every: int,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            kind, model = rng.choice(KINDS), rng.choice(models)
            max_tokens = rng.randint(4, 48)
            cancel = n % cancel_every == 0
            path, body = _body(kind, model, rng.choice(PROMPTS), max_tokens)
            tally.requests[kind] += 1
            try:
                if body["stream"]:
                    await _stream(client, path, body, max_tokens, cancel, tally)
                else:
                    await _plain(client, path, body, max_tokens, cancel, tally)
            except httpx.HTTPError as exc:
                tally.error(f"transport_{type(exc).__name__}", repr(exc))
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                tally.error("malformed", repr(exc))
            await asyncio.sleep(rng.uniform(0.0, 0.05))


# ---- RSS -----------------------------------------------------------------------------------------------------
async def sample_rss(process: psutil.Process, every_s: float, stop_at: float, started: float,
                     samples: list[tuple[float, int]]) -> None:
    while True:
        samples.append((time.monotonic() - started, process.memory_info().rss))
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(every_s, max(0.0, stop_at - time.monotonic())))


async def load(url: str, models: list[str], pid: int, args: argparse.Namespace, tally: Tally
               ) -> list[tuple[float, int]]:
    started = time.monotonic()
    stop_at = started + args.duration
    samples: list[tuple[float, int]] = []
    sampler = asyncio.create_task(sample_rss(psutil.Process(pid), args.sample_s, stop_at, started, samples))
    await asyncio.gather(*(client_loop(url, models, stop_at, args.seed + k, args.cancel_every, tally)
                           for k in range(args.clients)))
    await sampler
    return samples


def leftovers(status: dict[str, Any]) -> list[str]:
    """What the pool still holds, by place (empty when drained)."""
    out = [f"requests_in_pool={status['requests_in_pool']}"] if status["requests_in_pool"] else []
    for name, entry in status["models"].items():
        out += [f"{name}.{key}={entry[key]}" for key in ("queued", "running", "kv_reserved_bytes") if entry[key]]
    for name, entry in status["instances"].items():
        out += [f"{name}.{key}={entry[key]}" for key in ("kv_used_bytes", "requests_on_device") if entry[key]]
        if entry["engine"].get("num_requests"):
            out.append(f"{name}.engine.num_requests={entry['engine']['num_requests']}")
    return out


def drained(url: str, timeout_s: float = 30.0) -> list[str]:
    """Wait for the pool to hold nothing: no request, queue, reserved or device KV; what is left if not."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = httpx.get(f"{url}/pool/status", timeout=10).json()
        left = leftovers(status)
        if status.get("tick_errors"):
            left.append(f"tick_errors={status['tick_errors']}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


# ---- the report ----------------------------------------------------------------------------------------------
def summarise(samples: list[tuple[float, int]], args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    after = [rss for t, rss in samples if t >= args.warmup] or [samples[-1][1]]
    first, last, peak = after[0], after[-1], max(after)
    mib = 1 << 20
    return {"rss_first_mib": first / mib, "rss_last_mib": last / mib, "rss_max_mib": peak / mib,
            "rss_before_warmup_end_mib": samples[0][1] / mib, "num_samples_after_warmup": len(after),
            "growth_pct": 100 * (last - first) / first, "max_growth_pct": 100 * (peak - first) / first,
            "requests": sum(tally.requests.values()), "requests_by_kind": dict(tally.requests),
            "completed": tally.completed, "cancelled": tally.cancelled, "tokens": tally.tokens,
            "errors": sum(tally.errors.values()), "errors_by_kind": dict(tally.errors),
            "error_examples": tally.error_examples}


def print_table(result: dict[str, Any]) -> None:
    rows = [("duration / warm-up", f"{result['duration_s']:.0f} s / {result['warmup_s']:.0f} s"),
            ("clients", str(result["clients"])),
            ("requests (completed / cancelled)", f"{result['requests']} ({result['completed']} / {result['cancelled']})"),
            ("tokens", str(result["tokens"])),
            ("RSS first / last / max after warm-up", f"{result['rss_first_mib']:.1f} / {result['rss_last_mib']:.1f}"
                                                     f" / {result['rss_max_mib']:.1f} MiB"),
            ("RSS growth (last, max)", f"{result['growth_pct']:+.1f} % / {result['max_growth_pct']:+.1f} %"),
            ("errors", f"{result['errors']} {result['errors_by_kind'] or ''}"),
            ("drained after the load", str(result["drained"])),
            ("pass", str(result["passed"]))]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 30 min)")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before the RSS baseline")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--cancel-every", type=int, default=7, help="abandon every n-th request of a client")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--time-scale", type=float, default=1.0, help="--sim-time-scale of the server")
    parser.add_argument("--max-growth", type=float, default=0.10, help="allowed RSS growth after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "soak.json")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.duration:
        parser.error(f"--warmup {args.warmup} must be in [0, --duration {args.duration})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pool.gateway.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="modelpool-soak-") as tmp:
        server = start_server(Path(tmp), port, args.time_scale)
        try:
            models = wait_ready(url, server)
            tally = Tally()
            began = datetime.now(timezone.utc)
            samples = asyncio.run(load(url, models, server.pid, args, tally))
            left = drained(url)
            ok = not left
            if left:
                tally.error("not_drained", ", ".join(left))
            if server.poll() is not None:
                tally.error("server_exited", str(server.returncode))
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
            log_tail = (Path(tmp) / "server.log").read_text(errors="replace")[-2000:]
    result: dict[str, Any] = {
        "date": began.strftime("%Y-%m-%d %H:%M UTC"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "python": platform.python_version(), "command": "python benchmarks/soak.py " + " ".join(argv or sys.argv[1:]),
        "models": models, "duration_s": args.duration, "warmup_s": args.warmup, "clients": args.clients,
        "time_scale": args.time_scale, "allowed_growth_pct": 100 * args.max_growth, "drained": ok,
        **summarise(samples, args, tally)}
    result["passed"] = bool(result["errors"] == 0 and result["max_growth_pct"] <= 100 * args.max_growth)
    result["rss_samples"] = [(round(t, 1), round(rss / (1 << 20), 2)) for t, rss in samples]
    if result["errors"]:
        result["server_log_tail"] = log_tail
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
