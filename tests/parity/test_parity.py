"""One trace through the simulator and through the live controller (fake engines, manual clock):
the Plan logs must be identical, byte for byte, and the fake engines - which enforce the engine contract
through the instance model (tests/parity/harness.py) - must have refused nothing. A deliberately bad Plan
is refused."""

from __future__ import annotations

import dataclasses
import io

import pytest

from typing import Any

from scheduler import ManualClock, Plan, Prefill, Switch, make_scheduler
from sims.simulator import Simulator
from tests.factories import GB, LinearCosts, make_instances, make_models, make_workload
from tests.parity.harness import ManualBackend, model_memory, run_pool

SETUPS = {  # policy, instance roles, policy options
    "token-level": ("token-level", ["prefill", "decode", "decode"], {}),
    "token-level, KV to host after the prefill": ("token-level", ["prefill", "decode", "decode"], {"first_tokens": 1}),
    "request-level": ("request-level", None, {}),
    "dedicated": ("dedicated", None, {}),
    "spatial": ("spatial", None, {}),
}
TIGHT_KV_GB = 0.3  # an instance's device KV in the KV-bound setups: ~3 of the trace's largest requests


class _MoveOverheadCosts(LinearCosts):
    """LinearCosts with a per-move KV overhead (a calibrated profile's kv_move_fixed_s)."""

    def kv_move_overhead_s(self, model: str) -> float:
        return 0.004


KV_BOUND = [f"{name}, KV for a few requests" for name in ("token-level", "request-level", "spatial")]


@pytest.mark.parametrize("setup", list(SETUPS) + ["token-level, KV moves with a per-move overhead"] + KV_BOUND)
def test_plan_logs_of_simulator_and_pool_are_identical(setup: str) -> None:
    policy, roles, options = SETUPS.get(setup.removesuffix(", KV for a few requests"),
                                        SETUPS["token-level, KV to host after the prefill"])
    models = make_models(3, weight_gb=20.0 if policy == "spatial" else 14.0)
    instances = make_instances(3, roles=roles)
    kv_bytes = None
    if setup in KV_BOUND:  # the engines' KV is small and known: the scheduler plans with it, the fakes enforce it
        instances = [dataclasses.replace(i, kv_bytes=TIGHT_KV_GB * GB) for i in instances]
        kv_bytes = {i.instance_id: TIGHT_KV_GB * GB for i in instances}
    costs = _MoveOverheadCosts() if "overhead" in setup else LinearCosts()
    trace = make_workload(50, list(models), rate=4.0, seed=11, max_prompt=1500, max_output=200)
    per_token = {n: m.kv_bytes_per_token for n, m in models.items()}

    sim_log = io.StringIO()
    sim_sched = make_scheduler(policy, models, instances, costs, **options)
    Simulator(sim_sched, costs, [r for r in make_workload(50, list(models), rate=4.0, seed=11, max_prompt=1500,
                                                           max_output=200)],
              kv_bytes_per_token=per_token, kv_capacity=kv_bytes, plan_log=sim_log).run()

    pool_log = io.StringIO()
    pool_sched = make_scheduler(policy, models, instances, costs, keep_ended=False, **options)  # as the pool runs it
    # the fakes hold each instance's models within the memory its spec leaves them, as the engines' regions do
    backend = ManualBackend(ManualClock(), costs, models=list(models), kv_bytes=kv_bytes, kv_bytes_per_token=per_token,
                            model_memory_bytes=model_memory(instances),
                            model_bytes={n: m.weight_bytes for n, m in models.items()})
    controller = run_pool(pool_sched, costs, [i.instance_id for i in instances], trace, pool_log, backend)
    assert backend.refused == []  # every call of every Plan is one an engine carries out
    if kv_bytes:  # and the KV bound: some instance held most of what its device has
        assert max(inst.kv.peak_bytes for inst in backend.instances.values()) > 0.8 * TIGHT_KV_GB * GB

    sim_lines, pool_lines = sim_log.getvalue().splitlines(), pool_log.getvalue().splitlines()
    assert len(sim_lines) > 50
    for k, (a, b) in enumerate(zip(sim_lines, pool_lines)):
        assert a == b, f"plan {k} differs:\nsim:  {a}\npool: {b}"
    assert len(sim_lines) == len(pool_lines)
    assert controller.requests == {}  # every request finished and left the table
    assert all(r.status.value == "finished" for r in sim_sched.requests.values()) and len(sim_sched.requests) == 50
    assert pool_sched.requests == {}  # keep_ended=False: the scheduler forgot every request once it ended


class _DropsSwitches:
    """A scheduler that forgets to send its Switch actions: the Plans it hands out are ones an engine refuses
    (a prefill of a model that is not resident)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def schedule(self, now: float) -> Plan:
        plan = self.inner.schedule(now)
        kept = {iid: tuple(a for a in acts if not isinstance(a, Switch)) for iid, acts in plan.actions.items()}
        return Plan(plan.at, {iid: acts for iid, acts in kept.items() if acts}, plan.failed)


def test_the_fake_engines_refuse_a_plan_an_engine_would_refuse() -> None:
    models = make_models(2)
    instances = make_instances(1)
    costs = LinearCosts()
    trace = make_workload(4, list(models), rate=4.0, seed=3, max_prompt=200, max_output=8)
    scheduler = _DropsSwitches(make_scheduler("request-level", models, instances, costs, keep_ended=False))
    backend = ManualBackend(ManualClock(), costs, models=list(models))
    log = io.StringIO()
    controller = run_pool(scheduler, costs, ["i0"], trace, log, backend)
    assert any('"op":"Prefill"' in line for line in log.getvalue().splitlines())  # the bad Plan was sent
    assert backend.refused and "not resident" in backend.refused[0] and backend.refused[0].startswith("i0 prefill")
    assert controller.lost == {"i0"} and len(controller.requests) == 4  # written off, nothing served


def test_the_fake_engines_refuse_kv_the_scheduler_overbooks() -> None:
    """A scheduler told of more KV than the engines have (4 GB planned, 0.3 GB there): the fakes refuse the
    KV that does not fit with the engine's out-of-KV error, which the pool takes as a refusal - the
    requests go back to the queue, no instance is lost, every request ends."""
    models = make_models(3)
    instances = [dataclasses.replace(i, kv_bytes=4 * GB) for i in make_instances(2)]
    costs = LinearCosts()
    trace = make_workload(30, list(models), rate=4.0, seed=11, max_prompt=1500, max_output=200)
    backend = ManualBackend(ManualClock(), costs, models=list(models), kv_bytes={i.instance_id: 0.3 * GB for i in instances},
                            kv_bytes_per_token={n: m.kv_bytes_per_token for n, m in models.items()})
    controller = run_pool(make_scheduler("request-level", models, instances, costs, keep_ended=False), costs,
                          [i.instance_id for i in instances], trace, io.StringIO(), backend)
    assert backend.refused and all("no room for the KV" in why for why in backend.refused)
    assert controller.num_kv_refusals == len(backend.refused) and not controller.lost and controller.requests == {}


def test_the_fake_engines_refuse_models_the_scheduler_co_locates_past_their_memory() -> None:
    """Spatial told of more device memory than the engines have (80 GB planned, 30 GB of model memory there):
    it co-locates three 14 GB models on an instance, and the fakes refuse the co-location that does not fit,
    naming the models and the memory, as the torch engine's model region does. Within the memory (the
    parity runs) nothing is refused."""
    models = make_models(3, weight_gb=14.0)
    instances = make_instances(1)
    costs = LinearCosts()
    trace = make_workload(6, list(models), rate=4.0, seed=3, max_prompt=200, max_output=8)
    backend = ManualBackend(ManualClock(), costs, models=list(models), model_memory_bytes={"i0": 30 * GB},
                            model_bytes={n: m.weight_bytes for n, m in models.items()})
    run_pool(make_scheduler("spatial", models, instances, costs, keep_ended=False), costs, ["i0"], trace,
             io.StringIO(), backend)
    assert backend.refused and "model region holds" in backend.refused[0]
    assert backend.refused[0].startswith("i0 activate: co-locating")
