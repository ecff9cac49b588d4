"""A decode instance's host KV bounds the hand-offs it takes (issue 34/37: mixed-onoff at the knee on an H100).

Before, every prefilled request joined a decode instance with no check of its
KV tiers: its homed KV grew without bound, its turn switches swapped batches
out into a full host store and the engine refused (`save_kv` / `import_kv`:
no free host blocks), re-queueing every request there. A fake engine host
store here refuses as the live one does: every SwapOut on the decode instance
saves the requests' KV into it, a SwapIn imports there what it does not hold
(the hand-offs) and restores all of it; more than `host_kv_bytes` at any point
is a refusal. With the bound, prefilled requests past what the tiers hold wait
with their KV on the prefill instance, and every request finishes.
"""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import SwapIn, SwapOut
from tests.factories import GB, LinearCosts, make_instances, make_models, make_sim, make_workload


class RefusingHostStore:
    """The decode engine's host KV store, as `save_kv` / `import_kv` / `restore_kv` fill and free it."""

    def __init__(self, instance_id: str, bound: float, need) -> None:
        self.instance_id, self.bound, self.need = instance_id, bound, need
        self.held: dict[str, float] = {}
        self.refusals: list[str] = []
        self.peak = 0.0

    def _check(self, call: str) -> None:
        used = sum(self.held.values())
        self.peak = max(self.peak, used)
        if used > self.bound:
            self.refusals.append(f"{call}: {used / GB:.2f} GB in a {self.bound / GB:.2f} GB host store")

    def apply(self, plan) -> None:
        for action in plan.actions.get(self.instance_id, ()):
            if isinstance(action, SwapOut):  # save_kv
                self.held.update({rid: self.need(rid) for rid in action.request_ids})
                self._check("save_kv")
            elif isinstance(action, SwapIn):  # import_kv of the hand-offs, then restore_kv of all
                self.held.update({rid: self.need(rid) for rid in action.request_ids if rid not in self.held})
                self._check("import_kv")
                for rid in action.request_ids:
                    self.held.pop(rid, None)


NUM, RATE, STEP = 200, 10.0, 0.05  # ~70 s of load; decode steps slow enough that members overflow 4 GB


def _run(host_gb: float | None):
    models = make_models(2, weight_gb=4.0, tpot_s=0.2, ttft_s=30.0)
    prefill, decode = make_instances(2, memory_gb=24.0, roles=["prefill", "decode"])
    host = None if host_gb is None else host_gb * GB  # both engines' host stores bounded, as in the live pool
    prefill = dataclasses.replace(prefill, kv_bytes=4 * GB, host_kv_bytes=host)
    decode = dataclasses.replace(decode, kv_bytes=4 * GB, host_kv_bytes=host)
    requests = make_workload(NUM, list(models), rate=RATE, max_prompt=2000, max_output=300)
    sim, sched = make_sim("token-level", models, [prefill, decode], requests, LinearCosts(step_s=STEP))
    store = RefusingHostStore("i1", (host_gb or 0) * GB, lambda rid: sched.kv_need_bytes(sched.requests[rid]))
    schedule = sched.schedule

    def schedule_and_check(now: float):
        plan = schedule(now)
        store.apply(plan)
        return plan

    sched.schedule = schedule_and_check
    records = sim.run()
    return sched, store, records


def test_unbounded_decode_host_overflows_a_small_store() -> None:
    """The load overflows the decode instance's device KV, so a 2 or 5 GB host store would refuse without the
    bound (the case the bound must handle, not an idle one)."""
    sched, store, records = _run(None)
    assert sched.instances["i1"].kv_capacity_bytes == 4 * GB  # type: ignore[attr-defined]
    assert store.peak > 5 * GB
    assert all(r.finished_at is not None and not r.failed for r in records.values())


@pytest.mark.parametrize("host_gb", [2.0, 5.0])  # less than the device's 4 GB of KV (no swap needed), and more
def test_hand_offs_wait_for_the_decode_instance_host_store(host_gb: float) -> None:
    sched, store, records = _run(host_gb)
    assert store.refusals == []
    assert store.peak > 0  # it swapped (the store was used), within its bound
    assert all(r.finished_at is not None and not r.failed for r in records.values()), \
        [(rid, r.failed) for rid, r in records.items() if r.finished_at is None or r.failed][:5]
    assert not sched.decode.waiting  # type: ignore[attr-defined]
