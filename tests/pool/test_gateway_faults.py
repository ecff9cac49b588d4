"""Client faults over real loopback sockets: disconnects mid-stream, slow readers, many disconnects at once.

A sim-engine pool (three models, two instances) behind uvicorn on
127.0.0.1. Clients are raw sockets, so a test decides exactly when a
connection closes and how much of the response is ever read. After every
fault /pool/status must show nothing held: no live request, no queued or
running count, reserved KV 0, the engines' KV and requests 0, no open stream.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from pool.gateway import GatewaySettings, create_app
from pool.gateway.server import BackgroundServer
from tests.factories import LinearCosts
from tests.pool.sim_gateway import MODELS, allocated, sim_pool, status, wait_empty, wait_until

FAST = LinearCosts(step_s=0.001, prefill_per_token_s=1e-5, switch_s=0.01)
MAX_BUFFERED = 64
FREED_WITHIN_S = 1.5  # a cancelled request's KV goes at the next step boundary: milliseconds here


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[object, str]]:
    pool = sim_pool(costs=FAST, max_requests=256).start()
    # small kernel send buffers (accepted sockets inherit them): a client that stops reading stalls the gateway's
    # writes after ~100 kB instead of the 4 MB Linux would otherwise buffer for it
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    listener.bind(("127.0.0.1", 0))
    app = create_app(pool, GatewaySettings(max_buffered_tokens=MAX_BUFFERED))
    with BackgroundServer(app, sock=listener) as server:
        yield pool, server.url
    pool.stop()


def open_stream(url: str, body: dict[str, object], rcvbuf: int | None = None) -> socket.socket:
    """A raw HTTP/1.1 streaming POST; the response is left unread on the socket."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((parts.hostname, parts.port))
    payload = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + parts.netloc.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n"
                 b"Connection: close\r\n\r\n" + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout_s: float = 20.0) -> bytes:
    data = b""
    deadline = time.monotonic() + timeout_s
    while marker not in data:
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout_s} s: {data[-300:]!r}"
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before {marker!r}: {data[-300:]!r}"
        data += chunk
    return data


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE response (chunked framing lines are skipped)."""
    return [line[6:] for line in raw.decode(errors="replace").split("\n") if line.startswith("data: ")]


def long_body(model: str, max_tokens: int = 6000) -> dict[str, object]:
    return {"model": model, "prompt": "Tell me everything.", "max_tokens": max_tokens, "ignore_eos": True}


def test_disconnect_mid_stream_cancels_and_frees_kv_at_once(served):
    _, url = served
    for model in MODELS:
        sock = open_stream(url, long_body(model))
        read_until(sock, b'"text"')  # tokens are flowing: it decodes, its KV reserved
        held = allocated(status(url))
        assert held["requests_in_pool"] == 1 and held["kv_used_bytes"] > 0 and held["streams"] == 1, held
        sock.close()
        freed, left, took_s = wait_empty(url, FREED_WITHIN_S)
        assert freed, f"{model}: still held {FREED_WITHIN_S} s after the disconnect: {left}"
        assert took_s < 6000 * FAST.step / 2  # far sooner than the request would have ended on its own


SLOW_PREFILL = LinearCosts(step_s=0.002, prefill_per_token_s=2e-3, switch_s=0.01)


@pytest.fixture(scope="module")
def slow_prefill() -> Iterator[str]:
    """A pool whose prompts take about a second to prefill (500 tokens), so a client can leave before its first token."""
    pool = sim_pool(costs=SLOW_PREFILL).start()
    with BackgroundServer(create_app(pool)) as server:
        yield server.url
    pool.stop()


def test_disconnect_before_the_first_token_cancels_the_request(slow_prefill):
    url = slow_prefill
    prompt = list(range(100, 600))  # token ids: 500 of them, ~1 s of prefill
    sock = open_stream(url, {"model": "alpha", "prompt": prompt, "max_tokens": 2000, "ignore_eos": True})
    read_until(sock, b"200 OK")  # the headers go out at once; no token yet
    assert wait_until(lambda: allocated(status(url))["queued"] == 1, 2.0)
    held = allocated(status(url))
    assert held["running"] == 0 and held["requests_in_pool"] == 1, held
    sock.close()
    prefill_s = 500 * SLOW_PREFILL.prefill_per_token
    freed, left, took_s = wait_empty(url, prefill_s + FREED_WITHIN_S)  # at the latest when its prefill ends
    assert freed, left
    time.sleep(max(0.0, prefill_s + 0.2 - took_s))  # and nothing comes back once the prefill under way has ended
    assert not any(allocated(status(url)).values()), allocated(status(url))
    print(f"left before its first token: freed in {took_s:.2f} s")


def test_disconnect_while_waiting_for_a_whole_answer(slow_prefill):
    url = slow_prefill
    body = {"model": "beta", "prompt": "x", "max_tokens": 4000, "ignore_eos": True}  # ~8 s of decoding
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    freed, left, took_s = wait_empty(url, FREED_WITHIN_S)
    assert freed, left


def test_a_client_that_stops_reading_is_cancelled_with_a_bounded_buffer(served):
    _, url = served
    before = status(url)["gateway"]["slow_client_cancels"]
    sock = open_stream(url, long_body("beta", 8000), rcvbuf=4096)
    peak, samples = 0, 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # read nothing; watch the gateway's buffer for this stream
        gateway = status(url)["gateway"]
        samples += 1
        peak = max(peak, gateway["buffered_tokens"])
        if gateway["slow_client_cancels"] > before:
            break
        time.sleep(0.01)
    gateway = status(url)["gateway"]
    assert gateway["slow_client_cancels"] == before + 1, gateway
    assert peak <= MAX_BUFFERED + 1 and gateway["peak_buffered_tokens"] <= MAX_BUFFERED + 1, (peak, gateway)
    assert gateway["peak_buffered_tokens"] == MAX_BUFFERED  # the bound was reached, not just approached
    held = allocated(status(url))  # cancelled in the pool, though the client has not seen it yet
    assert held["requests_in_pool"] == held["kv_used_bytes"] == held["queued"] == held["running"] == 0, held
    # the client comes back: it gets what the kernel held, then the reason, then [DONE]
    got = events(read_all(sock))
    sock.close()
    error = json.loads(got[-2])["error"]
    assert got[-1] == "[DONE]" and error["code"] == "slow_client" and "read too slowly" in error["message"]
    num_tokens = sum(1 for e in got[:-2] if '"text"' in e)
    assert 0 < num_tokens < 8000
    freed, left, _ = wait_empty(url, FREED_WITHIN_S)
    assert freed, left
    print(f"slow reader: cut after {num_tokens} delivered tokens, buffered at most {peak} (bound {MAX_BUFFERED}) "
          f"over {samples} status samples")


def test_a_reader_that_keeps_up_is_never_cut_by_the_buffer_bound(served):
    _, url = served
    before = status(url)["gateway"]["slow_client_cancels"]
    body = {**long_body("gamma", 3000), "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        got = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert got[-1] == "[DONE]" and "error" not in got[-2]
    assert sum(1 for e in got if '"text"' in e) == 3000
    assert status(url)["gateway"]["slow_client_cancels"] == before


def test_fifty_streams_dropped_at_once_leave_nothing_allocated_and_others_keep_going(served):
    _, url = served
    num_streams = 50
    sockets = [open_stream(url, long_body(MODELS[k % len(MODELS)], 4000)) for k in range(num_streams)]
    survivor = httpx.Client(timeout=60)
    with survivor.stream("POST", f"{url}/v1/completions", json={**long_body("beta", 600), "stream": True}) as kept:
        kept_lines = kept.iter_lines()
        for sock in sockets:
            read_until(sock, b'"text"', timeout_s=30)  # every one of them is generating
        held = allocated(status(url))
        assert held["requests_in_pool"] == num_streams + 1 and held["streams"] == num_streams + 1, held
        for sock in sockets:  # all at once
            sock.close()
        dropped_at = time.monotonic()
        freed = wait_until(lambda: allocated(status(url))["requests_in_pool"] == 1, FREED_WITHIN_S * 2)
        took_s = time.monotonic() - dropped_at
        assert freed, allocated(status(url))
        got = [line[6:] for line in kept_lines if line.startswith("data: ")]
    assert got[-1] == "[DONE]" and "error" not in got[-2]
    assert sum(1 for e in got if '"text"' in e) == 600
    ok, left, _ = wait_empty(url, FREED_WITHIN_S)
    assert ok, left
    for model in MODELS:  # and it still serves every model
        answer = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 8}, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
    survivor.close()
    print(f"{num_streams} streams dropped at once: freed in {took_s:.3f} s, left allocated {left}")
