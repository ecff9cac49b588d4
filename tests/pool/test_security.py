"""Security over real loopback sockets: constant-time keys, the admin key on /pool/*, no key in logs or status,
loopback binds by default, and an embedded Ray cluster that does not run unauthenticated code from the network.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

import modelpool.serve
from modelpool.cli import app as cli
from pool.gateway import GatewaySettings, create_app
from pool.gateway.auth import Secret
from pool.gateway.server import BackgroundServer, free_port, uvicorn_config
from tests.pool.sim_gateway import LOGGERS, keep_logging, sim_pool  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]
USER_KEY = "sk-user-7f3a9c1e5b84"
OTHER_USER_KEY = "sk-user-0c4d2e8a6f13"
ADMIN_KEY = "sk-admin-2d8e4f6a0c57"
WRONG_KEY = "sk-wrong-91b2c3d4e5f6"
ALL_KEYS = (USER_KEY, OTHER_USER_KEY, ADMIN_KEY, WRONG_KEY)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    pool = sim_pool().start()
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def keyed(pool) -> Iterator[str]:
    settings = GatewaySettings(api_keys=(Secret(USER_KEY), Secret(OTHER_USER_KEY)), admin_keys=(Secret(ADMIN_KEY),))
    with BackgroundServer(create_app(pool, settings)) as server:
        yield server.url


def test_keys_are_compared_with_compare_digest_against_every_key(keyed, monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for key, status in ((USER_KEY, 200), (OTHER_USER_KEY, 200), (WRONG_KEY, 401), (USER_KEY[:-1], 401)):
        compared.clear()
        assert httpx.get(f"{keyed}/v1/models", headers=bearer(key)).status_code == status, key
        # every configured key is compared, the matching one first or not: no early exit
        assert sorted(a for a, _ in compared) == sorted([USER_KEY.encode(), OTHER_USER_KEY.encode()]), key
        assert all(b == key.encode() for _, b in compared)
    compared.clear()
    assert httpx.get(f"{keyed}/pool/status", headers=bearer(ADMIN_KEY)).status_code == 200
    assert compared == [(ADMIN_KEY.encode(), ADMIN_KEY.encode())]


def raw_get(url: str, target: str, headers: dict[str, str] | None = None) -> int:
    """Status of a GET whose request target is sent exactly as written (no client normalisation)."""
    host, port = url.removeprefix("http://").split(":")
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = sock.recv(64).decode(errors="replace")
    return int(head.split()[1])


def test_admin_endpoints_need_the_admin_key(keyed):
    for headers in ({}, bearer(USER_KEY), bearer(WRONG_KEY), {"Authorization": ADMIN_KEY},
                    {"Authorization": f"Basic {ADMIN_KEY}"}, {"X-Api-Key": ADMIN_KEY}):
        denied = httpx.get(f"{keyed}/pool/status", headers=headers)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key", headers
    assert httpx.get(f"{keyed}/pool/status", headers=bearer(ADMIN_KEY)).status_code == 200
    # the admin key is not an API key, and /health and /metrics stay open (as in vLLM)
    assert httpx.get(f"{keyed}/v1/models", headers=bearer(ADMIN_KEY)).status_code == 401
    assert httpx.get(f"{keyed}/health").status_code == httpx.get(f"{keyed}/metrics").status_code == 200
    # spellings of the path that might route to /pool/status without passing the check
    for target in ("/pool/status", "/pool/status/", "/%70ool/status", "/pool/%73tatus", "//pool/status",
                   "/pool//status", "/v1/../pool/status", "/./pool/status", "/pool/status?x=1", "/POOL/status"):
        assert raw_get(keyed, target) in (401, 404, 307, 400), target
        assert raw_get(keyed, target, bearer(USER_KEY)) in (401, 404, 307, 400), target
    assert raw_get(keyed, "/%70ool/status", bearer(ADMIN_KEY)) == 200  # the check sees the decoded path


def test_without_an_admin_key_the_api_keys_guard_pool_endpoints(pool):
    settings = GatewaySettings(api_keys=(Secret(USER_KEY),))
    with BackgroundServer(create_app(pool, settings)) as server:
        assert httpx.get(f"{server.url}/pool/status").status_code == 401
        assert httpx.get(f"{server.url}/pool/status", headers=bearer(USER_KEY)).status_code == 200


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith(("httpx", "httpcore")):  # the test's own client, not the server
            self.lines.append(self.format(record))


def test_keys_never_reach_logs_status_metrics_or_answers(pool, capfd, keep_logging):
    settings = GatewaySettings(api_keys=(Secret(USER_KEY), Secret(OTHER_USER_KEY)), admin_keys=(Secret(ADMIN_KEY),))
    gateway_app = create_app(pool, settings)
    port = free_port()
    records = _Records()
    server = uvicorn.Server(uvicorn_config(gateway_app, "127.0.0.1", port, log_level="info"))  # as `modelpool serve`
    for logger in map(logging.getLogger, LOGGERS):
        logger.addHandler(records)
        logger.setLevel(logging.DEBUG)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    answers: list[str] = []
    try:
        while not server.started:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{port}"
        completion = {"model": "alpha", "prompt": "hello", "max_tokens": 4}
        calls = [("GET", "/v1/models", USER_KEY, None), ("POST", "/v1/completions", USER_KEY, completion),
                 ("POST", "/v1/completions", OTHER_USER_KEY, {**completion, "stream": True}),
                 ("POST", "/v1/completions", USER_KEY, {"model": "nope", "prompt": "x"}),
                 ("POST", "/v1/chat/completions", USER_KEY, {"model": "alpha", "messages": "not a list"}),
                 ("GET", "/v1/models", WRONG_KEY, None), ("GET", "/v1/models", ADMIN_KEY, None),
                 ("POST", "/v1/completions", WRONG_KEY, completion), ("GET", "/pool/status", WRONG_KEY, None),
                 ("GET", "/pool/status", USER_KEY, None), ("GET", "/pool/status", ADMIN_KEY, None),
                 ("GET", "/metrics", WRONG_KEY, None), ("GET", "/openapi.json", USER_KEY, None)]
        statuses = []
        for method, path, key, body in calls:
            answer = httpx.request(method, url + path, json=body, headers=bearer(key), timeout=30)
            statuses.append(answer.status_code)
            answers.append(f"{answer.status_code} {dict(answer.headers)} {answer.text}")
        bad_json = httpx.post(f"{url}/v1/completions", content=b"{not json", headers=bearer(USER_KEY))
        answers.append(bad_json.text)
        assert statuses == [200, 200, 200, 404, 400, 401, 401, 401, 401, 401, 200, 200, 200], statuses
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    out, err = capfd.readouterr()
    logged = "\n".join(records.lines) + out + err
    assert "Uvicorn running on http://127.0.0.1" in logged  # the capture does see the server's logging
    shown = "\n".join([logged, *answers, repr(settings), repr(gateway_app.state.gateway.keys),
                       json.dumps(gateway_app.state.gateway.status())])
    for key in ALL_KEYS:
        assert key not in shown and key[7:] not in shown, f"a key leaked: {key[:7]}..."


def test_the_gateway_binds_loopback_by_default(monkeypatch, tmp_path, keep_logging):
    assert uvicorn_config(object()).host == "127.0.0.1"
    assert BackgroundServer(object()).host == "127.0.0.1"
    bound: list[str] = []

    def run(self: uvicorn.Server, sockets: Any = None) -> None:  # what `modelpool serve` would listen on
        bound.append(self.config.host)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("pool: {gpu: h100, num_gpus: 2}\nmodels:\n  - {name: m, arch: qwen2.5-0.5b}\n")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    runner = CliRunner()
    for args, host in (([], "127.0.0.1"), (["--host", "0.0.0.0"], "0.0.0.0")):
        result = runner.invoke(cli, ["serve", "--engine", "sim", "--fleet", str(fleet), "--no-warmup", *args])
        assert result.exit_code == 0, result.output
        assert bound[-1] == host
    assert len(bound) == 2 and "RAY_AUTH_MODE" not in os.environ  # serve leaves Ray's token auth on


def test_the_embedded_ray_cluster_is_started_without_dashboard_or_disabled_auth(monkeypatch):
    import ray

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append({**kwargs, "auth": os.environ.get("RAY_AUTH_MODE")}))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    modelpool.serve.ray_init(None, 2)
    (embedded,) = calls
    assert embedded["include_dashboard"] is False and embedded["_node_ip_address"] == "127.0.0.1"
    assert embedded["auth"] is None  # Ray's own default for a new local cluster: token auth
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the operator's explicit choice is kept
    modelpool.serve.ray_init(None, 2)
    assert calls[-1]["auth"] == "disabled"


PROBE = """
import json, time
import httpx, psutil, ray
from modelpool.serve import ray_init


def scan():
    listening, accepted, refused, agent = [], [], [], []
    for proc in psutil.Process().children(recursive=True):
        try:
            conns = proc.net_connections(kind="inet")
            is_agent = "DashboardAgent" in " ".join(proc.cmdline()) or "dashboard/agent.py" in " ".join(proc.cmdline())
        except psutil.Error:
            continue
        for conn in conns:
            if conn.status != psutil.CONN_LISTEN:
                continue
            listening.append(conn.laddr.ip)
            host = "127.0.0.1" if conn.laddr.ip in ("::", "0.0.0.0") else conn.laddr.ip
            host = f"[{host}]" if ":" in host else host
            try:  # Ray's job agent runs any shell command it is sent
                answer = httpx.post(f"http://{host}:{conn.laddr.port}/api/job_agent/jobs/",
                                    json={"entrypoint": "true"}, timeout=3)
            except httpx.HTTPError:
                continue
            where = f"{conn.laddr.ip}:{conn.laddr.port}"
            if answer.status_code < 300:
                accepted.append(where)
            elif answer.status_code in (401, 403):
                refused.append(where)
            if is_agent and (answer.status_code < 300 or answer.status_code in (401, 403)):
                agent.append(where)
    return {"listening": listening, "accepted": accepted, "refused": refused, "agent": agent}


import socket
with socket.socket() as sock:  # another Ray cluster on this machine holds the agent's port: ours gets none
    if sock.connect_ex(("127.0.0.1", 52365)) == 0:
        print("PROBE-BUSY")
        raise SystemExit(0)
ray_init(None, 2)
deadline = time.monotonic() + 60
while not (found := scan())["agent"] and time.monotonic() < deadline:
    time.sleep(1)  # the dashboard agent, whose job API this is, starts its HTTP server last
ray.shutdown()
print("PROBE " + json.dumps(found))
"""


@pytest.mark.slow
def test_the_embedded_ray_cluster_refuses_unauthenticated_jobs(tmp_path):
    """Ray listens on every interface whatever its node address; token auth is what keeps its agents shut."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env.update(HOME=str(tmp_path), OMP_NUM_THREADS="1")  # Ray writes its token to ~/.ray/auth_token
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    if "PROBE-BUSY" in done.stdout:
        pytest.skip("another Ray cluster on this machine holds the dashboard agent's port 52365")
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-2000:]
    found = json.loads(line[6:])
    assert found["agent"] and found["accepted"] == [], found  # the dashboard agent's job API is up, and says 401
    assert (tmp_path / ".ray" / "auth_token").exists()
    wide = sorted({ip for ip in found["listening"] if ip not in ("127.0.0.1", "::1")})
    print(f"embedded Ray: {len(found['listening'])} listening sockets, on {wide or 'loopback only'} beyond "
          f"loopback; job submissions without a token refused at {found['refused']}, accepted at {found['accepted']}; the agent at {found['agent']}")
