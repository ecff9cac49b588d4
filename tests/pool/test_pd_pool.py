"""Token-level with a prefill/decode split in the live pool: KV is prefilled on one instance,
moves through host memory to another, and decoding there gives the uninterrupted tokens."""

from __future__ import annotations

import io
import json

import pytest

from pool.config import PoolConfig
from pool.service import LivePool, served_model, slot_instances
from tests.factories import LinearCosts
from tests.pool.test_live_pool import ENGINE, KV_BYTES, reference, run_requests, tiny  # noqa: F401


def _shm_files() -> set[str]:
    from pool.procs import _SHM_DIR

    return {p.name for p in _SHM_DIR.glob("modelpool-*") if not p.name.startswith("modelpool-tp-")}


@pytest.mark.parametrize("backend", ["inprocess", "ray", "processes"])  # processes: the KV handed over in /dev/shm
def test_prefill_and_decode_on_different_instances(backend: str, tiny, reference) -> None:  # noqa: F811
    import ray

    models = [served_model(name, path, dtype="float32") for name, path in tiny.items()]
    if backend == "ray":
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    log = io.StringIO()
    shm_before = _shm_files()
    try:
        pool = LivePool(models, slot_instances(2, models, KV_BYTES, roles=["prefill", "decode"]), "token-level",
                        LinearCosts(),
                        PoolConfig(engine=ENGINE, backend=backend, policy_options={"fixed_turn_steps": 3}),
                        plan_log=log)
        with pool:
            sinks = run_requests(pool, timeout_s=300)
    finally:
        if backend == "ray":
            ray.shutdown()
    for key, sink in sinks.items():
        assert sink.tokens == reference[key], key
    assert _shm_files() <= shm_before, "every handed-over KV file in shared memory is gone with its request"
    plans = [json.loads(line)["actions"] for line in log.getvalue().splitlines()]
    prefill_ops = {a["op"] for p in plans for a in p.get("slot0", [])}
    decode_ops = {a["op"] for p in plans for a in p.get("slot1", [])}
    # the prefill instance may produce the first few tokens itself, then hands the KV over
    assert {"Prefill", "SwapOut"} <= prefill_ops
    assert {"SwapIn", "Decode"} <= decode_ops and "Prefill" not in decode_ops
