"""Placement groups of tensor-parallel instances on a local Ray (CPU bundles): one per instance, replaced
when it restarts, removed when it stops, and a group the cluster cannot place is an error in bounded time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pool.actor import EngineSpec, start_actors
from pool.engines.base import SamplingParams
from pool.placement import Placements, PlacementTimeout
from pool.config import PoolConfig
from pool.service import LivePool, ServedModel
from scheduler import InstanceSpec, ModelProfile
from tests.factories import LinearCosts
from tests.pool.fault_tools import Sink, wait_until

NUM_CPUS = 3  # a TP2 instance leaves one CPU free: its restart fits only once its old group is gone
GB = 1e9


@pytest.fixture(scope="module")
def ray_cpus():
    import ray

    ray.init(num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def groups(state: str = "CREATED") -> dict[str, dict]:
    from ray.util.placement_group import placement_group_table

    return {gid: g for gid, g in placement_group_table().items() if g["state"] == state}


def free_cpus(ray) -> float:
    # what Ray reports lags a removal by a moment
    return float(ray.available_resources().get("CPU", 0))


COSTS = LinearCosts(step_s=0.004, prefill_per_token_s=1e-4, switch_s=0.02)
MODELS = [ServedModel(name, Path(f"<sim>/{name}"), ModelProfile(name, 2, 1 * GB, 1000, 8192, 1.0, 0.1))
          for name in ("alpha", "beta")]
SIM = EngineSpec("sim", {"costs": COSTS, "kv_bytes": 64 << 20, "kv_bytes_per_token": {m.name: 1000 for m in MODELS}})


def tp2_pool(**options) -> LivePool:
    return LivePool(MODELS, [InstanceSpec("tp0", 2, 2 * GB + 64e6)], "token-level", COSTS,
                    PoolConfig(engine=SIM, backend="ray", stats_interval_s=0.1, **options))


def submit(pool: LivePool, tag: str, num_tokens: int = 200) -> dict[str, Sink]:
    sinks = {}
    for model in MODELS:
        for k in range(2):
            sinks[f"{tag}{model.name}-{k}"] = sink = Sink()
            pool.submit(f"{tag}{model.name}-{k}", model.name, [5, 6, 7, 8 + k],
                        SamplingParams(max_tokens=num_tokens, ignore_eos=True), sink)
    return sinks


def test_a_tp_instance_holds_one_group_its_restart_replaces_it_and_stop_removes_it(ray_cpus) -> None:
    ray = ray_cpus
    assert not groups()
    with tp2_pool(max_restarts=1) as pool:
        first = groups()
        assert len(first) == 1
        (group,) = first.values()
        assert list(group["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}] and group["strategy"] == "STRICT_PACK"
        wait_until(lambda: free_cpus(ray) == NUM_CPUS - 2, 10, "the group's two CPUs taken")
        sinks = submit(pool, "a-")
        wait_until(lambda: any(len(s.tokens) >= 5 for s in sinks.values()), 30, "tokens from the TP2 instance")
        pool.kill_instance("tp0")  # mid-decode; one CPU is free, the restart needs two
        wait_until(lambda: pool.status()["restarts"] == 1 and not pool.status()["lost_instances"], 60,
                   "tp0 restarted")
        for rid, sink in sinks.items():
            assert sink.done.wait(60), f"{rid} did not finish"
            assert sink.error is None and len(sink.tokens) == 200 and not sink.after_end, rid
        second = groups()
        assert len(second) == 1 and set(second) != set(first), (first, second)
        assert set(first) <= set(groups("REMOVED"))
    assert not groups(), "pool.stop() left a placement group"
    wait_until(lambda: free_cpus(ray) == NUM_CPUS, 10, f"every CPU back: {ray.available_resources()}")


def test_a_tp_instance_lost_for_good_gives_its_group_back(ray_cpus) -> None:
    with tp2_pool(max_restarts=0) as pool:
        assert len(groups()) == 1
        sinks = submit(pool, "b-", num_tokens=400)
        wait_until(lambda: any(s.tokens for s in sinks.values()), 30, "tokens from the TP2 instance")
        pool.kill_instance("tp0")
        for rid, sink in sinks.items():  # no instance left: each ends with a clean error, none hangs
            assert sink.done.wait(30) and sink.error is not None, rid
        wait_until(lambda: not groups(), 30, "the written-off instance's group removed")
        assert pool.status()["lost_instances"] == ["tp0"]


def test_a_group_that_cannot_be_placed_times_out_with_what_it_asked_for(ray_cpus) -> None:
    ray = ray_cpus
    placements = Placements()
    started = time.monotonic()
    with pytest.raises(PlacementTimeout) as caught:
        start_actors({"big0": NUM_CPUS + 1}, SIM, {m.name: str(m.path) for m in MODELS}, use_gpus=False,
                     placements=placements, placement_timeout_s=1.0)
    assert time.monotonic() - started < 15
    text = str(caught.value)
    for part in ("instance big0", f"{NUM_CPUS + 1} bundles", "{'CPU': 1.0}", "STRICT_PACK", "within 1 s",
                 "INFEASIBLE", f"CPU {NUM_CPUS:g} free of {NUM_CPUS:g}"):
        assert part in text, (part, text)
    assert "big0" not in placements and not groups() and not groups("PENDING")
    live = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
    assert not live, live


def test_a_closed_set_refuses_new_groups_and_removed_them_all(ray_cpus) -> None:
    placements = Placements()
    placements.reserve("a", 2, use_gpus=False, timeout_s=10)
    assert len(groups()) == 1
    placements.close()
    assert not groups()
    with pytest.raises(RuntimeError, match="instance b: the pool's placement groups are closed"):
        placements.reserve("b", 2, use_gpus=False, timeout_s=10)
    assert not groups() and not groups("PENDING")


def test_tp_instances_without_a_placement_set_are_refused() -> None:
    with pytest.raises(ValueError, match="need `placements`"):
        start_actors({"tp0": 2}, SIM, {}, use_gpus=False)
