"""One trace through the simulator and through the live controller (fake engines, manual clock):
the Plan logs must be identical, byte for byte."""

from __future__ import annotations

import io

import pytest

from scheduler import make_scheduler
from sims.simulator import Simulator
from tests.factories import LinearCosts, make_instances, make_models, make_workload
from tests.parity.harness import run_pool

SETUPS = {  # policy, instance roles, policy options
    "token-level": ("token-level", ["prefill", "decode", "decode"], {}),
    "token-level, KV to host after the prefill": ("token-level", ["prefill", "decode", "decode"], {"first_tokens": 1}),
    "request-level": ("request-level", None, {}),
    "dedicated": ("dedicated", None, {}),
    "spatial": ("spatial", None, {}),
}


class _MoveOverheadCosts(LinearCosts):
    """LinearCosts with a per-move KV overhead (a calibrated profile's kv_move_fixed_s)."""

    def kv_move_overhead_s(self, model: str) -> float:
        return 0.004


@pytest.mark.parametrize("setup", list(SETUPS) + ["token-level, KV moves with a per-move overhead"])
def test_plan_logs_of_simulator_and_pool_are_identical(setup: str) -> None:
    policy, roles, options = SETUPS.get(setup, SETUPS["token-level, KV to host after the prefill"])
    models = make_models(3, weight_gb=20.0 if policy == "spatial" else 14.0)
    instances = make_instances(3, roles=roles)
    costs = _MoveOverheadCosts() if "overhead" in setup else LinearCosts()
    trace = make_workload(50, list(models), rate=4.0, seed=11, max_prompt=1500, max_output=200)

    sim_log = io.StringIO()
    sim_sched = make_scheduler(policy, models, instances, costs, **options)
    Simulator(sim_sched, costs, [r for r in make_workload(50, list(models), rate=4.0, seed=11, max_prompt=1500,
                                                           max_output=200)],
              kv_bytes_per_token={n: m.kv_bytes_per_token for n, m in models.items()}, plan_log=sim_log).run()

    pool_log = io.StringIO()
    pool_sched = make_scheduler(policy, models, instances, costs, keep_ended=False, **options)  # as the pool runs it
    controller = run_pool(pool_sched, costs, [i.instance_id for i in instances], trace, pool_log)

    sim_lines, pool_lines = sim_log.getvalue().splitlines(), pool_log.getvalue().splitlines()
    assert len(sim_lines) > 50
    for k, (a, b) in enumerate(zip(sim_lines, pool_lines)):
        assert a == b, f"plan {k} differs:\nsim:  {a}\npool: {b}"
    assert len(sim_lines) == len(pool_lines)
    assert controller.requests == {}  # every request finished and left the table
    assert all(r.status.value == "finished" for r in sim_sched.requests.values()) and len(sim_sched.requests) == 50
    assert pool_sched.requests == {}  # keep_ended=False: the scheduler forgot every request once it ended
