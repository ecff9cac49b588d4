"""Running the gateway under uvicorn: in the foreground (`modelpool serve`) or on a background thread (tests, benchmarks).

`GatewayServer` is uvicorn's server with one change at shutdown: once it
stops listening, every request still in the gateway's pool ends at once
with `PoolClosed` (a stream's last event is then a 503 error, a plain
request gets a 503), so no client is cut mid-stream after the graceful
timeout or waits for a server that is going away. The gateway owns its
pool: `modelpool serve` stops the pool next; a restarted gateway on the
same pool starts with nothing held.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import uvicorn

log = logging.getLogger("modelpool.gateway")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's settings for the gateway `app`: its connection cap (`GatewaySettings.max_connections`: past it
    uvicorn answers 503 at once, so half-sent bodies cannot pile up without bound) among them."""
    gateway = getattr(getattr(app, "state", None), "gateway", None)
    cap = gateway.settings.max_connections if gateway is not None else None
    # no access log: it would be noise at token rates; keys are never in it either way
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off",
                          timeout_keep_alive=30, timeout_graceful_shutdown=5, limit_concurrency=cap)


class GatewayServer(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting first (uvicorn closes them again: harmless)
            server.close()
        gateway = getattr(getattr(self.config.app, "state", None), "gateway", None)
        if gateway is not None:
            ended = gateway.pool.abort_all("the gateway is shutting down")
            if ended:
                log.warning("gateway shutting down: ended %d request(s) in flight", ended)
        await super().shutdown(sockets)


class BackgroundServer:
    """uvicorn on a daemon thread; `url` once started; `stop()` shuts it down."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None,
                 sock: socket.socket | None = None) -> None:
        if sock is not None:  # serve on a socket the caller bound (and tuned)
            host, port = sock.getsockname()[:2]
        self.host = host
        self.port = port or free_port(host)
        self.server = GatewayServer(uvicorn_config(app, host, self.port))
        sockets = [sock] if sock is not None else None
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets}, name="modelpool-gateway",
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def open_connections(self) -> int:
        """Client connections uvicorn holds now (a closed client's goes once the server has read its close)."""
        return len(self.server.server_state.connections)

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
