"""GPU time-sharing (sims.gpu_share): instances on one GPU slow each other's device work; the simulator charges
it through the cost model, and fleets with a GPU per instance run exactly as before."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from scheduler import InstanceSpec, Request
from sims.costmodel import GpuShares
from scheduler.fleet import ARCHS, Arch
from sims.costmodel import SHARED_GPU_SLOWDOWN, RooflineCostModel
from sims.gpu_share import DecodeShareTable, GpuTimeSharing, ShareTable, gpu_peers, share
from tests.factories import LinearCosts, make_instances, make_models, make_sim

S = 1.774  # the H200 probe's median
PAIR = {"p": ("d",), "d": ("p",)}
PREFILL, DECODE = ("prefill", 0.0, 0), ("decode", 0.0, 0)  # work of a model of unknown size


def test_share_is_processor_sharing_of_what_two_together_deliver() -> None:
    assert share(1, S) == 1.0
    assert share(2, S) == pytest.approx(1 / S)  # beside one busy peer: the measured slowdown
    assert share(3, S) == pytest.approx(2 / (3 * S))
    assert share(2, 2.0) == 0.5  # slowdown 2: the GPU split without gain or loss


def test_work_alone_takes_its_time_alone() -> None:
    gpus = GpuTimeSharing(PAIR, S)
    assert gpus.work_end_at("p", 1.0, 0.25, 1.0) == 1.25
    assert gpus.work_end_at("d", 2.0, 0.5, 2.0) == 2.5  # p's work is over by then
    assert gpus.work_end_at("own", 0.0, 0.5, 0.0) == 0.5  # an instance with a GPU of its own
    with pytest.raises(ValueError, match="slowdown"):
        GpuTimeSharing(PAIR, 0.5)


def test_a_prefill_beside_a_decode_turn_takes_the_measured_slowdown_and_the_turn_owes_its_share() -> None:
    gpus = GpuTimeSharing(PAIR, S)
    assert gpus.work_end_at("d", 0.0, 10.0, 0.0) == 10.0  # a long decode turn, booked first: its end stays
    assert gpus.work_end_at("p", 1.0, 0.1, 1.0) == pytest.approx(1.0 + 0.1 * S)
    # processor sharing would have run the turn (S - 1) * 0.1 s longer: its next turn, straight after, does that first
    assert gpus.work_end_at("d", 10.0, 1.0, 10.0) == pytest.approx(11.0 + 0.1 * (S - 1))


def test_measured_cross_kind_slowdowns_apply_by_kind_and_same_kinds_split_the_budget() -> None:
    """Under MPS a prefill barely slows beside a decoding peer while the decode steps slow a lot (calibrate's
    share benchmark measures both): each kind takes its own figure beside the other, the same kinds the budget's 2."""
    gpus = GpuTimeSharing(PAIR, 2.0, decode_slowdown=3.0, prefill_slowdown=1.1)
    assert gpus.rate(PREFILL, [DECODE]) == pytest.approx(1 / 1.1)
    assert gpus.rate(DECODE, [PREFILL]) == pytest.approx(1 / 3.0)
    assert gpus.rate(DECODE, [DECODE]) == gpus.rate(PREFILL, [PREFILL]) == 0.5
    # beside several peers the largest slowdown applies
    assert gpus.rate(PREFILL, [DECODE, PREFILL]) == pytest.approx(2 / (3 * 2.0))
    assert gpus.work_end_at("d", 0.0, 10.0, 0.0, kind="decode") == 10.0
    assert gpus.work_end_at("p", 1.0, 0.1, 1.0) == pytest.approx(1.0 + 0.1 * 1.1)
    with pytest.raises(ValueError, match="prefill_slowdown"):
        GpuTimeSharing(PAIR, 2.0, prefill_slowdown=0.9)


def test_a_profile_with_measured_share_terms_gives_the_simulator_those_slowdowns() -> None:
    from sims.profiles import load_profile

    base = load_profile("default")
    measured = base.model_copy(update={"terms": base.terms.model_copy(
        update={"share_prefill_slowdown": 1.07, "share_decode_slowdown": 3.07})})
    instances = [InstanceSpec("p", 1, 80e9), InstanceSpec("d", 1, 80e9)]
    arch = Arch.model_validate(ARCHS["qwen2.5-7b"])
    unmeasured = RooflineCostModel.for_models({"m": (arch, 1)}, "h200", base).gpu_shares(instances, {"p": 0, "d": 0})
    shares = RooflineCostModel.for_models({"m": (arch, 1)}, "h200", measured).gpu_shares(instances, {"p": 0, "d": 0})
    assert isinstance(unmeasured, GpuTimeSharing) and unmeasured.rate(PREFILL, [DECODE]) == 0.5
    assert isinstance(shares, GpuTimeSharing)
    assert shares.rate(PREFILL, [DECODE]) == pytest.approx(1 / 1.07)
    assert shares.rate(DECODE, [PREFILL]) == pytest.approx(1 / 3.07)


def test_owed_work_runs_on_in_an_idle_gap() -> None:
    gpus = GpuTimeSharing(PAIR, 2.0)
    gpus.work_end_at("d", 0.0, 1.0, 0.0)
    gpus.work_end_at("p", 0.0, 0.5, 0.0)  # half rate over [0, 1]: all of it; d owes 0.5
    assert gpus.work_end_at("d", 1.2, 1.0, 1.2) == pytest.approx(2.5)  # 0.3 of it left after 0.2 s idle
    gpus.work_end_at("p", 3.0, 0.5, 3.0)  # alone: no one owes
    assert gpus.work_end_at("d", 5.0, 1.0, 5.0) == pytest.approx(6.0)


def test_work_overlapping_part_of_a_peer_runs_at_full_rate_outside_it() -> None:
    gpus = GpuTimeSharing(PAIR, 2.0)
    gpus.work_end_at("d", 1.0, 1.0, 0.0)  # booked ahead: [1, 2]
    # 0.5 alone in [0.5, 1], then half rate in [1, 2] (0.5 more), then the last 0.5 alone
    assert gpus.work_end_at("p", 0.5, 1.5, 0.0) == pytest.approx(2.5)


def test_three_instances_each_get_a_third_of_what_the_gpu_delivers() -> None:
    gpus = GpuTimeSharing({"a": ("b", "c"), "b": ("a", "c"), "c": ("a", "b")}, S)
    gpus.work_end_at("a", 0.0, 10.0, 0.0)
    gpus.work_end_at("b", 0.0, 10.0, 0.0)
    assert gpus.work_end_at("c", 0.0, 0.1, 0.0) == pytest.approx(0.1 * 3 * S / 2)


def test_a_cut_gives_back_the_owed_work_it_did_not_run() -> None:
    gpus = GpuTimeSharing(PAIR, 2.0)
    gpus.work_end_at("d", 0.0, 1.0, 0.0)
    gpus.work_end_at("p", 0.0, 0.4, 0.0)  # d owes 0.4
    assert gpus.work_end_at("d", 1.0, 1.6, 1.0) == pytest.approx(3.0)  # pays it: 2 s for 1.6 s of work
    gpus.cut("d", 2.0)  # a Stop half way: half of what it paid is owed again
    assert gpus.work_end_at("d", 2.0, 1.0, 2.0) == pytest.approx(3.2)


def test_peers_are_the_instances_placed_on_a_common_gpu() -> None:
    specs = [InstanceSpec("p", 1, 1.0, "prefill"), InstanceSpec("d", 1, 1.0, "decode"), InstanceSpec("t", 2, 1.0),
             InstanceSpec("u", 1, 1.0)]
    assert gpu_peers(specs) == {}  # consecutive GPUs: each its own
    assert gpu_peers(specs, {"p": 0, "d": 0}) == {"p": ("d",), "d": ("p",)}
    tp = [specs[0], specs[2], specs[3]]
    assert gpu_peers(tp, {"t": 0, "u": 1}) == {"p": ("t",), "t": ("p", "u"), "u": ("t",)}  # t spans GPUs 0 and 1


def test_roofline_shares_gpus_only_where_instances_are_placed_together() -> None:
    """No fitted contention: instances on one GPU split its time (SHARED_GPU_SLOWDOWN, each of k busy at 1/k)."""
    models = {"m": (Arch.model_validate(ARCHS["qwen2.5-7b"]), 1)}
    specs = [InstanceSpec("p", 1, 1.0, "prefill"), InstanceSpec("d", 1, 1.0, "decode")]
    costs = RooflineCostModel.for_models(models, "h200")
    assert costs.gpu_shares(specs) is None  # a GPU each
    gpus = costs.gpu_shares(specs, {"p": 0, "d": 0})
    assert isinstance(gpus, GpuTimeSharing) and gpus.slowdown == SHARED_GPU_SLOWDOWN
    assert share(2, SHARED_GPU_SLOWDOWN) == 0.5 and share(3, SHARED_GPU_SLOWDOWN) == pytest.approx(1 / 3)
    gpus.work_end_at("p", 0.0, 1.0, 0.0, "prefill")  # two busy together: each at half its rate
    assert gpus.work_end_at("d", 0.0, 0.2, 0.0, "decode") == pytest.approx(0.4)


class _SharedGpuCosts(LinearCosts):
    """LinearCosts whose instances time-slice a GPU where placed on one."""

    def gpu_shares(self, instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> GpuShares | None:
        peers = gpu_peers(instances, gpu_of)
        return GpuTimeSharing(peers, S) if peers else None


def _prefill_decode(gpu_of: dict[str, int] | None) -> tuple[float, float, str]:
    """A prefill and a decode instance serving a burst: mean TTFT, mean finish time and the Plan log."""
    models = make_models(1)
    instances = make_instances(2, roles=["prefill", "decode"])
    requests = [Request(f"r{k}", "m0", 0.4 * k, 2000, 60) for k in range(12)]
    costs = _SharedGpuCosts(step_s=0.01, prefill_per_token_s=2e-5, switch_s=0.01)
    log = io.StringIO()
    sim, _ = make_sim("token-level", models, instances, requests, costs=costs, plan_log=log)
    sim.gpus = costs.gpu_shares(instances, gpu_of)
    sim.run()
    records = sim.records.values()
    assert all(r.generated == r.output_tokens for r in records)
    first = [r.first_token_at - r.arrival_at for r in records if r.first_token_at is not None]
    ends = [r.finished_at for r in records if r.finished_at is not None]
    assert len(first) == len(ends) == len(records)
    return sum(first) / len(first), sum(ends) / len(ends), log.getvalue()


def test_two_instances_on_one_gpu_take_longer_than_on_two() -> None:
    apart_ttft, apart_end, apart_log = _prefill_decode(None)
    together_ttft, together_end, _ = _prefill_decode({"i0": 0, "i1": 0})
    assert 1.2 * apart_ttft < together_ttft <= S * apart_ttft  # the prefills beside decode turns take up to S times
    assert together_end > apart_end
    models, instances = make_models(1), make_instances(2, roles=["prefill", "decode"])
    log = io.StringIO()  # a GPU each: the same Plans as a simulator that knows nothing of sharing
    sim, _ = make_sim("token-level", models, instances, [Request(f"r{k}", "m0", 0.4 * k, 2000, 60) for k in range(12)],
                      costs=_SharedGpuCosts(step_s=0.01, prefill_per_token_s=2e-5, switch_s=0.01), plan_log=log)
    sim.run()
    assert log.getvalue() == apart_log


def _long_step_beside_short_ones(gpus: GpuTimeSharing, long_at: float, long_s: float, short_s: float,
                                 until: float) -> tuple[float, float]:
    """d books back-to-back steps of `short_s` from 0 to `until`; p books one `long_s` step at `long_at`, once d's
    step then is booked: p's end, and the end of d's last step."""
    d_end, p_end = 0.0, math.nan
    while d_end < until:
        if math.isnan(p_end) and d_end > long_at:
            p_end = gpus.work_end_at("p", long_at, long_s, long_at)
        d_end = gpus.work_end_at("d", d_end, short_s, d_end)
    return p_end, d_end


def test_a_long_step_beside_back_to_back_short_ones_is_charged_over_its_whole_span() -> None:
    # d busy throughout: p's 1 s of work runs at share(2) = 1 / S all along, S seconds
    p_end, _ = _long_step_beside_short_ones(GpuTimeSharing(PAIR, S), 0.01, 1.0, 0.05, 3.0)
    assert p_end == pytest.approx(0.01 + S)
    # symmetric: the other way round, the short step (booked after the long one) takes S times as long too
    gpus = GpuTimeSharing(PAIR, S)
    assert gpus.work_end_at("p", 0.0, 1.0, 0.0) == 1.0  # alone when booked
    assert gpus.work_end_at("d", 0.0, 0.05, 0.0) == pytest.approx(0.05 * S)


def test_a_long_step_gets_back_what_a_peer_that_stopped_did_not_take() -> None:
    gpus = GpuTimeSharing(PAIR, 2.0)
    gpus.work_end_at("d", 0.0, 0.5, 0.0)
    assert gpus.work_end_at("p", 0.0, 1.0, 0.0) == pytest.approx(2.0)  # d counted on to stay busy: half rate
    # d booked nothing after 0.5: p ran alone over [0.5, 2], 0.75 s of work more than booked (done by 1.25);
    # its next step, straight after, takes that off; after an idle gap the credit is gone
    assert gpus.work_end_at("p", 2.0, 1.0, 2.0) == pytest.approx(2.25)
    assert gpus.work_end_at("p", 3.0, 1.0, 3.0) == pytest.approx(4.0)


def test_a_decode_step_beside_a_prefill_slows_by_the_decode_term_and_the_prefill_by_the_other() -> None:
    """Uneven sharing (MPS on the H200: a prefill 1.11x beside a decoder, a decode step 3.07x beside a prefill):
    decode work beside a peer's prefill runs at 1 / decode_slowdown, every other pairing at 1 / slowdown."""
    gpus = GpuTimeSharing(PAIR, 1.1, 3.0)
    assert gpus.decode_slowdown == 3.0 and GpuTimeSharing(PAIR, 1.1).decode_slowdown == 1.1  # None: the same term
    assert gpus.work_end_at("p", 0.0, 1.0, 0.0, "prefill") == 1.0  # alone when booked
    assert gpus.work_end_at("d", 0.0, 0.1, 0.0, "decode") == pytest.approx(0.3)  # beside it: 3x
    # the prefill ran at 1 / 1.1 over d's 0.3 s: it owes 0.3 * (1 - 1 / 1.1), done first by its next step
    assert gpus.work_end_at("p", 1.0, 1.0, 1.0, "prefill") == pytest.approx(2.0 + 0.3 * (1 - 1 / 1.1))
    twins = GpuTimeSharing(PAIR, 1.1, 3.0)  # two decoders: the decode term does not apply
    twins.work_end_at("p", 0.0, 1.0, 0.0, "decode")
    assert twins.work_end_at("d", 0.0, 0.1, 0.0, "decode") == pytest.approx(0.11)
    later = GpuTimeSharing(PAIR, 1.1, 3.0)  # a prefill booked beside a decode turn: 1.1x, and the turn owes 3x
    later.work_end_at("d", 0.0, 10.0, 0.0, "decode")
    assert later.work_end_at("p", 1.0, 0.1, 1.0, "prefill") == pytest.approx(1.11)
    assert later.work_end_at("d", 10.0, 1.0, 10.0, "decode") == pytest.approx(11.0 + 0.11 * (1 - 1 / 3.0))
    with pytest.raises(ValueError, match="decode_slowdown"):
        GpuTimeSharing(PAIR, 1.1, 0.5)


class _UnevenGpuCosts(LinearCosts):
    def __init__(self, decode_slowdown: float | None, **kw: float) -> None:
        super().__init__(**kw)
        self.decode_slowdown = decode_slowdown

    def gpu_shares(self, instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> GpuShares | None:
        peers = gpu_peers(instances, gpu_of)
        return GpuTimeSharing(peers, 1.1, self.decode_slowdown) if peers else None


def test_the_simulator_books_decode_turns_as_decode_work() -> None:
    """A prefill and a decode instance on one GPU: with a decode term of 3, requests finish later than with none
    (decode turns beside prefills pay it) while first tokens come no later (prefills pay only 1.1x either way)."""
    def run(decode_slowdown: float | None) -> tuple[float, float]:
        instances = make_instances(2, roles=["prefill", "decode"])
        costs = _UnevenGpuCosts(decode_slowdown, step_s=0.01, prefill_per_token_s=2e-5, switch_s=0.01)
        sim, _ = make_sim("token-level", make_models(1), instances,
                          [Request(f"r{k}", "m0", 0.2 * k, 2000, 60) for k in range(20)], costs=costs)
        sim.gpus = costs.gpu_shares(instances, {"i0": 0, "i1": 0})
        sim.run()
        records = list(sim.records.values())
        assert all(r.generated == r.output_tokens for r in records)
        return (sum(r.first_token_at - r.arrival_at for r in records) / len(records),
                sum(r.finished_at - r.first_token_at for r in records) / len(records))

    even_ttft, even_decode = run(None)
    uneven_ttft, uneven_decode = run(3.0)
    assert uneven_decode > 1.2 * even_decode
    assert uneven_ttft <= even_ttft * 1.05


GB = 1e9
# a decoder of 1 or 8 GB beside a prefiller of 1 or 8 GB, prompts of 2048 and of 256 tokens: every combination
TABLE = ShareTable([(d * GB, p * GB, n, dec, pre) for (d, p), by_length in {
    (1, 1): {2048: (2.0, 1.1), 256: (1.5, 2.0)}, (8, 8): {2048: (3.5, 1.2), 256: (2.5, 1.8)},
    (1, 8): {2048: (4.0, 1.0), 256: (3.0, 1.6)}, (8, 1): {2048: (1.5, 1.4), 256: (1.2, 2.2)}}.items()
    for n, (dec, pre) in by_length.items()])


def test_a_share_table_gives_the_measured_points_and_interpolates_between_them_only() -> None:
    assert TABLE.decode_slowdown(1 * GB, 8 * GB, 2048) == 4.0 and TABLE.prefill_slowdown(8 * GB, 1 * GB, 256) == 2.2
    # halfway in log size between the two decoders, beside the large prefiller's long prompts: between 4.0 and 3.5
    assert TABLE.decode_slowdown(math.sqrt(8) * GB, 8 * GB, 2048) == pytest.approx(3.75)
    assert TABLE.decode_slowdown(math.sqrt(8) * GB, math.sqrt(8) * GB, 2048) == pytest.approx((2 + 3.5 + 4 + 1.5) / 4)
    assert TABLE.prefill_slowdown(1 * GB, 1 * GB, 512) == pytest.approx(2.0 - (2.0 - 1.1) / 3)  # 512: 1/3 up in log
    assert TABLE.decode_slowdown(0.1 * GB, 20 * GB, 9000) == 4.0  # beyond the values measured: the nearest figure
    assert TABLE.prefill_slowdown(1 * GB, 1 * GB, 16) == 2.0
    one = ShareTable([(1 * GB, 1 * GB, 2048, 3.0, 1.2)])
    assert one.decode_slowdown(9 * GB, 0.2 * GB, 100) == 3.0  # one point: everywhere
    with pytest.raises(ValueError, match=r"missing \(decode_bytes, prefill_bytes, prompt_tokens\)"):
        ShareTable([(1 * GB, 1 * GB, 2048, 2.0, 1.1), (8 * GB, 8 * GB, 2048, 3.5, 1.2)])  # no 1 GB beside 8 GB
    with pytest.raises(ValueError, match="slowdowns >= 1"):
        ShareTable([(1 * GB, 1 * GB, 2048, 0.9, 1.1)])


def test_time_sharing_with_a_table_slows_each_step_by_the_sizes_and_the_prompt() -> None:
    sizes = {"small": 1 * GB, "large": 8 * GB}
    gpus = GpuTimeSharing(PAIR, 2.0, decode_slowdown=3.0, prefill_slowdown=1.1, table=TABLE, model_bytes=sizes)
    assert gpus.rate(("decode", 1 * GB, 0), [("prefill", 8 * GB, 2048)]) == pytest.approx(1 / 4.0)
    assert gpus.rate(("prefill", 1 * GB, 2048), [("decode", 8 * GB, 0)]) == pytest.approx(1 / 1.4)
    assert gpus.rate(("prefill", 1 * GB, 256), [("decode", 8 * GB, 0)]) == pytest.approx(1 / 2.2)
    assert gpus.rate(("decode", 1 * GB, 0), [("prefill", 0.0, 2048)]) == pytest.approx(1 / 3.0)  # size unknown
    assert gpus.work_end_at("p", 0.0, 10.0, 0.0, "prefill", ["large"], 2048) == 10.0  # a long prefill, booked first
    # a small model's decode turn beside it: 4x as long as alone (the table), not the terms' 3x
    assert gpus.work_end_at("d", 1.0, 0.5, 1.0, "decode", ["small"]) == pytest.approx(1.0 + 0.5 * 4.0)
    other = GpuTimeSharing(PAIR, 2.0, table=TABLE, model_bytes=sizes)
    other.work_end_at("p", 0.0, 10.0, 0.0, "prefill", ["small"], 256)
    assert other.work_end_at("d", 1.0, 0.5, 1.0, "decode", ["small", "large"]) == pytest.approx(1.0 + 0.5 * 1.2)


def test_a_profile_with_measured_share_pairs_gives_the_simulator_the_table() -> None:
    from sims.profiles import SharePair, load_profile

    base = load_profile("default")
    small, large = Arch.model_validate(ARCHS["qwen2.5-0.5b"]), Arch.model_validate(ARCHS["qwen2.5-7b"])
    pairs = [SharePair(decode_shape=d, prefill_shape=p, decode_bytes=a.weight_bytes, prefill_bytes=b.weight_bytes,
                       prompt_tokens=2048, decode_slowdown=ds, prefill_slowdown=1.0)
             for (d, a), (p, b), ds in ((("s", small), ("s", small), 1.5), (("l", large), ("l", large), 3.5),
                                        (("s", small), ("l", large), 5.0), (("l", large), ("s", small), 1.2))]
    profile = base.model_copy(update={"share_pairs": pairs})
    instances = [InstanceSpec("p", 1, 80e9), InstanceSpec("d", 1, 80e9)]
    costs = RooflineCostModel.for_models({"tiny": (small, 1), "big": (large, 2)}, "h200", profile)
    shares = costs.gpu_shares(instances, {"p": 0, "d": 0})
    assert isinstance(shares, GpuTimeSharing) and shares.table is not None
    assert shares.model_bytes == {"tiny": small.weight_bytes, "big": large.weight_bytes / 2}  # per GPU
    assert shares.rate(("decode", small.weight_bytes, 0), [("prefill", large.weight_bytes, 100)]) == \
        pytest.approx(1 / 5.0)


# a decode step of a 1 or 8 GB model beside a second process decoding a 1 or 8 GB model: every combination
DECODE_TABLE = DecodeShareTable([(d * GB, p * GB, slowdown) for (d, p), slowdown in {
    (1, 1): 1.2, (1, 8): 1.8, (8, 1): 1.1, (8, 8): 1.5}.items()])


def test_a_decode_share_table_gives_the_measured_pairs_and_is_bilinear_in_the_logs_of_the_sizes_between() -> None:
    assert DECODE_TABLE.slowdown(1 * GB, 8 * GB) == 1.8 and DECODE_TABLE.slowdown(8 * GB, 1 * GB) == 1.1
    assert DECODE_TABLE.slowdown(1 * GB, math.sqrt(8) * GB) == pytest.approx(1.5)  # halfway in log: 1.2 to 1.8
    # 2 GB beside 2 GB: a third of the way up in log on both axes
    assert DECODE_TABLE.slowdown(2 * GB, 2 * GB) == pytest.approx(
        (4 * 1.2 + 2 * 1.8 + 2 * 1.1 + 1 * 1.5) / 9)
    # beyond the sizes measured the nearest measured size's figure: clamped per axis, nothing extrapolated
    assert DECODE_TABLE.slowdown(0.1 * GB, 20 * GB) == 1.8
    assert DECODE_TABLE.slowdown(20 * GB, 4 * GB) == pytest.approx(1.1 + (1.5 - 1.1) * 2 / 3)
    one = DecodeShareTable([(1 * GB, 1 * GB, 1.3)])
    assert one.slowdown(9 * GB, 0.2 * GB) == 1.3  # one shape measured beside itself: everywhere
    with pytest.raises(ValueError, match=r"missing \(decode_bytes, peer_bytes\)"):
        DecodeShareTable([(1 * GB, 1 * GB, 1.2), (8 * GB, 8 * GB, 1.5)])  # no 1 GB beside 8 GB
    with pytest.raises(ValueError, match="slowdowns >= 1"):
        DecodeShareTable([(1 * GB, 1 * GB, 0.9)])


def test_a_decode_step_beside_a_decoding_peer_takes_the_decode_tables_slowdown_else_the_budgets() -> None:
    sizes = {"small": 1 * GB, "large": 8 * GB}
    gpus = GpuTimeSharing(PAIR, 2.0, decode_slowdown=3.0, prefill_slowdown=1.1, table=TABLE, model_bytes=sizes,
                          decode_table=DECODE_TABLE)
    assert gpus.rate(("decode", 1 * GB, 0), [("decode", 8 * GB, 0)]) == pytest.approx(1 / 1.8)
    assert gpus.rate(("decode", 8 * GB, 0), [("decode", 1 * GB, 0)]) == pytest.approx(1 / 1.1)
    assert gpus.rate(("decode", 1 * GB, 0), [("decode", 0.0, 0)]) == 0.5  # a model of unknown size: the budget's 2
    assert gpus.rate(("prefill", 1 * GB, 2048), [("prefill", 8 * GB, 2048)]) == 0.5  # prefill beside prefill: as was
    assert gpus.rate(("decode", 1 * GB, 0), [("prefill", 8 * GB, 2048)]) == pytest.approx(1 / 4.0)  # cross: TABLE
    # beside a decoding and a prefilling peer: the larger slowdown, shared three ways
    assert gpus.rate(("decode", 1 * GB, 0), [("decode", 8 * GB, 0), ("prefill", 8 * GB, 2048)]) == \
        pytest.approx(share(3, 4.0))
    assert gpus.work_end_at("d", 0.0, 10.0, 0.0, "decode", ["large"]) == 10.0  # a long decode turn, booked first
    # a hand-off's decode steps of the small model beside it: 1.8x as long as alone, not the budget's 2x
    assert gpus.work_end_at("p", 1.0, 0.01, 1.0, "decode", ["small"]) == pytest.approx(1.0 + 0.01 * 1.8)
    without = GpuTimeSharing(PAIR, 2.0, decode_slowdown=3.0, prefill_slowdown=1.1, table=TABLE, model_bytes=sizes)
    assert without.decode_table is None
    assert without.rate(("decode", 1 * GB, 0), [("decode", 8 * GB, 0)]) == 0.5
    without.work_end_at("d", 0.0, 10.0, 0.0, "decode", ["large"])
    assert without.work_end_at("p", 1.0, 0.01, 1.0, "decode", ["small"]) == pytest.approx(1.0 + 0.01 * 2.0)


def test_a_profile_with_measured_decode_pairs_gives_the_simulator_the_decode_table() -> None:
    from sims.profiles import DecodePair, load_profile

    base = load_profile("default")
    small, large = Arch.model_validate(ARCHS["qwen2.5-0.5b"]), Arch.model_validate(ARCHS["qwen2.5-7b"])
    pairs = [DecodePair(decode_shape=d, peer_shape=p, decode_bytes=a.weight_bytes, peer_bytes=b.weight_bytes,
                        slowdown=slowdown)
             for (d, a), (p, b), slowdown in ((("s", small), ("s", small), 1.1), (("l", large), ("l", large), 1.4),
                                              (("s", small), ("l", large), 1.6), (("l", large), ("s", small), 1.05))]
    instances = [InstanceSpec("p", 1, 80e9), InstanceSpec("d", 1, 80e9)]
    models = {"tiny": (small, 1), "big": (large, 2)}
    costs = RooflineCostModel.for_models(models, "h200", base.model_copy(update={"decode_pairs": pairs}))
    shares = costs.gpu_shares(instances, {"p": 0, "d": 0})
    assert isinstance(shares, GpuTimeSharing) and shares.decode_table is not None
    assert shares.rate(("decode", small.weight_bytes, 0), [("decode", large.weight_bytes, 0)]) == \
        pytest.approx(1 / 1.6)
    unmeasured = RooflineCostModel.for_models(models, "h200", base).gpu_shares(instances, {"p": 0, "d": 0})
    assert isinstance(unmeasured, GpuTimeSharing) and unmeasured.decode_table is None
    assert unmeasured.rate(("decode", small.weight_bytes, 0), [("decode", large.weight_bytes, 0)]) == 0.5


class _DecodeTableCosts(LinearCosts):
    """LinearCosts whose instances on one GPU take a decode step's slowdown beside a decoding peer from a table of
    one figure (the model m0 measured beside itself), or the budget's 2 without one."""

    def __init__(self, slowdown: float | None, **kw: float) -> None:
        super().__init__(**kw)
        self.table = None if slowdown is None else DecodeShareTable([(14 * GB, 14 * GB, slowdown)])

    def gpu_shares(self, instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> GpuShares | None:
        peers = gpu_peers(instances, gpu_of)
        return GpuTimeSharing(peers, 2.0, 3.0, 1.1, model_bytes={"m0": 14 * GB}, decode_table=self.table) \
            if peers else None


def test_hand_off_decode_steps_beside_the_decode_instance_take_the_measured_slowdown() -> None:
    """A prefill and a decode instance on one GPU: the prefill instance's first decode steps of each hand-off run
    beside the decode instance's turns. A measured 1.2 there ends requests sooner than the assumed 2; a table
    that says 2 simulates exactly as none (the same Plans)."""
    def run(slowdown: float | None) -> tuple[float, str]:
        instances = make_instances(2, roles=["prefill", "decode"])
        costs = _DecodeTableCosts(slowdown, step_s=0.01, prefill_per_token_s=2e-5, switch_s=0.01)
        log = io.StringIO()
        sim, _ = make_sim("token-level", make_models(1), instances,
                          [Request(f"r{k}", "m0", 0.05 * k, 200, 60) for k in range(30)], costs=costs, plan_log=log)
        sim.gpus = costs.gpu_shares(instances, {"i0": 0, "i1": 0})
        sim.run()
        records = list(sim.records.values())
        assert all(r.generated == r.output_tokens for r in records)
        return sum(r.finished_at - r.arrival_at for r in records) / len(records), log.getvalue()

    assumed, assumed_log = run(None)
    same, same_log = run(2.0)
    measured, _ = run(1.2)
    assert same == assumed and same_log == assumed_log
    assert measured < assumed
