"""Pool health (issue 37, 3-5): a heartbeat finds hung and dead engines while idle, a hung one is killed and
replaced at once, and /health and /ready say whether every model can be served.

Sim engines in worker processes (`--backend processes`): a process stopped
with SIGSTOP is alive and silent, as a hung engine is; one killed with
SIGKILL is a crash (and what it left in /dev/shm is removed with it).
Nothing is sent to the pool: before, an idle instance's
death or hang went unnoticed (status showed it up) until a request paid for it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pool.actor import EngineSpec
from pool.config import PoolConfig
from pool.engines.tp_files import store_stem
from pool.gateway import create_app
from pool.gateway.server import BackgroundServer
from pool.service import LivePool, slot_instances
from tests.factories import LinearCosts
from tests.pool.sim_gateway import sim_models, sim_pool

COSTS = LinearCosts(step_s=0.002, prefill_per_token_s=1e-5, switch_s=0.01)


def process_pool(**options) -> LivePool:
    models = sim_models(["alpha"])
    instances = slot_instances(2, models, 64 << 20)
    spec = EngineSpec("sim", {"costs": COSTS, "kv_bytes": int(instances[0].memory_bytes),
                              "kv_bytes_per_token": {m.name: m.profile.kv_bytes_per_token for m in models}})
    return LivePool(models, instances, "token-level", COSTS,
                    PoolConfig(engine=spec, backend="processes", stats_interval_s=0.5, heartbeat_timeout_s=2.0,
                               **options))


@pytest.fixture()
def pool() -> Iterator[LivePool]:
    pool = process_pool().start()
    yield pool
    pool.stop()


def wait_for(check, timeout_s: float) -> float:
    """Seconds until `check()` held (fails past `timeout_s`)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def pid_of(pool: LivePool, instance_id: str) -> int:
    return pool._backend.workers[instance_id].process.pid


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between the open and the read
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "hung"])
def test_an_idle_instance_that_dies_or_hangs_is_found_and_replaced_within_seconds(pool, sig) -> None:
    old = pid_of(pool, "slot0")
    store = Path(store_stem(old) + "rendezvous")  # what a TP rank 0 in that process would have made
    store.touch()
    os.kill(old, sig)
    try:
        found = wait_for(lambda: pool.status()["restarts"] >= 1, 10.0)  # heartbeat 0.5 s, deadline 2 s
        killed = wait_for(lambda: not alive(old), 8.0)  # a hung process is killed after a 2 s grace, not 60 s
        # a fresh worker process (its start-up is the slow part on a loaded machine)
        back = wait_for(lambda: pool.status()["lost_instances"] == [] and pid_of(pool, "slot0") != old, 90.0)
        assert not store.exists()  # removed with the process: /dev/shm left clean
        print(f"\n{sig.name}: written off after {found:.1f} s, killed {killed:.1f} s later, "
              f"replaced {back:.1f} s after that")
    finally:
        if alive(old):
            os.kill(old, signal.SIGKILL)
        store.unlink(missing_ok=True)


def test_health_and_ready_are_503_exactly_when_a_model_has_no_instance() -> None:
    pool = sim_pool(max_restarts=0).start()
    try:
        with BackgroundServer(create_app(pool)) as server:
            def answers() -> tuple[int, int]:
                return (httpx.get(f"{server.url}/health", timeout=5).status_code,
                        httpx.get(f"{server.url}/ready", timeout=5).status_code)

            assert answers() == (200, 200)
            pool.kill_instance("slot0")
            wait_for(lambda: pool.status()["lost_instances"] == ["slot0"], 10.0)
            assert answers() == (200, 200)  # slot1 serves every model
            pool.kill_instance("slot1")
            wait_for(lambda: answers() == (503, 503), 10.0)
            body = httpx.get(f"{server.url}/health", timeout=5).json()["error"]
            assert "no instance can serve" in body["message"] and "alpha" in body["message"]
    finally:
        pool.stop()
    assert sim_pool().unservable_models(now=False) == ["alpha", "beta", "gamma"]  # not started: nothing served
