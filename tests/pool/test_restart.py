"""Controller and gateway restarts: clients in flight get a clean error, not a hang; after the restart new
requests are served again; nothing stays allocated (status, /pool/status, the old pool's Ray actors).

One Ray pool (torch engine, the three tiny demo models on one CPU slot) serves both tests, behind uvicorn
on 127.0.0.1 with streaming httpx clients.
"""

from __future__ import annotations

import httpx
import pytest

from pool.gateway import create_app
from pool.gateway.server import BackgroundServer
from tests.pool.fault_tools import (NOTHING, allocated, run_streams, stop_serve, stream_completion, wait_for_serve,
                                     wait_until)
from tests.pool.test_faults import LONG_TOKENS, MODELS, ray_pool, stream_bodies, tally
from tests.pool.test_live_pool import tiny  # noqa: F401
from tests.pool.test_faults import ray_cluster  # noqa: F401

TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def pool(tiny, ray_cluster):  # noqa: F811
    pool = ray_pool(tiny, 1).start()
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def reference(pool):
    """Every stream's text in an uninterrupted run."""
    with BackgroundServer(create_app(pool)) as server:
        _, join = run_streams(server.url, stream_bodies(), TIMEOUT_S)
        streams = join()
    assert all(s.kind == "finished" for s in streams.values()), streams
    return streams


def pool_status(url: str) -> dict:
    return httpx.get(f"{url}/pool/status", timeout=10).json()


def held_in(status: dict) -> dict:
    return {"requests_in_pool": status["requests_in_pool"],
            "kv_used_bytes": sum(i["kv_used_bytes"] for i in status["instances"].values()),
            "requests_on_device": sum(i["requests_on_device"] for i in status["instances"].values()),
            "queued": sum(m["queued"] + m["running"] + m["scheduler_queue"] for m in status["models"].values()),
            "kv_reserved_bytes": sum(m["kv_reserved_bytes"] for m in status["models"].values())}


def start_streams(url: str):
    started, join = run_streams(url, stream_bodies(), TIMEOUT_S)
    assert all(event.wait(60) for event in started.values()), "streams did not start"
    return join


def test_controller_restart_ends_streams_cleanly_and_serves_again(pool, reference) -> None:
    import ray

    with BackgroundServer(create_app(pool)) as server:
        join = start_streams(server.url)
        old_actors = pool.actors()
        pool.stop()  # the controller loop and its instances go; the gateway stays up
        streams = join()
        counts = tally(streams, reference)
        print(f"\ncontroller restart with {len(streams)} streams in flight: {counts}")
        assert counts["hung"] == counts["cut"] == counts["wrong"] == 0, streams
        assert counts["clean_errors"] >= 1 and counts["identical"] + counts["clean_errors"] == len(streams)
        assert all(s.error["code"] == "pool_unavailable" for s in streams.values() if s.error), streams
        # while it is down: 503 with Retry-After, and nothing held
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.headers["retry-after"]
        down = stream_completion(server.url, stream_bodies()[(MODELS[0], 0)], TIMEOUT_S)
        assert down.status == 503 and down.kind == "clean_error", down
        assert held_in(pool_status(server.url)) == NOTHING and allocated(pool) == NOTHING
        assert pool_status(server.url)["ready"] is False
        for actor in old_actors.values():  # the old pool's actors are gone
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.ready.remote(), timeout=30)
        pool.start()
        assert set(pool.actors()) == set(old_actors) and not set(pool.actors().values()) & set(old_actors.values())
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        _, join = run_streams(server.url, stream_bodies(), TIMEOUT_S)
        assert tally(join(), reference)["identical"] == len(reference)
        wait_until(lambda: held_in(pool_status(server.url)) == NOTHING, 10, "nothing allocated after the restart")


def test_gateway_restart_ends_streams_cleanly_and_the_new_one_serves(pool, reference) -> None:
    server = BackgroundServer(create_app(pool)).start()
    join = start_streams(server.url)
    server.stop()  # stops listening, ends what is in flight, exits
    assert not server.thread.is_alive()
    streams = join()
    counts = tally(streams, reference)
    print(f"\ngateway restart with {len(streams)} streams in flight: {counts}")
    assert counts["hung"] == counts["cut"] == counts["wrong"] == 0, streams
    assert counts["clean_errors"] >= 1 and counts["identical"] + counts["clean_errors"] == len(streams)
    assert all("shutting down" in s.error["message"] for s in streams.values() if s.error), streams
    wait_until(lambda: allocated(pool) == NOTHING, 10, f"nothing allocated: {allocated(pool)}")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)
    with BackgroundServer(create_app(pool), port=server.port) as again:  # restarted on the same port
        assert httpx.get(f"{again.url}/health", timeout=10).status_code == 200
        _, join = run_streams(again.url, stream_bodies(), TIMEOUT_S)
        assert tally(join(), reference)["identical"] == len(reference)
        wait_until(lambda: held_in(pool_status(again.url)) == NOTHING, 10, "nothing allocated after the restart")
    assert pool.status()["tick_errors"] == 0 and LONG_TOKENS > 0


def test_modelpool_serve_stopped_mid_stream_ends_streams_cleanly_and_serves_again(demo_models) -> None:
    """`modelpool serve --engine sim` as a process: SIGTERM with streams in flight ends each with an SSE error
    event and the process exits 0; served again on the same port, it answers."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from pool.gateway.server import free_port

    port, url = free_port(), ""
    env = {**os.environ, "MODELPOOL_CACHE": str(next(iter(demo_models.values())).parent), "OMP_NUM_THREADS": "1"}
    bodies = {(name, 0): {"model": name, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
              for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")}
    for run in ("stopped mid-stream", "restarted"):
        proc = subprocess.Popen([sys.executable, "-m", "modelpool.cli", "serve", "--engine", "sim", "--no-warmup",
                                 "--port", str(port)], cwd=Path(__file__).resolve().parents[2], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            url, _ = wait_for_serve(proc)
            assert url == f"http://127.0.0.1:{port}"
            if run == "restarted":
                done = stream_completion(url, {**bodies[("tiny-llama", 0)], "max_tokens": 8}, TIMEOUT_S)
                assert done.kind == "finished", done
                continue
            started, join = run_streams(url, bodies, TIMEOUT_S)
            assert all(event.wait(60) for event in started.values()), "streams did not start"
            proc.send_signal(signal.SIGTERM)
            streams = join()
            print(f"\nmodelpool serve SIGTERM with {len(streams)} streams in flight: "
                  f"{[s.kind for s in streams.values()]}")
            assert all(s.kind == "clean_error" and "shutting down" in s.error["message"] for s in streams.values()), \
                streams
        finally:
            stop_serve(proc, interrupt=run == "restarted")  # "stopped mid-stream" was sent SIGTERM
        rest = proc.stdout.read()  # type: ignore[union-attr]
        assert proc.returncode == 0 and "Traceback" not in rest, rest
