"""A live pool on this machine, and a workload replayed through its gateway as streaming clients would.

What `modelpool validate` and the GPU harness (benchmarks/gpu_pool.py) share:
- `build_models`: folders of random-weight models of real shapes (a config,
  a one-word-per-id tokenizer and `random_weights.json`: the engine draws
  the weights, nothing is downloaded) and a fleet file for them;
- `start_server` / `wait_ready` / `stop_server`: `modelpool serve` in its own
  process group, as a user starts it;
- `replay`: every request at its arrival time, streamed (`/v1/completions`,
  prompt token ids, `ignore_eos`), each token's time recorded;
- `per_request`: TTFT, TPOT and inter-token gaps of each request, as the
  simulator's records give them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


# ---- models ------------------------------------------------------------------------------------------------
def word_tokenizer(vocab_size: int) -> Any:
    """A tokenizer with one word per id of the model's vocab ("w0" ... "w151935"), so every token a random
    model makes decodes to text and streams as its own chunk (a small BPE tokenizer would decode most ids of a
    152k vocab to nothing: the gateway sends no chunk for those, and client-side TTFT/TPOT would be wrong)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1")


def hf_config(family: str, shape: Mapping[str, Any], dtype: str) -> Any:
    """A Hugging Face config of `family` (qwen2, qwen3, llama) with `shape`'s keys."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}
    if family not in classes:
        raise ValueError(f"no random-weight builder for family {family!r}; known: {', '.join(classes)}")
    return classes[family](**shape, max_position_embeddings=32768, rope_theta=1e6, torch_dtype=dtype)


def write_model(folder: Path, config: Any, seed: int, tokenizer_from: Path | None = None) -> None:
    """One random-weight model folder: config.json, the word tokenizer (copied from `tokenizer_from`, a folder
    written for the same vocabulary size, where given: a 152k-word tokenizer takes seconds to build) and the
    weights' seed."""
    import shutil

    from pool.engines.weights import RANDOM_WEIGHTS_FILE

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    if tokenizer_from is None:
        word_tokenizer(config.vocab_size).save_pretrained(folder)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / name).is_file():
                shutil.copy(tokenizer_from / name, folder / name)
    (folder / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed}))


# ---- the server --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(fleet: Path, port: int, log_path: Path, backend: str = "processes", extra: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """`modelpool serve --fleet` on 127.0.0.1:`port` in a new process group, its output in `log_path` and its
    plans in `<log_path>.plans.jsonl`."""
    cmd = [*prefix, sys.executable, "-m", "modelpool.cli", "serve", "--fleet", str(fleet), "--backend", backend,
           "--port", str(port), "--plan-log", str(log_path.with_suffix(".plans.jsonl")), *extra]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled", **(env or {})}
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
                            start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until `url`/health answers 200; an error if the server exits or the time runs out first."""
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"modelpool serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"modelpool serve not ready within {timeout_s} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (a clean stop: engines, MPS daemon), SIGKILL after a minute."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ---- the replay --------------------------------------------------------------------------------------------
async def replay(url: str, rows: Sequence[Mapping[str, Any]], vocab: int, seed: int,
                 timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    """Every row's request (timestamp_s, model, input_tokens, output_tokens), streamed; each result's times in
    seconds from the replay's start, and that start on this host's monotonic clock (the engines' call logs')."""
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(int(r["input_tokens"]))] for r in rows]
    results: list[dict[str, Any]] = [{} for _ in rows]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.monotonic()

        async def one(k: int) -> None:
            row = rows[k]
            await asyncio.sleep(max(0.0, row["timestamp_s"] - (time.monotonic() - t0)))
            out = results[k] = {"index": k, "model": row["model"], "input_tokens": row["input_tokens"],
                                "max_tokens": row["output_tokens"], "arrival_s": row["timestamp_s"],
                                "sent_s": time.monotonic() - t0, "token_s": [], "error": None, "usage": None}
            await stream_completion(client, request_body(row["model"], prompts[k], int(row["output_tokens"])),
                                    out, t0)

        await asyncio.gather(*(one(k) for k in range(len(rows))))
    return results, t0


def request_body(model: str, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """A replayed request: its prompt as token ids, exactly `max_tokens` tokens streamed, usage at the end."""
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream_completion(client: Any, body: Mapping[str, Any], out: dict[str, Any], t0: float) -> None:
    """POST `body` to /v1/completions on `client` (an httpx.AsyncClient) and read its SSE stream: into `out`, each
    token chunk's time (`token_s`, seconds on the monotonic clock after `t0`, as the line is read), the request id
    (`id`), the usage and any error; `end_s` when the stream ends."""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                out["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic() - t0
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                elif event.get("usage"):
                    out["usage"] = event["usage"]
                if event.get("choices"):
                    out["token_s"].append(now)
                    out.setdefault("id", event.get("id"))
    except Exception as exc:  # a broken stream is a failed request, not a crashed run
        out["error"] = repr(exc)
    finally:
        out["end_s"] = time.monotonic() - t0


def one_by_one(url: str, bodies: Sequence[Mapping[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Each of `bodies` streamed from `url` in turn, the next once the last has ended (a probe's client: see
    modelpool.measure_live.gateway_points): per request its send time (`sent_s`) and each token's read time
    (`token_s`), in seconds on the monotonic clock (CLOCK_MONOTONIC on Linux, as time.perf_counter)."""
    import httpx

    async def run() -> list[dict[str, Any]]:
        results = []
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s)) as client:
            for body in bodies:
                out: dict[str, Any] = {"token_s": [], "error": None, "usage": None, "sent_s": time.monotonic()}
                await stream_completion(client, body, out, 0.0)
                results.append(out)
        return results

    return asyncio.run(run())


def per_request(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """TTFT, TPOT (mean of the tokens after the first) and ITL of every request that finished cleanly."""
    out = []
    for r in results:
        served = r.get("error") is None and r.get("usage") and r["token_s"]
        row: dict[str, Any] = {"index": r["index"], "model": r["model"], "served": bool(served),
                               "error": r.get("error")}
        if served:
            n = r["usage"]["completion_tokens"]
            first, last = r["token_s"][0], r.get("end_s", r["token_s"][-1])
            row.update(ttft_s=first - r["arrival_s"], sent_s=round(r["sent_s"], 6), first_s=round(first, 6),
                       tokens=n, chunks=len(r["token_s"]),
                       tpot_s=(r["token_s"][-1] - first) / (n - 1) if n > 1 else None,
                       itl_s=[round(float(g), 6) for g in np.diff(r["token_s"])],  # to the us: half the file
                       e2e_s=last - r["arrival_s"])
        out.append(row)
    return out


def fresh_status(url: str, timeout_s: float = 15.0) -> dict[str, Any]:
    """/pool/status once every engine's stats (its weight copies) are from after this call (`fresh`; False when
    they did not come within `timeout_s`): the pool asks its engines every `stats_interval_s` (2 s), so counts
    read at once could miss the last copies."""
    import httpx

    asked = time.time()
    while True:
        status = httpx.get(f"{url}/pool/status", timeout=30).json()
        status["fresh"] = (status.get("stats_at") or 0.0) >= asked
        if status["fresh"] or time.time() - asked > timeout_s:
            return status
        time.sleep(0.25)
