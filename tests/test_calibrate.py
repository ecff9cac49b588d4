"""`modelpool calibrate` on this machine's CPU, as a user runs it: one command, one measurements file."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scheduler.fleet import Arch

ROOT = Path(__file__).resolve().parents[1]


def _calibrate(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "modelpool.cli", "calibrate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_calibrate_on_a_cpu_measures_every_term_with_no_gpu_entry(tmp_path: Path) -> None:
    from modelpool.calibrate import pick_host_backend
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile
    from sims.profiles.measurements import Measurements

    out = tmp_path / "cpu.json"
    done = _calibrate("--device", "cpu", "--quick", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {out}" in " ".join(done.stdout.split())
    measured = Measurements.model_validate_json(out.read_text())
    assert measured.gpu == "cpu" and measured.quick and measured.spec.hbm_tb_s > 0  # the CPU's own figures
    families = {arch.family for arch in measured.shapes.values()}
    assert len(measured.shapes) >= 5 and families == {"qwen2", "qwen3", "llama"}
    for field in ("num_layers", "hidden_size", "num_kv_heads", "vocab_size"):  # shapes that vary apart
        assert len({getattr(arch, field) for arch in measured.shapes.values()}) >= 3, field
    for term in ("eff_compute", "eff_mem", "decode_fixed_s", "eff_pcie", "kv_move_fixed_s"):
        entry = measured.terms[term]
        assert entry.basis == "measured" and entry.points >= 5 and entry.loo_error is not None, term
    assert measured.points.host.backend == pick_host_backend(None, quick=True)  # serve's (quick: no Ray cluster)
    for term in ("host_call_s", "request_admit_s", "token_deliver_s", "kv_call_host_s"):  # the idle pool's own time
        assert measured.terms[term].points > 0 and 0 < float(measured.terms[term].value) < 0.5, term
    assert measured.terms["eff_nvlink"].basis == "assumed"
    share = measured.points.share  # engine processes side by side, as serve places a prefill and a decode instance
    by_size = sorted(measured.shapes, key=lambda name: measured.shapes[name].weight_bytes)
    small, large = by_size[0], by_size[-1]  # each pair of the smallest and the largest shape, the same first
    pairs = [(small, small), (large, large), (small, large), (large, small)]
    assert [(pair.shape, pair.prefill_shape, pair.prefill_tokens) for pair in share] == \
        [(d, p, 64) for d, p in pairs] + [(d, p, 16) for d, p in pairs]  # the long prompts first, then short ones
    assert all(not pair.mps and len(pair.decode_beside_s) >= 3 for pair in share)
    for term in ("share_prefill_slowdown", "share_decode_slowdown"):
        entry = measured.terms[term]
        assert entry.unit == "ratio" and entry.points >= 6 and 1.0 <= float(entry.value) < 20, term
    # then decode beside decode, the same pairs: every shape's decode steps beside every shape's
    assert [(run.shape, run.peer_shape) for run in measured.points.share_decode] == pairs
    profile = load_profile(out)
    assert {(p.decode_shape, p.peer_shape) for p in profile.decode_pairs} == set(pairs)
    assert profile.terms.share_decode_slowdown == measured.terms["share_decode_slowdown"].value
    costs = RooflineCostModel.for_models({"m": (Arch.model_validate(measured.shapes["tiny-qwen2-a"].model_dump()), 1)},
                                         "cpu", profile)
    assert costs.gpu == measured.spec and costs.decode_step_s("m", 1, 32) > 0


@pytest.mark.slow
def test_the_share_benchmark_on_tiny_shapes_times_decode_beside_decode_after_the_prefill_pairs() -> None:
    """calibrate's share benchmark on a CPU (--quick's tiny shapes: the smallest and the largest): after every
    decoder beside every prefiller, every decoder beside every prefilling process decoding too, both sides timed
    alone and beside; the runs make the profile's decode pairs, every shape beside every shape."""
    from modelpool.calibrate import _measure_share
    from modelpool.measure import shapes_for
    from modelpool.measure_share import ShareSetup
    from sims.profiles.measurements import decode_pairs, decode_share_slowdowns, share_pairs

    shapes = shapes_for(False, True)
    share, share_decode = _measure_share(shapes, "cpu", False, True, 0)
    by_size = sorted(shapes, key=lambda name: shapes[name].weight_bytes)
    small, large = by_size[0], by_size[-1]
    pairs = [(small, small), (large, large), (small, large), (large, small)]
    setup = ShareSetup.default(small, shapes[small], "cpu", quick=True)
    assert [(pair.shape, pair.prefill_shape) for pair in share] == pairs + pairs  # the prefill pairs as before
    assert len(share_pairs(share, shapes)) == 8
    assert [(run.shape, run.peer_shape) for run in share_decode] == pairs
    for run in share_decode:
        assert not run.mps and run.decode_batch == run.peer_batch == 4
        assert min(len(run.beside_s), len(run.peer_beside_s)) >= 3  # whole steps inside the other's stepping
        assert len(run.alone_s) == len(run.peer_alone_s) == setup.steps  # --quick's steps alone, each process
        assert all(seconds > 0 for seconds in [*run.alone_s, *run.beside_s, *run.peer_alone_s, *run.peer_beside_s])
        assert all(1.0 <= slowdown < 20 for slowdown in decode_share_slowdowns(run))
    table = {(p.decode_shape, p.peer_shape): p for p in decode_pairs(share_decode, shapes)}
    assert set(table) == set(pairs)
    assert table[small, large].decode_bytes == shapes[small].weight_bytes < table[small, large].peer_bytes


def test_calibrate_refuses_cuda_where_there_is_none(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = _calibrate("--device", "cuda", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 1 and "torch sees no CUDA device here" in done.stderr and "--device cpu" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_calibrate_refuses_a_backend_serve_does_not_run_on_before_measuring(tmp_path: Path) -> None:
    done = _calibrate("--device", "cpu", "--backend", "inprocess", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "unknown backend 'inprocess'" in done.stderr and "--backend" in done.stderr
    assert not (tmp_path / "x.json").exists()


_WITHOUT_TORCH = """
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotInstalled())
sys.argv = ["modelpool", "calibrate", "--device", "cpu", "--out", sys.argv[1]]
from modelpool.cli import app
app()
"""


def test_calibrate_without_the_serve_extra_says_what_to_install(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, str(tmp_path / "x.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "needs torch" in done.stderr and "modelpool[serve]" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_share_decoder_steps_back_to_back_as_a_served_decode_instance(monkeypatch):
    """The share benchmark's decode steps run without a sync between them, each timed from the previous step's
    return (the device never idles for the host, as under a pool's async decode); a fresh batch restarts the
    clock after its own sync, so no step's interval holds the batch's admission."""
    from modelpool import measure_share
    from modelpool.measure import shapes_for

    shape, arch = next(iter(shapes_for(cuda=False, quick=True).items()))
    bench = measure_share._Bench("decode", measure_share.ShareSetup.default(shape, arch, "cpu", quick=True))
    syncs = []
    monkeypatch.setattr(bench.cal, "_sync", lambda: syncs.append(time.monotonic()))
    monkeypatch.setattr(measure_share, "SPIN_STEPS", bench.stepped + 3)  # a fresh batch after 3 more steps
    steps = bench.steps(count=7)
    assert len(steps) == 7 and all(start < end for start, end in steps)
    contiguous = [steps[i][0] == steps[i - 1][1] for i in range(1, 7)]
    assert contiguous == [True, True, False, True, True, True]  # the fresh batch's first step starts at its sync
    assert len(syncs) == 3  # the first step, the fresh batch, the end: none between steps
    assert syncs[0] <= steps[0][0] and steps[2][1] <= syncs[1] <= steps[3][0] and syncs[2] >= steps[-1][1]
    polls = iter([False, False, True])  # `spin`: until the parent's stop is waiting
    assert len(bench.steps(until=lambda: next(polls))) == 2


def test_calibrate_times_each_prefill_after_the_idle_gap_a_served_prefill_follows(monkeypatch):
    """Each timed prefill comes after the engine idled the plan's gap (a served prefill instance's engine waits on
    its pipe, or runs first decode steps, between prefills: the host-bound prefill of a small model runs slower
    then), the gap itself not counted, and the point says which gap it was timed after."""
    from dataclasses import replace

    from modelpool import measure
    from sims.profiles.measurements import PrefillPoint

    shape, arch = next(iter(measure.shapes_for(cuda=False, quick=True).items()))
    plan = replace(measure.plan_for(cuda=False, quick=True), prefill_lengths=(16,), prefill_batches=(1, 2),
                   repeats=2, prefill_gap_s=0.25)
    cal = measure.Calibration({shape: arch}, "cpu", plan, seed=0)
    cal.images[shape] = cal.cache.add_random(shape, measure.hf_config(arch), cal.dtype, seed=0, device=cal.device)
    cal.engine = cal._engine(cal._kv_bytes())
    cal.engine.activate(shape)
    slept, clock = [], [0.0]
    real_sleep, me = measure.time.sleep, threading.get_ident()

    def sleep(seconds: float) -> None:  # (the time module is shared: another test's leftover thread sleeps for real)
        if threading.get_ident() != me:
            return real_sleep(seconds)
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(measure.time, "sleep", sleep)
    real = measure.time.perf_counter
    monkeypatch.setattr(measure.time, "perf_counter",  # sleeping moves this thread's clock
                        lambda: real() + (clock[0] if threading.get_ident() == me else 0.0))
    cal._prefill(shape)
    points = [PrefillPoint.model_validate(p) for p in cal.result["prefill"]]
    assert [(p.tokens, p.batch, p.gap_s) for p in points] == [(16, 1, 0.25), (16, 2, 0.25)]
    assert slept == [0.25] * (2 * (1 + 2))  # before every prefill: the untimed first of each point and its repeats
    assert all(0 < p.seconds < 0.25 for p in points)  # the prefill's own time, not the gap before it
    assert PrefillPoint(shape="s", tokens=1, batch=1, seconds=0.1).gap_s == 0.0  # files from before the gap
