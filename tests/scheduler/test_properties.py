"""Invariants over random workloads, checked by running the real simulator.

The simulator's executor raises InvariantViolation when a Plan decodes or
prefills a model that is not loaded on that instance, decodes a request whose
KV is not on that device, or puts more KV on a device than it holds.
"""

from __future__ import annotations

import io
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Cancelled, RequestStatus, TERMINAL
from tests.factories import make_instances, make_models, make_workload, run_sim

SETUPS = {
    "dedicated": (3, None),
    "request-level": (2, None),
    "spatial": (2, None),
    "token-level": (3, ["prefill", "decode", "decode"]),
}

workloads = st.fixed_dictionaries({
    "num": st.integers(1, 60),
    "seed": st.integers(0, 10_000),
    "rate": st.floats(0.5, 20.0),
    "num_models": st.integers(1, 3),
    "max_prompt": st.integers(1, 6000),
    "max_output": st.integers(1, 400),
})


def _check(policy: str, w: dict, memory_gb: float = 80.0, **options) -> None:
    num_instances, roles = SETUPS[policy]
    models = make_models(w["num_models"] if policy != "dedicated" else 3)
    requests = make_workload(w["num"], list(models)[: w["num_models"]], rate=w["rate"], seed=w["seed"],
                             max_prompt=w["max_prompt"], max_output=w["max_output"])
    log = io.StringIO()
    sim, sched = run_sim(policy, models, make_instances(num_instances, roles=roles, memory_gb=memory_gb), requests,
                         plan_log=log, **options)
    # every submitted request ends exactly once
    ended = [r for r in sched.requests.values() if r.status in TERMINAL]
    assert len(ended) == len(requests) == len(sched.requests)
    for req in sched.requests.values():
        record = sim.records[req.request_id]
        if req.status is RequestStatus.FINISHED:
            assert record.generated == record.output_tokens == req.num_output_tokens
            assert record.finished_at is not None and record.first_token_at <= record.finished_at
        else:
            assert req.status is RequestStatus.FAILED and record.failed
    # nothing holds KV at the end; no instance is left busy
    for inst in sched.instances.values():
        assert inst.kv_used_bytes == 0 and not inst.inflight
    # the Plan log ends each request once: a failed request is in one plan's `failed` list, a finished one in none,
    # and no action names a request after it ended
    failed_at: dict[str, float] = {}
    last_named_at: dict[str, float] = {}
    for line in log.getvalue().splitlines():
        plan = json.loads(line)
        for request_id, _why in plan["failed"]:
            assert request_id not in failed_at, f"{request_id} failed twice"
            failed_at[request_id] = plan["at"]
        for actions in plan["actions"].values():
            for action in actions:
                named = [*action.get("request_ids", ()), *(rid for rid, _ in action.get("prefill_chunks", ()))]
                for request_id in named:
                    assert request_id not in failed_at, f"{request_id} is planned after it failed"
                    last_named_at[request_id] = plan["at"]
    for req in sched.requests.values():
        rid = req.request_id
        if req.status is RequestStatus.FINISHED:
            assert rid not in failed_at and last_named_at[rid] <= sim.records[rid].finished_at + 1e-9
        else:
            assert rid in failed_at


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_dedicated_invariants(w: dict) -> None:
    _check("dedicated", w)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_request_level_invariants(w: dict) -> None:
    _check("request-level", w)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_spatial_invariants(w: dict) -> None:
    _check("spatial", w, memory_gb=60.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads, st.sampled_from([None, 1, 3, 7]))
def test_token_level_invariants(w: dict, fixed_steps: int | None) -> None:
    _check("token-level", w, fixed_turn_steps=fixed_steps)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_token_level_small_kv_forces_many_batches(w: dict) -> None:
    # 32 GB instances: 2 x 14 GB of model regions leave 4 GB of KV, so rounds split into batches
    _check("token-level", w, memory_gb=32.0)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_token_level_does_not_starve_under_bounded_load(w: dict) -> None:
    """With load well under capacity every request meets its TTFT SLO, and its decode keeps the TPOT SLO's
    pace but for at most one model switch (a request handed off after its first tokens may find its decode
    instance holding another model: one switch, spread over its tokens, which a short answer cannot hide)."""
    from tests.factories import LinearCosts

    w = {**w, "rate": min(w["rate"], 2.0), "max_prompt": min(w["max_prompt"], 2000)}
    models = make_models(w["num_models"])
    costs = LinearCosts()
    requests = make_workload(w["num"], list(models), rate=w["rate"], seed=w["seed"],
                             max_prompt=w["max_prompt"], max_output=w["max_output"])
    sim, _ = run_sim("token-level", models, make_instances(3, roles=["prefill", "decode", "decode"]), requests,
                     costs=costs)
    for record in sim.records.values():
        slo = models[record.model]
        assert record.finished_at is not None and record.first_token_at is not None
        assert record.first_token_at - record.arrival_at <= slo.ttft_slo_s
        decode_s = record.finished_at - record.first_token_at
        assert decode_s <= (record.output_tokens - 1) * slo.tpot_slo_s + costs.switch_s(record.model), record


def test_cancel_and_fault_end_every_request_once() -> None:
    from tests.factories import LinearCosts
    from scheduler import make_scheduler
    from sims.simulator import Simulator

    models = make_models(2)
    requests = make_workload(40, list(models), rate=5.0, seed=3)
    sched = make_scheduler("token-level", models, make_instances(3, roles=["prefill", "decode", "decode"]),
                           LinearCosts())
    sim = Simulator(sched, LinearCosts(), requests, kv_bytes_per_token={n: m.kv_bytes_per_token for n, m in models.items()},
                    faults=[(3.0, "i2")])
    sim.run(until=2.0)
    sched.on_event(Cancelled(requests[0].request_id), 2.0)
    sim.run()
    statuses = [r.status for r in sched.requests.values()]
    assert all(s in TERMINAL for s in statuses)
    assert sched.requests[requests[0].request_id].status in (RequestStatus.CANCELLED, RequestStatus.FINISHED)
    # the lost decoder's requests were re-queued and finished on the survivor
    assert sched.instances["i2"].lost
    assert sum(s is RequestStatus.FINISHED for s in statuses) >= len(requests) - 1
