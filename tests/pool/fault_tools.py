"""Shared pieces of the fault tests: long greedy references, outcome counting, waiting on a live pool,
stopping a `modelpool serve` process."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pool.errors import RequestFailed
from pool.engines.base import TokenOut
from pool.service import LivePool, PoolClosed

PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 8, 120, 64, 9, 11, 2], [250, 1, 33]]
CLEAN_ERRORS = (RequestFailed, PoolClosed)


class Sink:
    """A request's sink that remembers every token and how the request ended (thread-safe enough: one writer)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.after_end: list[TokenOut | BaseException] = []  # must stay empty: a request ends exactly once
        self.done = threading.Event()

    def __call__(self, item: TokenOut | BaseException) -> None:
        if self.done.is_set():
            self.after_end.append(item)
            return
        if isinstance(item, BaseException):
            self.error = item
            self.done.set()
            return
        self.tokens.append(item.token_id)
        if item.finished:
            self.done.set()


def greedy_reference(paths: Mapping[str, Path], prompts: list[list[int]], num_tokens: int) -> dict[tuple[str, int], list[int]]:
    """transformers' own greedy generate (float32): the uninterrupted run every resumed request must equal."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in paths.items():
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        for k, prompt in enumerate(prompts):
            with torch.no_grad():
                gen = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                                     min_new_tokens=num_tokens)
            out[(name, k)] = gen[0, len(prompt):].tolist()
    return out


@dataclass
class Outcomes:
    """How every request of a fault test ended."""

    identical: list[Any] = field(default_factory=list)  # finished, tokens equal to the uninterrupted run
    clean_errors: list[Any] = field(default_factory=list)  # ended with RequestFailed / PoolClosed
    wrong: list[Any] = field(default_factory=list)  # finished with other tokens, or another exception
    hung: list[Any] = field(default_factory=list)  # not ended by the deadline, still held by the pool
    lost: list[Any] = field(default_factory=list)  # not ended, and the pool no longer holds it

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in vars(self).items()}


def outcomes(sinks: Mapping[Any, Sink], expected: Mapping[Any, list[int]], held: Callable[[Any], bool],
             timeout_s: float) -> Outcomes:
    """Wait (at most `timeout_s` in all) for every request to end, then sort them by how they ended."""
    deadline = time.monotonic() + timeout_s
    for sink in sinks.values():
        sink.done.wait(max(0.0, deadline - time.monotonic()))
    out = Outcomes()
    for key, sink in sinks.items():
        if sink.after_end:
            out.wrong.append((key, f"items after its end: {sink.after_end!r}"))
        elif not sink.done.is_set():
            (out.hung if held(key) else out.lost).append(key)
        elif sink.error is None:
            (out.identical if sink.tokens == expected[key] else out.wrong).append(key)
        elif isinstance(sink.error, CLEAN_ERRORS):
            out.clean_errors.append(key)
        else:
            out.wrong.append((key, repr(sink.error)))
    return out


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def homes(pool: LivePool) -> dict[str, tuple[str, str, int]]:
    """request id -> (instance holding its KV, model, tokens out so far), read from the loop's table."""
    assert pool.controller is not None
    for _ in range(100):  # the loop thread may change the dict while we copy it
        try:
            live = list(pool.controller.requests.values())
            break
        except RuntimeError:
            continue
    return {r.request_id: (r.kv_home, r.model, len(r.output_token_ids)) for r in live if r.kv_home is not None}


def allocated(pool: LivePool) -> dict[str, Any]:
    """What the pool still holds, from its status (all zero / empty once every request has ended)."""
    status = pool.status()
    return {"requests_in_pool": status["requests_in_pool"],
            "kv_used_bytes": sum(i["kv_used_bytes"] for i in status["instances"].values()),
            "requests_on_device": sum(i["requests_on_device"] for i in status["instances"].values()),
            "queued": sum(m["queued"] + m["running"] + m["scheduler_queue"] for m in status["models"].values()),
            "kv_reserved_bytes": sum(m["kv_reserved_bytes"] for m in status["models"].values())}


NOTHING = {"requests_in_pool": 0, "kv_used_bytes": 0, "requests_on_device": 0, "queued": 0, "kv_reserved_bytes": 0}


# ---- streaming clients over loopback -----------------------------------------------------------------------
@dataclass
class Stream:
    """What one SSE client saw."""

    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None  # the `error` of a last `data: {"error": ...}` event
    done: bool = False  # `data: [DONE]` arrived
    status: int | None = None
    failure: str | None = None  # the client's own exception (a timeout: the stream hung) or a cut connection

    @property
    def kind(self) -> str:
        """finished | clean_error | hung | cut."""
        if self.failure is not None:
            return "hung" if "Timeout" in self.failure else "cut"
        if self.status != 200:
            return "clean_error" if self.status in (429, 503) else "cut"
        if not self.done:
            return "cut"
        return "clean_error" if self.error is not None else "finished" if self.finish_reason else "cut"


def stream_completion(url: str, body: dict[str, Any], timeout_s: float, first_token: threading.Event | None = None
                      ) -> Stream:
    """POST a streamed completion and read it to the end; every read waits at most `timeout_s`."""
    import json

    import httpx

    out = Stream()
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=httpx.Timeout(timeout_s)) as response:
            out.status = response.status_code
            if response.status_code != 200:
                response.read()
                out.error = response.json().get("error")
                return out
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    out.done = True
                    continue
                payload = json.loads(data)
                if "error" in payload:
                    out.error = payload["error"]
                    continue
                choice = payload["choices"][0]
                out.text += choice.get("text") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if first_token is not None:
                    first_token.set()
    except Exception as exc:  # noqa: BLE001 - a timeout means a hung stream; anything else a cut one
        out.failure = f"{type(exc).__name__}: {exc}"
    return out


def run_streams(url: str, bodies: Mapping[Any, dict[str, Any]], timeout_s: float
                ) -> tuple[dict[Any, threading.Event], Callable[[], dict[Any, Stream]]]:
    """Start one client thread per body; returns their first-token events and a join() giving the results."""
    results: dict[Any, Stream] = {}
    started = {key: threading.Event() for key in bodies}

    def client(key: Any) -> None:
        results[key] = stream_completion(url, bodies[key], timeout_s, started[key])

    threads = [threading.Thread(target=client, args=(key,), daemon=True) for key in bodies]
    for thread in threads:
        thread.start()

    def join() -> dict[Any, Stream]:
        for thread in threads:
            thread.join(timeout_s * 4)
        return {key: results.get(key, Stream(failure="Timeout: the client thread never ended")) for key in bodies}

    return started, join


# ---- `modelpool serve` as a process -----------------------------------------------------------------------
def wait_for_serve(proc: subprocess.Popen[str], timeout_s: float = 240) -> tuple[str, list[str]]:
    """Read a `modelpool serve` process's output until it announces its endpoint; (its base URL, the lines read).
    It ending first, or not coming up within `timeout_s`, fails the test with what it printed."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not any("OpenAI-compatible endpoint" in line for line in lines):
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line and time.monotonic() < deadline, "serve did not come up:\n" + "".join(lines)
        lines.append(line)
    match = re.search(r"(http://\S+)/v1", lines[-1])
    assert match, lines[-1]
    return match.group(1), lines


def stop_serve(proc: subprocess.Popen[str], *, interrupt: bool = True, timeout_s: float = 60) -> None:
    """Wait for a `modelpool serve` process to exit, first pressing Ctrl-C (SIGINT) if `interrupt` and it still runs.

    Pass `interrupt=False` when it was already signalled (a second signal would cut its graceful shutdown short).
    Not gone within `timeout_s`: killed, and TimeoutExpired raised.
    """
    if interrupt and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
