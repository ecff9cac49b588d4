"""`modelpool validate SCENARIO`: the comparison's arithmetic, the knee search, the fleets it builds, and the
whole command on tiny CPU shapes (serve, replay through the gateway, simulate, side by side)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelpool.validate import (WARM_UP_S, SimLayout, Targets, _after_warm_up, _simulated, build_fleet, compare,
                               knee_rate, model_config, recorded_instance, side_figures, sim_layout, simulated,
                               slo_of)
from sims.costmodel import RooflineCostModel
from sims.run import build_instances, simulate
from sims.scenarios import FLEETS, KNEE_ATTAINMENT, SCENARIOS
from sims.workload import request_id

ROOT = Path(__file__).resolve().parents[1]


def catalogue_layout(fleet_name: str, num_gpus: int) -> SimLayout:
    fleet = FLEETS[fleet_name].fleet("h100", num_gpus)
    return SimLayout(fleet, build_instances(fleet, "token-level", num_gpus), {}, RooflineCostModel(fleet), "default")


def test_compare_gives_points_for_attainment_and_relative_errors_for_the_rest() -> None:
    live = {"slo_attainment": 0.90, "ttft_p50_s": 0.2, "ttft_p90_s": 1.0, "tpot_p50_s": 0.02, "tpot_p90_s": None,
            "switches": 10}
    sim = {"slo_attainment": 0.95, "ttft_p50_s": 0.22, "ttft_p90_s": 0.5, "tpot_p50_s": 0.02, "tpot_p90_s": None,
           "switches": 12}
    rows = {r["figure"]: r for r in compare(live, sim, Targets())}
    assert rows["slo_attainment"]["error"] == pytest.approx(5.0) and not rows["slo_attainment"]["ok"]
    assert rows["ttft_p50_s"]["error"] == pytest.approx(0.1) and rows["ttft_p50_s"]["ok"]
    assert rows["ttft_p90_s"]["error"] == pytest.approx(-0.5) and not rows["ttft_p90_s"]["ok"]
    assert rows["tpot_p50_s"]["error"] == 0.0 and rows["tpot_p50_s"]["ok"]
    assert rows["tpot_p90_s"]["error"] is None and rows["tpot_p90_s"]["ok"]  # neither side has one
    assert rows["switches"]["error"] == pytest.approx(0.2) and not rows["switches"]["ok"]
    zero = {r["figure"]: r for r in compare({**live, "switches": 0}, {**sim, "switches": 3})}
    assert zero["switches"]["error"] == float("inf") and not zero["switches"]["ok"]


def test_attainment_is_counted_as_the_simulator_counts_it() -> None:
    """side_figures' rule over the simulated rows gives the simulator's own slo_attainment (one rule both sides)."""
    layout = catalogue_layout("mixed", 2)
    workload = SCENARIOS["mixed-onoff"].workload(6.0, 60.0, seed=2)
    rows, switches, copies = _simulated(layout, workload, None, 0)  # no warm-up: the simulator's own run
    result = simulate(layout.fleet, workload, "token-level", instances=layout.instances, costs=layout.costs)
    figures = side_figures(rows, len(workload), slo_of(layout.fleet), switches, copies)
    assert figures["slo_attainment"] == pytest.approx(result.metrics["slo_attainment"])
    assert switches == result.metrics["num_model_switches"] <= result.metrics["num_switches"]
    assert figures["served"] == len(workload)
    # the live pool's warm-up copies each model before the loads: the comparison counts the copies after the first
    assert figures["weight_copies"] == copies == result.metrics["num_weight_recopies"]
    assert copies < result.metrics["num_weight_copies"]
    assert figures["ttft_p50_s"] <= figures["ttft_p90_s"]


def test_the_simulated_pool_starts_warmed_up_as_serve_leaves_the_live_one() -> None:
    """serve's warm-up (a short request per model) copies every model before the first client's request; the
    simulated pool does the same, so a model's first request pays no whole-model copy, and the warm-up's own
    switches and copies are left out of the counts as the live Plan log ranges leave them out."""
    layout = catalogue_layout("large", 2)
    workload = SCENARIOS["large-poisson"].workload(0.5, 30.0, seed=1)
    rows, switches, copies = simulated(layout, workload)
    cold_rows, cold_switches, _ = _simulated(layout, workload, None, 0)
    first = rows[0]["model"]
    assert rows[0]["ttft_s"] + 0.5 * layout.costs.switch_s(first) < cold_rows[0]["ttft_s"]  # no cold copy
    assert [r["model"] for r in rows] == [r["model"] for r in cold_rows] and all(r["served"] for r in rows)
    assert copies == 0  # three 6-7B models fit beside each other on both instances: copied once, in the warm-up
    assert 0 < switches <= cold_switches  # switches between models held on the device: as many as the run needs
    warmed = simulate(layout.fleet, _after_warm_up(workload), "token-level", instances=layout.instances,
                      costs=layout.costs)
    assert len(warmed.records) == len(workload) + len(workload.models)  # one warm-up request per model
    assert warmed.records[request_id(0)].arrival_at == 0.0 < WARM_UP_S == warmed.records[request_id(3)].arrival_at \
        - workload.arrival_s[0]


def test_a_recorded_real_shape_run_is_simulated_with_the_served_shapes_its_weights_region_was_laid_out_for() -> None:
    """A shared weights region holds every served model once (the engines lay it out from the served configs); the
    catalogue's rounded parameter counts make the twelve small models 0.2% larger than that region, and a
    simulation with them evicted and re-copied models the live pool never copied again."""
    from modelpool.validate import served_fleet

    spec = FLEETS["small"]
    served, catalogue = served_fleet(spec, "h100"), spec.fleet("h100")
    region = sum(m.arch.weight_bytes for m in served.models)  # what the engines' shared region held live
    assert sum(m.arch.weight_bytes for m in catalogue.models) > region
    instances = [recorded_instance(["slot0", 1, 42.2e9, "prefill", 24.4e9, region, None]),
                 recorded_instance(["slot1", 1, 42.2e9, "decode", 24.4e9, region, None])]
    workload = SCENARIOS["small-poisson"].workload(20.0, 30.0, seed=0)

    def copies(fleet: Any) -> int:
        layout = SimLayout(fleet, instances, {"slot0": 0, "slot1": 0}, RooflineCostModel(fleet), "default")
        return simulated(layout, workload)[2]

    assert copies(served) == 0 < copies(catalogue)


def test_the_step_check_puts_each_engines_own_steps_beside_the_models_step_alone() -> None:
    from modelpool.validate import decode_context, step_check
    from scheduler.fleet import ARCHS, Arch
    from sims.workload import Workload

    costs = RooflineCostModel.for_models({"m": (Arch.model_validate({**ARCHS["qwen2.5-0.5b"], "total_params": None}), 1)},
                                         "h100")
    load = Workload.from_columns([0.0, 1.0], [0, 0], [100, 300], [10, 30], ["m"], "test")
    context = decode_context(load)
    assert context == (10 * (100 + 5) + 30 * (300 + 15)) / 40  # each request weighs its decode steps
    at = lambda batch: costs.decode_step_s("m", batch, int(context * batch)) * 1e3  # noqa: E731
    timings = {"decode_by_model": {
        "m": {"<=4": {"steps": 30, "batch_mean": 3.0, "forward_ms_mean": 2 * at(3)},
              "<=16": {"steps": 10, "batch_mean": 12.4, "forward_ms_mean": 3 * at(12)}},
        "m+other": {"<=16": {"steps": 99, "batch_mean": 10.0, "forward_ms_mean": 1.0}}},  # a mixed batch: left out
        "prefills": [["m", 512, 1, 1.5 * costs.prefill_s("m", 512, 1), 0],
                     ["m", 64, 2, 1.4 * costs.prefill_s("m", 64, 2), 0],
                     ["m", 2048, 1, 9.0 * costs.prefill_s("m", 2048, 1), 1], ["gone", 8, 1, 1.0, 0]]}
    status = {"instances": {"d0": {"role": "decode", "engine_extra": {"timings": timings}},
                            "p0": {"role": "prefill", "engine_extra": {"timings": {}}}}}
    check = step_check(status, costs, load)
    assert check["decode_context"] == round(context)
    assert [(r["instance"], r["batch"], r["steps"], r["ratio"]) for r in check["decode"]] == [
        ("d0", "<=4", 30, 2.0), ("d0", "<=16", 10, 3.0)]
    assert check["prefill"] == [{"instance": "d0", "role": "decode", "prefills": 3, "ratio_p50": 1.5,
                                 "by_model": {"m": {"prefills": 3, "ratio_p50": 1.5}},
                                 "after_discard": {"prefills": 1, "ratio_p50": 9.0},
                                 "fresh": {"prefills": 2, "ratio_p50": 1.45}}]
    timings["prefills"] = [row[:4] for row in timings["prefills"]]  # a file before the flag
    assert step_check(status, costs, load)["prefill"][0]["fresh"] == {"prefills": 0, "ratio_p50": None}


def test_a_failed_request_misses_and_the_quantiles_skip_it() -> None:
    rows = [{"model": "m", "served": True, "ttft_s": 0.1, "tpot_s": 0.01},
            {"model": "m", "served": True, "ttft_s": 3.0, "tpot_s": 0.01},
            {"model": "m", "served": True, "ttft_s": 0.1, "tpot_s": None},
            {"model": "m", "served": False, "error": "HTTP 503"}]
    figures = side_figures(rows, 4, lambda name: (2.0, 0.05), switches=0)
    assert figures["slo_attainment"] == 0.5 and figures["served"] == 3
    assert figures["tpot_p50_s"] == pytest.approx(0.01)


def test_the_knee_is_where_the_simulated_attainment_crosses_ninety_percent() -> None:
    layout = catalogue_layout("large", 2)
    scenario = SCENARIOS["large-poisson"]
    knee = knee_rate(scenario, layout, 60.0, seed=1)

    def attainment(rate: float) -> float:
        workload = scenario.workload(rate, 60.0, seed=1)
        rows, switches, _ = simulated(layout, workload)
        return side_figures(rows, len(workload), slo_of(layout.fleet), switches)["slo_attainment"]

    assert 0.05 < knee < 64
    assert attainment(knee) >= KNEE_ATTAINMENT > attainment(2 * knee)


def test_fleets_are_built_as_their_families_in_tiny_and_real_shapes(tmp_path: Path) -> None:
    from modelpool.config import load_fleet

    spec = FLEETS["mixed"]
    fleet = load_fleet(build_fleet(spec, tmp_path / "tiny", "h100", tiny=True))
    assert [m.name for m in fleet.models] == list(spec.names)
    for (name, arch), entry in zip(spec.models, fleet.models):
        config = json.loads((tmp_path / "tiny" / name / "config.json").read_text())
        assert config["model_type"] == spec.family(arch) == entry.arch.family
        assert (tmp_path / "tiny" / name / "random_weights.json").is_file()
        assert entry.arch.params < 5e6  # tiny
    assert fleet.pool.default_slo.tpot_s == spec.tpot_slo_s
    # the served tokenizer decodes every id of the vocabulary to a word (each token streams as its own chunk)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tiny" / spec.names[-1])
    assert tokenizer.decode([5, 2047]) == "w5 w2047"


def test_real_shapes_are_the_catalogues_own() -> None:
    """Every scenario fleet's served config has the catalogue's weights and KV per token (Qwen3-4B: 32 heads of
    128, not 2560 / 32)."""
    from scheduler.fleet import Arch, arch_from_hf_config

    for spec in FLEETS.values():
        fleet = spec.fleet("h100")
        for name, arch in spec.models:
            served = Arch.model_validate(arch_from_hf_config(model_config(spec, arch, tiny=False).to_dict()))
            assert served.family == fleet.model(name).arch.family
            assert served.weight_bytes == pytest.approx(fleet.model(name).arch.weight_bytes, rel=0.01)
            assert served.kv_bytes_per_token == fleet.model(name).arch.kv_bytes_per_token


def test_an_unknown_target_is_neither_a_fleet_file_nor_a_scenario() -> None:
    res = subprocess.run([sys.executable, "-m", "modelpool.cli", "validate", "no-such-scenario"],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and "neither a fleet file nor a scenario" in res.stderr and "eight-poisson" in res.stderr


@pytest.mark.slow
def test_validate_serves_replays_and_simulates_a_scenario_on_cpu(tmp_path: Path) -> None:
    """The whole command on tiny shapes, costed by what `modelpool calibrate` measured on this CPU: every request
    served live and simulated, the figures side by side."""
    out, measured = tmp_path / "out", tmp_path / "cpu.json"
    cal = subprocess.run([sys.executable, "-m", "modelpool.cli", "calibrate", "--device", "cpu", "--quick", "--out",
                          str(measured)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert cal.returncode == 0, cal.stdout[-2000:] + cal.stderr[-2000:]
    res = subprocess.run([sys.executable, "-m", "modelpool.cli", "validate", "mixed-onoff", "--quick", "--rate", "1",
                          "--duration", "4", "--profile", str(measured), "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "costed as measured" in res.stdout  # the CPU's own figures, not a datacenter GPU's
    assert yaml.safe_load((out / "models-mixed" / "fleet.yaml").read_text())["pool"]["gpu"] == "cpu"
    report = json.loads((out / "mixed-onoff.json").read_text())
    part = report["loads"]["light"]
    assert part["requests"] >= 1
    assert part["live"]["served"] == part["sim"]["served"] == part["requests"]
    assert [r["figure"] for r in part["errors"]] == ["slo_attainment", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s",
                                                      "tpot_p90_s", "switches", "weight_copies"]
    # weight copies counted on both sides (the engines' stats live, fresh after the replay); the plan logs of both
    assert isinstance(part["live"]["weight_copies"], int) and isinstance(part["sim"]["weight_copies"], int)
    assert (out / "serve.plans.jsonl").is_file() and (out / "sim-light.plans.jsonl").stat().st_size > 0
    assert part["live_plans"][0] < part["live_plans"][1]
    # /pool/status before and after the load: every instance's planned KV capacity and its engine's stats
    before, after = part["live_status"]
    assert set(after["instances"]) == {row[0] for row in report["layout"]["instances"]}
    assert all(i["kv_capacity_bytes"] > 0 and i["engine"] for i in after["instances"].values())
    # each engine's own steps beside the model's step alone: the prefill instance's prefills at least
    assert part["steps"]["decode_context"] > 0
    assert any(r["prefills"] > 0 and r["ratio_p50"] > 0 for r in part["steps"]["prefill"])
    assert all(r["steps"] > 0 and r["ratio"] > 0 for r in part["steps"]["decode"])
    sides = part["requests_side_by_side"]
    assert len(sides) == part["requests"] and all(r["live_ttft_s"] > 0 and r["sim_ttft_s"] > 0 for r in sides)
    assert any("--quick" in note for note in part["notes"])
    assert "slo_attainment" in res.stdout and "mixed-onoff.json" in res.stdout and "engine steps" in res.stdout
    assert (out / "serve.log").is_file()
    # the recorded live run simulated again (nothing served): the same requests and layout, the same figures
    again = subprocess.run([sys.executable, "-m", "modelpool.cli", "validate", "mixed-onoff", "--from-live",
                            str(out / "mixed-onoff.json"), "--out", str(tmp_path / "again")],  # its own profile
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    redone = json.loads((tmp_path / "again" / "mixed-onoff.json").read_text())["loads"]["light"]
    assert redone["sim"] == part["sim"] and redone["live"] == part["live"]


def test_the_index_rows_bold_what_meets_its_target_and_keep_the_files_layout() -> None:
    """benchmarks/validate_index.py: a report's rows (bold within target, the misses named), and the index file
    written back byte for byte as it was read."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from validate_index import dump_area, rows_of

    live = {"slo_attainment": 1.0, "ttft_p50_s": 0.059, "ttft_p90_s": 0.115, "tpot_p50_s": 0.0025,
            "tpot_p90_s": 0.006, "switches": 184}
    sim = {**live, "ttft_p50_s": 0.049, "switches": 174}
    report = {"scenario": "s", "loads": {"light": {"rate_rps": 8.0, "errors": compare(live, sim)}}}
    [row] = rows_of(report)
    assert row[:3] == ["s", "light", "8.00"]
    assert row[3] == "**100.0/100.0 (+0.0)**" and row[4] == "59.0/49.0 (-17%)" and row[8] == "**184/174 (-5%)**"
    assert row[-1] == "TTFT p50"
    text = (ROOT / "benchmarks" / "index" / "fidelity.json").read_text()
    assert dump_area(json.loads(text)) == text


def test_the_simulated_layout_plans_with_the_engines_own_kv_and_model_regions(tmp_path: Path) -> None:
    """The live scheduler plans each instance's weights and KV with the regions its engine reports (plan_kv); the
    simulated one must get the same regions, not size them by the fleet's load figures: on one H100 (a prefill and
    a decode instance) the eight fleet's engines hold every model, so near the knee no model's weights are copied
    onto an instance twice - sized by load (as before), the decode instance kept 0-3 models and copied again and
    again (201 copies where the live pool made none, H100 eight-poisson knee)."""
    import io

    from modelpool.deploy import fleet_deployment
    from modelpool.validate import recorded_instance, sim_layout
    from scheduler.instance import ModelSlots

    path = build_fleet(FLEETS["eight"], tmp_path / "eight", "h100", tiny=False)
    dep = fleet_deployment(path, "torch", 1, None, "token-level", None)
    layout = sim_layout(path, 1, None)
    kv = dep.engine.options["kv_bytes"]
    assert [(s.instance_id, s.role) for s in layout.instances] == [(s.instance_id, s.role) for s in dep.instances]
    host = dep.engine.options["max_host_kv_bytes"]  # the engines' host KV bound, as the live plan has it (plan_kv)
    for spec in layout.instances:
        assert spec.kv_bytes == kv and spec.weight_bytes == spec.memory_bytes - kv and spec.host_kv_bytes == host
        row = [spec.instance_id, spec.tp, spec.memory_bytes, spec.role, spec.kv_bytes, spec.weight_bytes,
               spec.host_kv_bytes]
        assert recorded_instance(row) == spec  # a report's layout simulates again as it was
    assert recorded_instance(row[:6]).host_kv_bytes is None  # reports before the host bound was recorded
    assert recorded_instance(row[:4]).kv_bytes is None  # reports before the regions were recorded

    def copies(instances: list) -> int:
        """The simulator's weight copies, checked against its plans replayed through the instance model's rule."""
        log = io.StringIO()
        result = simulate(layout.fleet, SCENARIOS["eight-poisson"].workload(21.0, 10.0, seed=0), "token-level",
                          instances=instances, gpu_of=layout.gpu_of, costs=layout.costs, plan_log=log)
        slots: dict[str, ModelSlots] = {}
        count = 0
        seen: set[tuple[str, str]] = set()
        for line in log.getvalue().splitlines():
            plan = json.loads(line)
            for iid, actions in plan["actions"].items():
                held = slots.setdefault(iid, ModelSlots())
                for a in actions:
                    copied = False
                    if a["op"] == "Switch":
                        copied = held.switch(a["model"], plan["at"], a.get("evict", True), a.get("keep"))[0]
                    elif a["op"] == "Prefetch":
                        copied = held.prefetch(a["model"], plan["at"], a.get("keep"))
                    if copied:
                        count += 1
                        seen.add((iid, a["model"]))
        assert result.metrics["num_weight_copies"] == count
        assert result.metrics["num_weight_recopies"] == count - len(seen)  # past each instance's first of a model
        return count

    assert copies(layout.instances) <= 2 * len(FLEETS["eight"].names)  # each model onto each instance once at most
    by_load = [dataclasses.replace(s, kv_bytes=None, weight_bytes=None) for s in layout.instances]
    assert copies(by_load) > 4 * len(FLEETS["eight"].names)  # the old layout: copied over and over


@pytest.mark.parametrize("rate", [10.0, 12.0])
def test_the_simulated_h100_pool_with_its_host_kv_bound_ends_every_request_at_the_mixed_onoff_knee(
        tmp_path: Path, rate: float) -> None:
    """The simulated layout carries the engines' host KV bound (16 GB on the H100 fleets), so its decode instance
    takes hand-offs only while its tiers hold them (kv_tiers) and the rest wait on the prefill instance, holding
    back its prompts there. Each hand-off that leaves for the decode instance must let those prompts go: when
    that was not news to the prefill instance, 49 of 185 requests (10 req/s, seed 1) and 135 of 261 (12 req/s)
    never ended."""
    path = build_fleet(FLEETS["mixed"], tmp_path / "mixed", "h100", tiny=False)
    layout = sim_layout(path, 1, None)
    assert {s.role: s.host_kv_bytes for s in layout.instances} == {"prefill": 16e9, "decode": 16e9}
    workload = dataclasses.replace(SCENARIOS["mixed-onoff"], max_output_tokens=512).workload(rate, 15.0, seed=1)
    result = simulate(layout.fleet, workload, "token-level", instances=layout.instances, gpu_of=layout.gpu_of,
                      costs=layout.costs)
    assert len(result.records) == len(workload)
    assert [rid for rid, r in result.records.items() if r.failed or r.finished_at is None] == []


def test_a_model_switch_is_a_plan_that_changes_the_models_an_instance_computes_with() -> None:
    """One rule (scheduler.instance.resident_after) on both sides: a joint decode turn planned step by step orders
    two Switch actions a step and changes nothing; a switch to another model, or a model joining, is one."""
    from pool.service import LivePool
    from scheduler import Decode, Plan, Switch
    from scheduler.instance import resident_after

    joint = (Switch("a", "due first"), Switch("b", "joint turn", evict=False), Decode(("r1", "r2"), 1, "joint"))
    both = frozenset({"a", "b"})
    assert resident_after(frozenset(), joint) == both and resident_after(both, joint) == both
    assert resident_after(both, (Switch("c", "head group"),)) == {"c"}
    assert resident_after(frozenset({"a"}), (Switch("b", "co-locate", evict=False),)) == both
    # the live pool's tally: three plans of the joint turn, then a switch to c: 2 model switches, 7 Switch actions
    from collections import Counter, deque

    pool = LivePool.__new__(LivePool)  # its tally alone (no engines), on the state its __init__ gives it
    pool.num_switches, pool.num_kv_moves, pool.recent_switches = Counter(), Counter(), deque()
    pool.num_model_switches, pool._resident = 0, {}
    for actions in (joint, joint, joint, (Switch("c", "head group"),)):
        pool._tally(Plan(0.0, {"slot0": actions}))
    assert pool.num_model_switches == 2 and sum(pool.num_switches.values()) == 7


def test_a_recorded_runs_shared_weights_come_from_its_layout_or_its_engines_status() -> None:
    from modelpool.validate import recorded_shared_weights

    def report(buffer: float, kv: float, device: str = "cuda:0", **layout) -> dict:
        engine = {"device": device, "device_buffer_bytes": buffer, "kv_device_bytes": kv}
        return {"layout": {"instances": [], "gpu_of": {}, **layout},
                "loads": {"light": {"live_status": [{"instances": {"p": {"engine": engine}, "d": {"engine": engine}}}]}}}

    assert recorded_shared_weights(report(24e9, 24e9 - 1e6))  # the buffer is the KV region alone
    assert not recorded_shared_weights(report(42e9, 24e9))  # two model slots beside the KV
    assert not recorded_shared_weights(report(1e9, 1e9, device="cpu"))
    assert recorded_shared_weights(report(42e9, 24e9, shared_weights=True))  # as the layout says, when it does
