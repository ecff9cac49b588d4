"""The decode step an engine queues ahead (costs.decode_ahead: the torch engine on CUDA) and the next call
discards: the simulator charges it to the instance's next work, and nothing where the next turn takes it."""

from __future__ import annotations

import io

import pytest

from scheduler import Request
from scheduler.plan import Prefetch
from tests.factories import LinearCosts, make_instances, make_models, make_sim

STEP = 0.01  # LinearCosts' decode step (plus 1e-7 s per context token)


class _AheadCosts(LinearCosts):
    def decode_ahead(self) -> bool:
        return True


class _AheadHostCosts(_AheadCosts):
    def call_host_s(self, model: str, num_rows: int = 1) -> float:
        return 0.004  # of each call (a step's host part, after its device work)


def _run(costs: LinearCosts, requests: list[tuple], roles: list[str] | None = None) -> tuple[dict, str]:
    """Simulated records and plan log of fresh Requests (id, model, arrival, prompt, output) on token-level."""
    models = make_models(2)
    requests = [Request(*row) for row in requests]
    instances = make_instances(len(roles) if roles else 1, roles=roles)
    log = io.StringIO()
    sim, _ = make_sim("token-level", models, instances, requests, costs=costs, plan_log=log)
    sim.run()
    return sim.records, log.getvalue()


def _discarded(costs: LinearCosts, requests: list[tuple]) -> dict[str, int]:
    from sims.metrics import _device_figures

    sim, _ = make_sim("token-level", make_models(2), make_instances(1), [Request(*row) for row in requests], costs=costs)
    sim.run()
    return _device_figures(sim.devices, 1.0, None, {})["decode_steps_discarded"]


def test_turns_that_go_on_with_the_same_requests_take_the_step_queued_ahead_at_no_cost() -> None:
    pair = [("r0", "m0", 0.0, 300, 50), ("r1", "m0", 0.0, 300, 200)]  # r0 ends with the first turn, r1 goes on
    plain, plain_log = _run(LinearCosts(), pair)
    ahead, ahead_log = _run(_AheadCosts(), pair)
    assert plain_log.count('"Decode"') == 2  # a turn of both, then one of r1: it takes the step queued for it
    for rid in ("r0", "r1"):
        assert ahead[rid].finished_at == pytest.approx(plain[rid].finished_at, abs=1e-12)
    assert ahead_log == plain_log


def test_a_call_that_breaks_the_turn_waits_for_the_step_queued_ahead() -> None:
    """r1 arrives while r0 decodes on the one instance: the Stop cuts r0's turn and the iteration that prefills
    r1 discards r0's step queued ahead, so it starts one decode step later; with a host part per call (inside
    each step's time, after its device work), the step queued ahead began on the device while the host finished
    the last one and takes the step's time less its host part: the iteration starts the step less twice that late."""
    requests = [("r0", "m0", 0.0, 300, 400), ("r1", "m0", 1.0, 300, 10)]
    plain, plain_log = _run(LinearCosts(), requests)
    ahead, _ = _run(_AheadCosts(), requests)
    assert '"Stop"' in plain_log and '"prefill_chunks"' in plain_log
    assert _discarded(_AheadCosts(), requests) == {"i0": 1} and _discarded(LinearCosts(), requests) == {"i0": 0}
    late = ahead["r1"].first_token_at - plain["r1"].first_token_at
    assert late == pytest.approx(STEP, rel=0.01)
    hosted, _ = _run(_AheadHostCosts(), requests)
    plain_host, _ = _run(type("HostCosts", (LinearCosts,), {"call_host_s": _AheadHostCosts.call_host_s})(),
                         requests)
    assert hosted["r1"].first_token_at - plain_host["r1"].first_token_at == pytest.approx(STEP - 2 * 0.004, abs=1e-4)


def test_a_hand_off_waits_for_the_prefill_instances_step_queued_ahead() -> None:
    """The prefill instance decodes a hand-off's first tokens, then moves its KV out (a SwapOut): the move waits
    for the step queued ahead; the request's first token does not move, its end does, by about one step."""
    requests = [(f"r{k}", f"m{k % 2}", 2.0 * k, 300, 60) for k in range(4)]  # one at a time
    plain, log = _run(LinearCosts(), requests, ["prefill", "decode"])
    ahead, _ = _run(_AheadCosts(), requests, ["prefill", "decode"])
    assert '"SwapOut"' in log and '"SwapIn"' in log
    for rid, before in plain.items():
        after = ahead[rid]
        assert after.first_token_at == pytest.approx(before.first_token_at)
        assert STEP * 0.99 <= after.finished_at - before.finished_at <= 2 * STEP * 1.01


def test_any_call_in_a_plan_discards_it_a_prefetch_too() -> None:
    """The live runner makes a plan's actions engine calls in order, and every call but a decode_step of the same
    requests discards the step queued ahead - a Prefetch's too (the engine's prefetch call)."""
    from scheduler.plan import Prefetch

    sim, _ = make_sim("token-level", make_models(2), make_instances(1), [], costs=_AheadCosts())
    dev = sim.device("i0")
    dev.ahead_ids, dev.ahead_end = ("r0",), 5.0
    sim._execute("i0", (Prefetch("m1", "next"),), 1.0)
    assert dev.free_at == 5.0 and dev.ahead_discarded == 1 and dev.ahead_ids is None
    sim._execute("i0", (Prefetch("m0", "next"),), 6.0)  # nothing queued ahead any more: no wait
    assert dev.free_at == 6.0 and dev.ahead_discarded == 1


def _mid_turn(sim, iid: str, start: float, steps: int) -> None:
    """Give `iid` a decode turn in flight: `steps` steps of STEP from `start`, over one group of one request."""
    from types import SimpleNamespace

    from sims.simulator import _Turn

    batch = SimpleNamespace(groups=[SimpleNamespace(model="m0", size=1)])
    sim.device(iid).turn = _Turn(start, STEP, steps, ("r0",), -1, [], batch)


def test_another_instances_call_mid_turn_discards_a_step_and_the_turn_ends_one_step_later() -> None:
    """A hand-off's export_kv (and release) on the instance that holds the KV runs between that instance's own
    calls (pool/runner.py): mid-turn it discards the step queued ahead, so its next work starts a step later per
    call; a call after the turn, with nothing queued, costs nothing."""
    sim, _ = make_sim("token-level", make_models(2), make_instances(2, roles=["prefill", "decode"]), [],
                      costs=_AheadCosts())
    _mid_turn(sim, "i0", 1.0, 10)  # ends at 1.1
    dev = sim.device("i0")
    sim._call_between("i0", 1.05)
    assert dev.ready_at == pytest.approx(1.1 + STEP) and dev.ahead_discarded == 1
    sim._call_between("i0", 1.06)
    assert dev.ready_at == pytest.approx(1.1 + 2 * STEP) and dev.ahead_discarded == 2
    sim._call_between("i0", 1.1)  # at the turn's end: nothing in flight, nothing queued
    assert dev.ahead_discarded == 2
    sim.device("i0").turn = None
    sim._execute("i0", (Prefetch("m1", "next"),), 1.1)
    assert dev.free_at == pytest.approx(1.1 + 2 * STEP)


def test_another_instances_call_after_a_turn_loses_its_queued_step_even_to_a_turn_that_continues_it() -> None:
    sim, _ = make_sim("token-level", make_models(2), make_instances(2, roles=["prefill", "decode"]), [],
                      costs=_AheadCosts())
    dev = sim.device("i0")
    dev.ahead_ids, dev.ahead_end = ("r0",), 2.0
    sim._call_between("i0", 1.5)
    assert dev.ahead_ids is None and dev.ready_at == 2.0 and dev.ahead_discarded == 1
    sim._execute("i0", (Prefetch("m1", "next"),), 1.6)  # counted once: it waits, and counts nothing more
    assert dev.free_at == 2.0 and dev.ahead_discarded == 1


@pytest.mark.parametrize("staged", [False, True])
def test_a_hand_off_calls_the_instance_that_holds_its_kv_once_from_host_memory_twice_when_staged(staged) -> None:
    """Each SwapIn of KV another instance's SwapOut left calls that instance: export_kv as the move starts, and,
    where the KV was staged in its device memory, a release when the move ends; a SwapIn of an instance's own KV
    calls nobody."""
    import random

    from scheduler.plan import SwapIn, SwapOut

    rng = random.Random(1)
    requests = [Request(f"r{k}", f"m{k % 2}", k * 0.15 + rng.random() * 0.1, 300, rng.randint(20, 200))
                for k in range(40)]
    log = io.StringIO()
    sim, _ = make_sim("token-level", make_models(2), make_instances(2, roles=["prefill", "decode"]), requests,
                      costs=_AheadCosts(), plan_log=log)
    if staged:
        sim.staging = frozenset({"i0"})
    calls: list[tuple[str, float]] = []
    between = sim._call_between
    sim._call_between = lambda iid, at: (calls.append((iid, at)), between(iid, at))  # type: ignore[method-assign]
    moved_out: dict[str, str] = {}
    expected: list[str] = []
    execute = sim._execute

    def watch(iid, actions, now):
        for action in actions:
            if isinstance(action, SwapOut):
                moved_out.update((rid, iid) for rid in action.request_ids)
            elif isinstance(action, SwapIn):
                homes = {moved_out.pop(rid) for rid in action.request_ids if rid in moved_out} - {iid}
                expected.extend(sorted(homes) * (2 if staged else 1))
        execute(iid, actions, now)

    sim._execute = watch  # type: ignore[method-assign]
    sim.run()
    assert len(expected) >= 20 and sorted(iid for iid, _ in calls) == sorted(expected)
    assert all(r.finished_at is not None for r in sim.records.values())
