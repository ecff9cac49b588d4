"""The idle pool's host costs (modelpool.measure_live): measured on the backend serve runs its engines on, each
engine call timed in the pool's process (so a hop to another process is in it), and the file names the backend."""

from __future__ import annotations

import os
import time

import pytest
import typer

import modelpool.serve
from modelpool.calibrate import pick_host_backend
from modelpool.extras import installed
from modelpool.measure_live import GATEWAY_PROMPTS, _TimedBackend, measure_gateway, measure_host
from modelpool.serve import default_backend, pick_backend
from pool.calls import DecodeStep, GetStats

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.mark.parametrize("ray_here", [True, False])
def test_calibrate_measures_on_the_backend_serve_would_run_the_engines_on(monkeypatch: pytest.MonkeyPatch,
                                                                           ray_here: bool) -> None:
    monkeypatch.setattr(modelpool.serve, "installed", lambda name: ray_here if name == "ray" else installed(name))
    serves_on = pick_backend(None, "torch", ("ray", "processes", "threads", "inprocess"))
    assert serves_on == default_backend("torch") == ("ray" if ray_here else "processes")
    assert pick_host_backend(None) == serves_on
    assert pick_host_backend(None, quick=True) == "processes"  # a smoke run starts no Ray cluster
    assert pick_host_backend("threads", quick=True) == "threads"  # --backend: what serve is told to run on
    assert default_backend("sim") == "threads"  # the sim engine's default is not what calibrate measures
    with pytest.raises(typer.BadParameter):
        pick_host_backend("inprocess")  # tests' backend: serve never runs calls as they are issued
    if not ray_here:
        with pytest.raises(typer.BadParameter, match="Ray is not installed"):
            pick_host_backend("ray")
    else:
        assert pick_host_backend("ray", quick=True) == "ray"


class _SlowHop:
    """A backend whose results take `hop_s` to come back through its poll, as a pipe or Ray's object store does
    (call returns a handle at once; poll hands each result back once, oldest first)."""

    def __init__(self, hop_s: float) -> None:
        self.hop_s, self.pending, self.closed = hop_s, [], False

    def call(self, instance_id: str, call: object) -> int:
        self.pending.append(len(self.pending) + 1)
        return self.pending[-1]

    def poll(self, timeout_s: float) -> list[tuple[int, object]]:
        time.sleep(self.hop_s)
        out, self.pending = [(handle, []) for handle in self.pending], []
        return out

    def close(self) -> None:
        self.closed = True


def test_engine_calls_are_timed_where_the_pool_makes_them_hop_included() -> None:
    backend = _TimedBackend(_SlowHop(hop_s=0.02))
    handle = backend.call("i0", DecodeStep(("r1", "r2")))
    backend.call("i0", GetStats())  # not a call a token comes from: not timed
    assert [h for h, _ in backend.poll(0.1)] == [handle, handle + 1]
    (timed,) = backend.calls()
    assert timed.instance_id == "i0" and timed.name == "decode_step" and timed.request_ids == ("r1", "r2")
    assert timed.answered is not None and timed.answered - timed.issued >= 0.02  # the hop back is in the call
    backend.close()  # the rest of the backend's contract passes through
    assert backend._backend.closed


@pytest.mark.parametrize("backend", ["threads", pytest.param("processes", marks=pytest.mark.slow)])  # processes: 5 s,
# and calibrate --quick measures on them in the default suite (tests/test_cpu_profile.py)
def test_an_idle_pool_on_each_backend_gives_every_host_point_and_names_the_backend(backend: str) -> None:
    host = measure_host(backend, probes=3, batches=(1, 4), tokens=6)
    assert host.backend == backend
    assert set(host.step_s_by_batch) == {1, 4} and all(0 < s < 0.5 for s in host.step_s_by_batch.values())
    assert len(host.admit_s) == len(host.deliver_s) == len(host.handoff_s) == 3
    assert all(0 <= s < 0.5 for s in host.admit_s + host.deliver_s + host.handoff_s)
    assert sorted({p.prompt_tokens for p in host.gateway}) == list(GATEWAY_PROMPTS)  # through the gateway too
    assert len(host.gateway) == 3 * len(GATEWAY_PROMPTS)


def test_the_gateway_probe_times_the_gateways_way_in_and_out_apart_from_the_pools(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests go from a client in another process through the real gateway app under uvicorn: a gateway made
    slower on its way in (the prompt's checks) and on its way out (each SSE chunk) shows in the client's times
    and in in_s / out_s, and not in the pool's own admission and delivery of the same requests."""
    import pool.gateway.app as app

    def slowed(fn, delay_s):  # type: ignore[no-untyped-def]
        def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(delay_s)
            return fn(*args, **kwargs)
        return slow

    fast = measure_gateway("threads", probes=2, prompts=(16, 512), tokens=4)
    monkeypatch.setattr(app, "prepare", slowed(app.prepare, 0.03))
    monkeypatch.setattr(app, "sse", slowed(app.sse, 0.02))
    slow = measure_gateway("threads", probes=2, prompts=(16, 512), tokens=4)
    for points in (fast, slow):
        assert [p.prompt_tokens for p in points] == [16, 16, 512, 512]
        for p in points:
            assert len(p.out_s) == 4 and len(p.client_gap_s) == len(p.pool_gap_s) == 3
            # the client's TTFT holds the gateway's way in, the pool's admission and delivery and the way out
            assert p.ttft_s >= p.in_s + p.admit_s + p.deliver_s + p.out_s[0] > 0
    assert min(p.in_s for p in slow) >= 0.03 > max(p.in_s for p in fast)
    assert min(p.out_s[0] for p in slow) >= 0.02 > max(p.out_s[0] for p in fast)
    assert max(p.admit_s + p.deliver_s for p in slow) < 0.02  # the pool's own part did not take the delay


@pytest.mark.slow
@pytest.mark.skipif(not installed("ray"), reason="Ray is not installed")
def test_an_idle_pool_on_ray_starts_its_own_cluster_and_stops_it() -> None:
    import ray

    host = measure_host("ray", probes=2, batches=(1, 2), tokens=4)
    assert host.backend == "ray" and set(host.step_s_by_batch) == {1, 2} and len(host.handoff_s) == 2
    assert not ray.is_initialized()


def test_serve_notes_a_profile_whose_host_terms_were_measured_on_another_backend() -> None:
    from modelpool.serve import host_backend_note
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile
    from tests.sims.test_measurements import SHAPES, _build, _points, _truth_costs

    points = _points(_truth_costs())
    measured = _build(points.model_copy(update={"host": points.host.model_copy(update={"backend": "processes"})}))
    profile = measured.profile()
    assert profile.calibration is not None and profile.calibration.backend == "processes"
    costs = RooflineCostModel.for_models({name: (arch, 1) for name, arch in SHAPES.items()}, "h200", profile)
    assert host_backend_note(costs, "processes") is None  # measured where serve runs
    note = host_backend_note(costs, "ray")
    assert note is not None and "measured on the processes backend, but serve runs ray" in note
    assert "calibrate --backend ray" in note
    unmeasured = _build(points.model_copy(update={"host": type(points.host)()}))  # no host points: nothing to say
    assert unmeasured.profile().calibration.backend is None  # type: ignore[union-attr]
    assert host_backend_note(RooflineCostModel.for_models({"m": (SHAPES["qwen3-4b"], 1)}, "h200"), "ray") is None
    shipped = load_profile("h200-measured")  # measured before the field: on threads
    assert shipped.calibration is not None and shipped.calibration.backend == "threads"
