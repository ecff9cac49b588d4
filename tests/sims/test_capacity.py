"""The capacity search: bracketing, bisection and verification (with a fake evaluator, non-monotone
included), token-level's split steering, dedicated's per-model sizing, the driver, and the CLI end to end."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from modelpool.cli import app
from sims.capacity import (ClassAnswer, Goal, InlineEvaluator, make_search, run_searches, search_dedicated,
                           search_pooled, search_token_level)
from sims.capacity_eval import ClassInfo, Layout, Outcome, Point

TINY_FLEET = """\
pool: {gpu: h20, num_gpus: 4}
models:
  - {name: small-a, arch: qwen2.5-1.5b, traffic: {rate_rps: 0.4}}
  - {name: small-b, arch: qwen3-1.7b, traffic: {rate_rps: 0.2}}
  - {name: small-c, arch: qwen2.5-3b, traffic: {rate_rps: 0.1}}
"""


def outcome(point: Point, attainment: float, *, ttft_ok: float = 1.0, tpot_ok: float = 1.0,
            per_model: dict[str, float] | None = None) -> Outcome:
    models = tuple((m, a, a, 10) for m, a in sorted((per_model or {}).items()))
    return Outcome(point, attainment, attainment, 100, ttft_ok, tpot_ok, 1.0, 0.1, 0.5, models)


def drive(search, attainment: Callable[[Point], Outcome]) -> tuple[ClassAnswer, list[Point]]:
    calls: list[Point] = []

    def evaluate(point: Point) -> Outcome:
        calls.append(point)
        return attainment(point)

    answers, stats = run_searches({"only": search}, InlineEvaluator(evaluate))
    assert stats.evaluated == len(calls) == len(set(calls))  # every point simulated once
    return answers["only"], calls


def info(tp: int = 1, load: float = 1.0, models: tuple[str, ...] = ("m0", "m1")) -> ClassInfo:
    return ClassInfo(tp, models, 100, load, tuple((m, load / len(models)) for m in models))


def by_instances(passing: Callable[[int], bool]) -> Callable[[Point], Outcome]:
    return lambda p: outcome(p, 0.995 if passing(p.layout.num_instances) else 0.9)


def test_monotone_attainment_finds_the_exact_minimum_in_few_simulations() -> None:
    answer, calls = drive(search_pooled(info(load=1.2), Goal(0.99), "h20", "request-level"), by_instances(lambda n: n >= 13))
    assert answer.met and answer.layout == Layout(1, mixed=13) and answer.layout.gpus == 13
    assert calls[0].layout.num_instances == 2  # the bracket starts at the prefill-load bound
    assert len(calls) <= 10


def test_non_monotone_attainment_is_caught_by_verifying_below_the_answer() -> None:
    # passes at 4 and from 6 on, fails at 2, 3 and 5: the bisection settles on 6, verification finds 4
    answer, calls = drive(search_pooled(info(load=1.5), Goal(0.99, window=2), "h20", "spatial"),
                          by_instances(lambda n: n == 4 or n >= 6))
    assert [p.layout.num_instances for p in calls] == [2, 3, 5, 8, 6, 4]
    assert answer.layout.num_instances == 4 and answer.met
    assert any("not monotone" in note and "5" in note for note in answer.notes)


def test_a_target_never_met_reports_the_best_layout_found() -> None:
    answer, calls = drive(search_pooled(info(), Goal(0.99, max_instances=6), "h20", "request-level"),
                          lambda p: outcome(p, 0.5 + p.layout.num_instances / 100))
    assert not answer.met and answer.layout.num_instances == 6
    assert [p.layout.num_instances for p in calls] == [1, 2, 3, 5, 6]
    assert any("not met" in n for n in answer.notes)


def test_token_level_steers_the_split_toward_the_slo_that_missed() -> None:
    def attainment(p: Point) -> Outcome:
        lay = p.layout
        if lay.mixed:
            return outcome(p, 0.5, ttft_ok=0.5, tpot_ok=0.6)
        ttft_ok, tpot_ok = (1.0 if lay.prefill >= 3 else 0.8), (1.0 if lay.decode >= 4 else 0.85)
        return outcome(p, min(ttft_ok, tpot_ok) - 0.001, ttft_ok=ttft_ok, tpot_ok=tpot_ok)

    answer, calls = drive(search_token_level(info(load=1.6), Goal(0.99), "h20"), attainment)
    assert answer.met and (answer.layout.prefill, answer.layout.decode) == (3, 4)
    assert calls[0].layout == Layout(1, mixed=2)  # two instances: all mixed first
    # a split starts from the guess that keeps prefill ~75% busy, ceil(1.6 / 0.75) = 3 prefill instances
    assert next(p.layout for p in calls if p.layout.num_instances == 7) == Layout(1, 3, 4)
    for p in calls:  # every miss moved toward the SLO that missed: never fewer than 3 prefill with TTFT missing
        assert p.layout.mixed or p.layout.prefill <= 3 or p.layout.decode < 4


def test_token_level_tries_mixed_instances_for_small_classes() -> None:
    answer, _ = drive(search_token_level(info(tp=4, load=0.4), Goal(0.99), "h20"),
                      lambda p: outcome(p, 0.995 if p.layout.mixed == 2 else 0.9))
    assert answer.layout == Layout(4, mixed=2) and answer.layout.gpus == 8


def test_dedicated_gives_each_model_its_own_instances_and_gives_back_spares() -> None:
    need = {"hot": 3, "warm": 2, "cold": 1}
    load = {"hot": 2.0, "warm": 0.3, "cold": 0.01}  # starts hot at ceil(2.0 / 0.85) = 3: one more than... enough

    def attainment(p: Point) -> Outcome:
        reps = dict(p.layout.replicas)
        scores = {m: 0.999 if reps[m] >= need[m] else 0.9 for m in reps}
        return outcome(p, min(scores.values()), per_model=scores)

    search = search_dedicated(ClassInfo(1, tuple(need), 100, sum(load.values()), tuple(load.items())), Goal(0.99), "h20")
    answer, calls = drive(search, attainment)
    assert answer.met and dict(answer.layout.replicas) == need and answer.layout.gpus == 6
    assert dict(calls[0].layout.replicas) == {"hot": 3, "warm": 1, "cold": 1}


def test_dedicated_stops_growing_a_model_more_instances_do_not_help() -> None:
    def attainment(p: Point) -> Outcome:
        reps = dict(p.layout.replicas)
        scores = {"ok": 1.0, "stuck": 0.8}
        return outcome(p, 0.9, per_model=scores)

    answer, calls = drive(search_dedicated(info(models=("ok", "stuck"), load=0.1), Goal(0.99), "h20"), attainment)
    assert not answer.met and dict(answer.layout.replicas) == {"ok": 1, "stuck": 1}
    assert any("stuck" in note and "did not help" in note for note in answer.notes)
    assert len(calls) <= 3


def test_a_layout_refused_for_memory_ends_the_search_at_once() -> None:
    def refused(p: Point) -> Outcome:
        return Outcome(p, 0.0, 0.0, 100, 0.0, 1.0, 0.0, 0.0, 0.0, error="requests refused: no instance has room",
                       fatal=True)

    answer, calls = drive(search_token_level(info(tp=4, load=0.4), Goal(0.99), "h100"), refused)
    assert not answer.met and len(calls) == 1
    assert answer.notes == ["stopped: requests refused: no instance has room"]


def test_the_driver_interleaves_searches_and_simulates_shared_points_once() -> None:
    goal = Goal(0.99)
    searches = {k: make_search("request-level", info(load=2.5), goal, "h20") for k in ("a", "b")}
    seen: list[Point] = []

    def evaluate(point: Point) -> Outcome:
        seen.append(point)
        return outcome(point, 0.995 if point.layout.num_instances >= 7 else 0.5)

    answers, stats = run_searches(searches, InlineEvaluator(evaluate))
    assert answers["a"].layout == answers["b"].layout == Layout(1, mixed=7)
    assert len(seen) == len(set(seen)) == stats.evaluated and stats.reused > 0


def test_stopped_runs_are_misses_and_are_not_scored_per_model() -> None:
    point = Point("h20", "dedicated", Layout(1, replicas=(("m0", 1),)))
    stopped = Outcome(point, 0.5, math.nan, 100, 0.5, 1.0, math.nan, math.nan, math.nan, stopped_at=30.0)
    assert not Goal(0.99).passes(stopped)
    answer, _ = drive(search_dedicated(info(models=("m0",), load=0.1), Goal(0.99, max_instances=4), "h20", max_rounds=2),
                      lambda p: Outcome(p, 0.5, math.nan, 100, 0.5, 1.0, math.nan, math.nan, math.nan, stopped_at=30.0))
    assert not answer.met


# ---- the real thing, small ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_fleet(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("fleet") / "tiny.yaml"
    path.write_text(TINY_FLEET)
    return path


def test_cli_sizes_a_small_fleet_and_writes_every_report_file(tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["capacity", "--fleet", str(tiny_fleet), "--duration", "60", "--workers", "0",
                                   "--what-if-tpot", "0", "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("report.html", "report.md", "report.json", "capacity.csv", "per_model.csv", "curves.csv"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    assert report["dedicated_gpus"] == 3  # three light models: one instance each
    assert set(report["policies"]) == {"dedicated", "request-level", "spatial", "token-level"}
    assert all(e["met"] for e in report["policies"].values())
    assert report["policies"]["token-level"]["gpus"] <= report["dedicated_gpus"]
    assert "dedicated H20s ->" in res.output


def test_cli_rejects_bad_options(tiny_fleet: pathlib.Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["capacity", "--fleet", str(tiny_fleet), "--slo-metric", "p99"])
    assert res.exit_code == 1 and "per-request or aegaeon" in res.output
    res = runner.invoke(app, ["capacity", "--fleet", str(tiny_fleet), "--policies", "fifo"])
    assert res.exit_code == 1 and "unknown ['fifo']" in res.output
    res = runner.invoke(app, ["capacity", "--fleet", str(tiny_fleet), "--gpu-types", "h20,b300"])
    assert res.exit_code == 1 and "unknown ['b300']" in res.output


@pytest.mark.slow
def test_cli_runs_the_sweep_as_ray_tasks_and_compares_gpu_types(tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["capacity", "--fleet", str(tiny_fleet), "--duration", "60", "--workers", "2",
                                   "--policies", "dedicated,token-level", "--gpu-types", "h20,h200",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert set(report["gpu_types"]) == {"h20", "h200"}
    h200 = report["gpu_types"]["h200"]["policies"]
    assert set(h200) == {"dedicated", "token-level"} and h200["dedicated"]["gpus"] == 3
    assert report["what_if"] and report["what_if"][0]["tpot_slo_factor"] == 2.0


# ---- the Aegaeon reproduction's pieces ---------------------------------------------------------------------

def _reproduce_module():
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "aegaeon" / "reproduce.py"
    spec = importlib.util.spec_from_file_location("aegaeon_reproduce", path)
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_aegaeon_fleet_scales_in_the_6_2_2_mix_with_scaled_slos() -> None:
    from modelpool.config import load_fleet

    mod = _reproduce_module()
    base = load_fleet(pathlib.Path(mod.__file__).parent / "models.yaml")
    assert base.pool.gpu == "h800" and base.pool.num_gpus == 16
    fleet = mod.scaled_fleet(base, 50, 0.5)
    archs = [m.arch_name for m in fleet.models]
    assert (archs.count("qwen2.5-7b"), archs.count("yi-1.5-9b"), archs.count("llama-2-13b")) == (30, 10, 10)
    assert len({m.name for m in fleet.models}) == 50
    assert {(fleet.slo(m).ttft_s, fleet.slo(m).tpot_s) for m in fleet.models} == {(5.0, 0.05)}


def test_aegaeon_most_models_search_verifies_above_the_answer() -> None:
    mod = _reproduce_module()
    notes: list[str] = []
    passing = {m for m in range(0, 200, 2) if m <= 40 or m == 46}  # 42 and 44 fail, 46 passes: not monotone

    def evaluate(trial):
        ok = trial.models in passing
        return mod.TrialOutcome(trial, 1.0 if ok else 0.5, 1.0 if ok else 0.5, 0.0, 0.0, 0.0)

    answers, _ = run_searches({"s": mod.most_models("token-level", 1.0, "aegaeon", 0.9, notes)}, InlineEvaluator(evaluate))
    assert answers["s"] == 46 and notes
