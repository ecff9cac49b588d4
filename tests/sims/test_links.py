"""Shared host links (sims.links): overlapping copies split a link; the simulator charges it through the cost model."""

from __future__ import annotations

import pytest

from scheduler import InstanceSpec, Request
from scheduler.fleet import ARCHS, Arch
from sims.costmodel import RooflineCostModel
from sims.links import HostLinks, gpus_of, link_spans
from sims.profiles import load_profile
from tests.factories import LinearCosts, make_instances, make_models, make_sim

ONE_LINK = {"a": ((0, 1),), "b": ((0, 1),)}


def test_a_copy_alone_takes_its_time_alone() -> None:
    links = HostLinks(ONE_LINK)
    assert links.copy_end_at("a", True, 2.0, 0.25, 1.0) == 2.25
    assert links.copy_end_at("a", True, 3.0, 0.25, 3.0) == 3.25  # the first one is over by then


def test_fair_two_equal_copies_started_together_end_at_d_and_twice_d() -> None:
    links = HostLinks(ONE_LINK, sharing="fair")
    assert links.copy_end_at("a", True, 0.0, 0.1, 0.0) == pytest.approx(0.1)
    assert links.copy_end_at("b", True, 0.0, 0.1, 0.0) == pytest.approx(0.2)


def test_fair_a_lossy_link_stretches_shared_copies_by_its_rate() -> None:
    links = HostLinks(ONE_LINK, shared_rate=0.8, sharing="fair")
    links.copy_end_at("a", True, 0.0, 0.1, 0.0)
    assert links.copy_end_at("b", True, 0.0, 0.1, 0.0) == pytest.approx(0.2 / 0.8)


def test_fair_a_small_copy_during_a_large_one_takes_twice_its_time() -> None:
    links = HostLinks(ONE_LINK, sharing="fair")
    links.copy_end_at("a", True, 0.0, 1.0, 0.0)  # a weight switch
    assert links.copy_end_at("b", True, 0.5, 0.01, 0.5) == pytest.approx(0.52)  # a KV move: processor sharing


def test_fair_a_later_copy_pays_for_what_earlier_ones_still_have_to_move() -> None:
    links = HostLinks(ONE_LINK, sharing="fair")
    links.copy_end_at("a", True, 0.0, 0.3, 0.0)
    links.copy_end_at("b", True, 0.0, 0.3, 0.0)  # both in flight: each has 0.2 s of work left at 0.2
    assert links.copy_end_at("a", True, 0.2, 0.1, 0.2) == pytest.approx(0.2 + 0.3)  # a third of the link until done


def test_fair_a_copy_booked_to_start_later_slows_one_that_starts_before_it() -> None:
    links = HostLinks(ONE_LINK, sharing="fair")
    links.copy_end_at("a", True, 1.0, 1.0, 0.0)  # a move after a prefill, booked ahead of time
    assert links.copy_end_at("b", True, 0.5, 1.0, 0.0) == pytest.approx(2.0)  # alone for 0.5 s, then at half rate


def test_fifo_a_copy_waits_for_the_one_on_the_link() -> None:
    links = HostLinks(ONE_LINK)  # fifo, as the H200 served two engines' switches
    assert links.copy_end_at("a", True, 0.0, 0.277, 0.0) == pytest.approx(0.277)  # a 7B switch
    assert links.copy_end_at("b", True, 0.0, 0.112, 0.0) == pytest.approx(0.389)  # a 3B one behind it
    assert links.copy_end_at("b", True, 0.5, 0.112, 0.5) == pytest.approx(0.612)  # the link is free again


def test_fifo_a_copy_fills_the_link_around_one_booked_to_start_later() -> None:
    links = HostLinks(ONE_LINK, shared_rate=0.5)
    links.copy_end_at("a", True, 1.0, 1.0, 0.0)  # a KV move after a prefill, booked ahead of time: [1, 2]
    assert links.copy_end_at("b", True, 0.5, 0.5, 0.0) == pytest.approx(1.0)  # fits in the gap before it
    # 1 s alone overlaps [1, 2]: at the shared rate it is 2 s of link time, 0.5 before the booked copy, 1.5 after
    assert links.copy_end_at("b", True, 0.0, 1.0, 0.0) == pytest.approx(3.5)
    with pytest.raises(ValueError, match="sharing"):
        HostLinks(ONE_LINK, sharing="random")


def test_directions_and_links_do_not_contend() -> None:
    links = HostLinks({"a": ((0, 1),), "b": ((0, 1),), "c": ((1, 1),)})
    links.copy_end_at("a", True, 0.0, 0.1, 0.0)
    assert links.copy_end_at("b", False, 0.0, 0.1, 0.0) == pytest.approx(0.1)  # device to host: full duplex
    assert links.copy_end_at("c", True, 0.0, 0.1, 0.0) == pytest.approx(0.1)  # another link
    assert links.copy_end_at("unknown", True, 0.0, 0.1, 0.0) == pytest.approx(0.1)


def test_placement_consecutive_gpus_or_given_and_shards_per_link() -> None:
    specs = [InstanceSpec("p", 1, 1.0, "prefill"), InstanceSpec("d", 1, 1.0, "decode"), InstanceSpec("t", 2, 1.0)]
    assert gpus_of(specs) == {"p": range(0, 1), "d": range(1, 2), "t": range(2, 4)}
    assert gpus_of(specs, {"p": 0, "d": 0}) == {"p": range(0, 1), "d": range(0, 1), "t": range(1, 3)}
    assert link_spans(specs, 1) == {"p": ((0, 1),), "d": ((1, 1),), "t": ((2, 1), (3, 1))}
    assert link_spans(specs, 2) == {"p": ((0, 1),), "d": ((0, 1),), "t": ((1, 2),)}  # both shards on one link
    with pytest.raises(ValueError, match="gpus_per_link"):
        link_spans(specs, 0)


class _SharedLinearCosts(LinearCosts):
    """LinearCosts whose instances copy over shared links (one GPU each unless placed)."""

    def host_links(self, instances, gpu_of=None):  # type: ignore[no-untyped-def]
        return HostLinks(link_spans(instances, 1, gpu_of))


def _switch_seconds(costs: LinearCosts, gpu_of: dict[str, int] | None) -> float:
    models = make_models(2)
    instances = make_instances(2)
    requests = [Request("r0", "m0", 0.0, 100, 5), Request("r1", "m1", 0.0, 100, 5)]
    sim, _ = make_sim("request-level", models, instances, requests, costs=costs)
    sim.links = costs.host_links(instances, gpu_of)
    sim.run()
    assert all(r.finished_at is not None for r in sim.records.values())
    return sum(dev.switch_s for dev in sim.devices.values())


def test_two_instances_on_one_gpu_share_its_link_when_they_switch_together() -> None:
    assert _switch_seconds(LinearCosts(switch_s=0.5), None) == pytest.approx(1.0)  # no links: 0.5 s each
    assert _switch_seconds(_SharedLinearCosts(switch_s=0.5), None) == pytest.approx(1.0)  # a GPU (link) each
    assert _switch_seconds(_SharedLinearCosts(switch_s=0.5), {"i0": 0, "i1": 0}) == pytest.approx(1.5)  # 0.5 + 1.0


def test_roofline_shares_links_only_when_the_pool_says_so() -> None:
    models = {"m": (Arch.model_validate(ARCHS["qwen2.5-7b"]), 1)}
    specs = [InstanceSpec("a", 1, 1.0), InstanceSpec("b", 1, 1.0)]
    assert RooflineCostModel.for_models(models, "h200").host_links(specs) is None
    costs = RooflineCostModel.for_models(models, "h200", load_profile("default"), gpus_per_host_link=2)
    links = costs.host_links(specs)
    # no fitted sharing: the link moves its bytes at the one rate eff_pcie measured, copies in the order they start
    assert isinstance(links, HostLinks) and links.shared_rate == 1.0 and links.sharing == "fifo"
    first = links.copy_end_at("a", True, 0.0, costs.switch_s("m"), 0.0)
    assert links.copy_end_at("b", True, 0.0, costs.switch_s("m"), 0.0) == pytest.approx(2 * first)  # one link


def test_a_host_link_cannot_span_hosts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from modelpool.config import FleetFileError, load_fleet

    path = tmp_path / "models.yaml"
    path.write_text("pool:\n  gpu: h200\n  gpus_per_node: 4\n  gpus_per_host_link: 8\n"
                    "models:\n  - {name: a, arch: qwen2.5-7b}\n")
    with pytest.raises(FleetFileError) as info:
        load_fleet(path)
    assert "gpus_per_host_link" in str(info.value) and ":4:" in str(info.value)  # the file's line of the setting
    path.write_text("pool:\n  gpu: h200\n  gpus_per_host_link: 2\nmodels:\n  - {name: a, arch: qwen2.5-7b}\n")
    assert RooflineCostModel(load_fleet(path)).gpus_per_host_link == 2
    assert RooflineCostModel(load_fleet(path), gpus_per_host_link=1).gpus_per_host_link == 1  # the caller's wins


# ---- hand-offs staged in device memory: off the host link ----------------------------------------------
class _StagingCosts(LinearCosts):
    def kv_device_copy_s(self, model: str, num_tokens: int) -> float:
        return self.kv_move_s(model, num_tokens) / 20


def _handoff_finish(staging: set[str]) -> tuple[float, float]:
    """(first, last) token times of one request handed from a prefill to a decode instance."""
    from tests.factories import make_request, run_sim

    costs = _StagingCosts(kv_per_token_s=1e-4)
    sim, _ = make_sim("token-level", make_models(1), make_instances(2, roles=["prefill", "decode"]),
                      [make_request(prompt_tokens=1000, max_output_tokens=40)], costs)
    sim.staging = frozenset(staging)
    record = sim.run()["r1"]
    return record.first_token_at, record.finished_at


def test_a_staged_hand_off_copies_within_the_gpu_at_its_own_cost() -> None:
    from scheduler.instance import staging_instances

    assert staging_instances({"p": "prefill", "d": "decode"}, {"p": [0], "d": [0]}) == {"p"}
    assert staging_instances({"p": "prefill", "d": "decode"}, {"p": [0], "d": [1]}) == set()
    assert staging_instances({"p": "prefill", "d": "decode", "e": "decode"}, {"p": [0], "d": [0], "e": [1]}) == set()
    assert staging_instances({"p": "prefill", "m": "mixed"}, {"p": [0], "m": [0]}) == set()  # nobody to hand to
    costs = _StagingCosts(kv_per_token_s=1e-4)
    first, host = _handoff_finish(set())
    first_staged, staged = _handoff_finish({"i0"})
    assert first_staged == first  # the hand-off comes after the first tokens
    # the SwapOut and the SwapIn each pay a device copy instead of a host move (1000 prompt tokens + 8 produced)
    saved = 2 * (costs.kv_move_s("m0", 1008) - costs.kv_device_copy_s("m0", 1008))
    assert host - staged == pytest.approx(saved, rel=0.05)
