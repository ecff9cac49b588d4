"""A sim-engine pool behind a real uvicorn on 127.0.0.1, and what the reliability tests read back from it.

The models have no weights (placeholder tokenizer, `sim` engine on threads),
so a pool of three models on two instances starts in well under a second and
its pace is set by `LinearCosts`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from pool.actor import EngineSpec
from pool.config import PoolConfig
from pool.service import LivePool, ServedModel, slot_instances
from scheduler import ModelProfile
from tests.factories import LinearCosts

MODELS = ("alpha", "beta", "gamma")
GB = 1e9
LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "modelpool", "modelpool.gateway", "modelpool.pool",
           "fastapi")


def sim_models(names: Sequence[str] = MODELS, *, kv_per_token: int = 1000, ttft_s: float = 1.0,
               tpot_s: float = 0.1) -> list[ServedModel]:
    return [ServedModel(name, Path(f"<sim>/{name}"), ModelProfile(name, 1, 1 * GB, kv_per_token, 8192, ttft_s, tpot_s))
            for name in names]


def sim_pool(models: Sequence[ServedModel] | None = None, *, num_instances: int = 2, kv_bytes: int = 64 << 20,
             costs: Any = None, **limits: Any) -> LivePool:
    """A token-level pool of `models` (default: alpha, beta, gamma) on `num_instances` sim instances; not started."""
    models = list(models or sim_models())
    costs = costs or LinearCosts(step_s=0.004, prefill_per_token_s=1e-4, switch_s=0.02)
    instances = slot_instances(num_instances, models, kv_bytes)
    spec = EngineSpec("sim", {"costs": costs, "kv_bytes": int(instances[0].memory_bytes),
                              "kv_bytes_per_token": {m.name: m.profile.kv_bytes_per_token for m in models}})
    return LivePool(models, instances, "token-level", costs,
                    PoolConfig(engine=spec, backend="threads", stats_interval_s=0.05, **limits))


def status(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/pool/status", headers=headers, timeout=10).json())


def allocated(state: dict[str, Any]) -> dict[str, int]:
    """What the pool still holds for requests: live requests, reserved and engine-side KV, queued/running counts."""
    instances = state["instances"].values()
    return {"requests_in_pool": state["requests_in_pool"],
            "kv_used_bytes": sum(i["kv_used_bytes"] for i in instances),
            "engine_requests": sum(i["engine"].get("num_requests", 0) for i in instances),
            "engine_kv_bytes": sum(i["engine"].get("kv_device_used_bytes", 0) + i["engine"].get("kv_host_used_bytes", 0)
                                   for i in instances),
            "queued": sum(m["queued"] for m in state["models"].values()),
            "running": sum(m["running"] for m in state["models"].values()),
            "streams": state.get("gateway", {}).get("streams", 0)}


def wait_until(check: Callable[[], Any], timeout_s: float, every_s: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every_s)


def wait_empty(url: str, timeout_s: float) -> tuple[bool, dict[str, int], float]:
    """(whether the pool let go of everything within `timeout_s`, what it still held last, seconds it took)."""
    started = time.monotonic()
    last: dict[str, int] = {}

    def empty() -> bool:
        nonlocal last
        last = allocated(status(url))
        return not any(last.values())

    ok = bool(wait_until(empty, timeout_s))
    return ok, last, time.monotonic() - started


@pytest.fixture
def keep_logging() -> Iterator[None]:
    """Each uvicorn config replaces uvicorn's log handlers (under CliRunner or capfd, with ones on a stream that is
    closed afterwards): put the old ones back."""
    loggers = [logging.getLogger(name) for name in LOGGERS]
    saved = [(logger.level, list(logger.handlers)) for logger in loggers]
    yield
    for logger, (level, handlers) in zip(loggers, saved):
        logger.setLevel(level)
        logger.handlers[:] = handlers
