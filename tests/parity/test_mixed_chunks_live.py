"""The live controller runs token-level's mixed iterations (a Decode with prefill_chunks) on the parity fakes:
every call is one an engine carries out, every request finishes with all its tokens.

Not byte-for-byte parity with the simulator: the engines have no chunked prefill, so the runner computes a
prompt whole with its last chunk (pool.runner), where the simulator charges each chunk with its iteration
(CostModel.mixed_step_s); the two Plan logs part at the first chunked prompt's timing."""

from __future__ import annotations

import io
import json

from scheduler import ManualClock, make_scheduler
from tests.factories import LinearCosts, make_instances, make_models, make_workload
from tests.parity.harness import ManualBackend, model_memory, run_pool


def test_the_pool_runs_mixed_iterations_to_the_end() -> None:
    models = make_models(2)
    instances = make_instances(2, roles=["mixed", "mixed"])
    costs = LinearCosts(step_s=0.02)
    trace = make_workload(40, list(models), rate=4.0, seed=5, max_prompt=3000, max_output=200)
    per_token = {n: m.kv_bytes_per_token for n, m in models.items()}
    sched = make_scheduler("token-level", models, instances, costs, keep_ended=False)
    backend = ManualBackend(ManualClock(), costs, models=list(models), kv_bytes_per_token=per_token,
                            model_memory_bytes=model_memory(instances),
                            model_bytes={n: m.weight_bytes for n, m in models.items()})
    log = io.StringIO()
    controller = run_pool(sched, costs, [i.instance_id for i in instances], trace, log, backend)
    assert backend.refused == []
    chunked = [a for line in log.getvalue().splitlines() for acts in json.loads(line)["actions"].values()
               for a in acts if a.get("prefill_chunks")]
    assert chunked, "the trace should make mixed iterations"
    assert any(len(a["prefill_chunks"]) and a["request_ids"] for a in chunked)
    assert controller.requests == {}  # every request finished and left the table
    assert sched.requests == {}
