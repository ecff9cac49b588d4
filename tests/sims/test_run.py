"""`modelpool simulate` end to end: the shipped fleet under every policy, and its CLI."""

from __future__ import annotations

import json
import pathlib

import pytest
from typer.testing import CliRunner

from modelpool.cli import app
from modelpool.config import load_fleet
from sims.run import fleet_workload_spec, simulate
from sims.traces import load_workload

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fleet():
    return load_fleet(ROOT / "models.yaml")


@pytest.mark.parametrize("policy,gpus", [("dedicated", 64), ("request-level", 32), ("spatial", 32), ("token-level", 32)])
def test_every_policy_serves_the_shipped_fleet(fleet, policy: str, gpus: int) -> None:
    workload = load_workload(fleet_workload_spec(fleet, 120), [m.name for m in fleet.models], seed=1)
    result = simulate(fleet, workload, policy, num_gpus=gpus)
    m = result.metrics
    assert m["completed"] + m["failed"] == len(workload) and m["failed"] == 0
    assert result.num_gpus <= gpus
    assert 0 < m["p50_ttft_ms"] <= m["p99_ttft_ms"] and 0 < m["p50_tpot_ms"]
    assert 0.0 <= m["aegaeon_slo_attainment"] <= 1.0 and 0.0 <= m["slo_attainment"] <= 1.0
    assert m["output_throughput"] > m["per_user_output_tokens_per_s"]  # the pool's rate vs one stream's
    assert 0 < m["gpu_busy_share"] <= 1.0
    if policy == "dedicated":
        assert m["num_switches"] == len(result.instances)  # each instance loads its model once
    if policy == "spatial":
        assert m["kv_bytes_moved"] == 0
    # each instance's time as the simulator spent it (gpu_pool_sim.py lays it beside a live run's engine calls)
    per = result.per_instance
    assert sum(f["decode_steps"] for f in per.values()) == result.num_decode_steps > 0
    assert sum(f["num_switches"] for f in per.values()) == m["num_switches"]
    assert all(0 <= f["decode_s"] and f["switch_s"] <= f["busy_s"] + 1e-9 for f in per.values())
    assert any(f["decode_s"] > 0 for f in per.values()) and any(f["prefill_s"] > 0 for f in per.values())
    # busy is its actions' time: decode turns, switches, prefills, KV moves (each as the live engine's calls)
    for f in per.values():
        assert f["decode_s"] + f["switch_s"] + f["prefill_s"] + f["kv_s"] == pytest.approx(f["busy_s"], rel=1e-6, abs=1e-9)
    if policy == "token-level":
        assert any(f["kv_s"] > 0 for f in per.values())  # preemption moves KV


def test_the_scheduler_plans_with_plan_costs_and_the_steps_cost_costs(fleet) -> None:
    """simulate(plan_costs=...): a live pool served with one profile and replayed with one fitted since plans as
    it did (turn quotas, group sizes from plan_costs) while its steps take what `costs` says. Planning with a
    decode step 10x dearer changes the Plans; the step times still come from `costs`."""
    import io

    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile

    workload = load_workload(fleet_workload_spec(fleet, 60), [m.name for m in fleet.models], seed=3)
    base = load_profile("h200-cudagraph")
    costs = RooflineCostModel(fleet, profile=base)
    dear = RooflineCostModel(fleet, profile=base.model_copy(update={"terms": base.terms.model_copy(
        update={"decode_fixed_s": 10 * base.terms.decode_fixed_s})}))
    logs = {}
    for name, planner in (("same", costs), ("none", None), ("dear", dear)):
        log = io.StringIO()
        result = simulate(fleet, workload, "token-level", num_gpus=32, costs=costs, plan_log=log, plan_costs=planner)
        logs[name] = (log.getvalue(), result)
    assert logs["same"][0] == logs["none"][0]  # plan_costs defaults to costs
    assert logs["dear"][0] != logs["same"][0]
    steps = {name: r.num_decode_steps for name, (_, r) in logs.items()}
    seconds = {name: sum(f["decode_s"] for f in r.per_instance.values()) for name, (_, r) in logs.items()}
    # what a step costs is `costs`' in both: the mean step stays within a few percent (batches differ a little)
    assert seconds["dear"] / steps["dear"] == pytest.approx(seconds["same"] / steps["same"], rel=0.25)
    assert seconds["dear"] / steps["dear"] < 10 * base.terms.decode_fixed_s  # not charged at the planner's rate


def test_dedicated_needs_one_instance_per_model(fleet) -> None:
    workload = load_workload(fleet_workload_spec(fleet, 10), [m.name for m in fleet.models], seed=1)
    with pytest.raises(ValueError, match="one instance per model"):
        simulate(fleet, workload, "dedicated", num_gpus=16)


def test_simulate_cli_writes_metrics_and_requests(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["simulate", "--fleet", str(ROOT / "models.yaml"), "--duration", "30",
                                   "--gpus", "24", "--out", str(out), "--plan-log", str(tmp_path / "plans.jsonl")])
    assert res.exit_code == 0, res.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["policy"] == "token-level" and metrics["num_gpus"] <= 24
    assert metrics["compiled"] is False  # the tests run the source tree
    assert {"mean_ttft_ms", "p99_tpot_ms", "request_goodput", "output_throughput"} <= set(metrics)
    lines = (out / "requests.csv").read_text().splitlines()
    assert len(lines) == metrics["num_requests"] + 1
    assert all(json.loads(line)["actions"] or json.loads(line)["failed"]
               for line in (tmp_path / "plans.jsonl").read_text().splitlines())


def test_simulate_cli_names_a_bad_trace(tmp_path: pathlib.Path) -> None:
    res = CliRunner().invoke(app, ["simulate", "--fleet", str(ROOT / "models.yaml"), "--trace", "nosuch"])
    assert res.exit_code == 1 and "unknown trace 'nosuch'" in res.output


def test_simulate_cli_passes_policy_options(tmp_path: pathlib.Path) -> None:
    """-o KEY=VALUE reaches the policy: on a pool too small to keep every model resident, token-level's quota
    formula alone (min_turn_tpot=0) schedules other turns than the default floor on the same trace (where every
    model stays resident, turns cost nothing and the option changes nothing), and metrics.json records it."""
    runs = {}
    for name, extra in (("floor", []), ("formula", ["--policy-option", "min_turn_tpot=0"])):
        res = CliRunner().invoke(app, ["simulate", "--fleet", str(ROOT / "models.yaml"), "--duration", "60",
                                       "--gpus", "16", "--out", str(tmp_path / name), *extra])
        assert res.exit_code == 0, res.output
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert runs["floor"]["policy_options"] == {} and runs["formula"]["policy_options"] == {"min_turn_tpot": 0}
    assert ((runs["formula"]["num_switches"], runs["formula"]["p99_tpot_ms"])
            != (runs["floor"]["num_switches"], runs["floor"]["p99_tpot_ms"]))
    assert runs["formula"]["num_requests"] == runs["floor"]["num_requests"]


@pytest.mark.parametrize("option, message", [
    ("nosuch=1", "--policy-option nosuch: token-level takes max_group_size,"),
    ("max_batch_size=3", "--policy-option max_batch_size: set from the fleet file's pool section"),
    ("min_turn_tpot", "--policy-option 'min_turn_tpot': expected KEY=VALUE"),
    ("min_turn_tpot=-1", "min_turn_tpot must be >= 0"),
])
def test_simulate_cli_names_a_bad_policy_option(option: str, message: str) -> None:
    res = CliRunner().invoke(app, ["simulate", "--fleet", str(ROOT / "models.yaml"), "--duration", "10", "--policy-option", option])
    assert res.exit_code == 1 and message in res.output, res.output


def test_simulate_cli_takes_a_path_as_its_trace(tmp_path: pathlib.Path) -> None:
    trace = tmp_path / "my_trace.csv"
    trace.write_text("timestamp_s,model,input_tokens,output_tokens\n0.0,qwen2.5-7b-chat,512,64\n"
                     "1.5,llama-3.2-3b-chat,256,32\n3.0,qwen2.5-7b-chat,1024,16\n")
    res = CliRunner().invoke(app, ["simulate", "--fleet", str(ROOT / "models.yaml"), "--trace", str(trace)])
    assert res.exit_code == 0, res.output
    assert "completed / failed" in res.output and "3 requests" in res.output


def test_simulate_cli_sizes_dedicated_to_one_instance_per_model() -> None:
    res = CliRunner().invoke(app, ["simulate", "--fleet", str(ROOT / "models.yaml"), "--policy", "dedicated",
                                   "--duration", "20"])
    assert res.exit_code == 0, res.output
    assert "dedicated needs 57 GPUs for one instance per model; the fleet's pool.num_gpus is 16: simulating 57" \
        in " ".join(res.output.split())
    assert "dedicated on 57 GPUs" in res.output
    small = CliRunner().invoke(app, ["simulate", "--fleet", str(ROOT / "models.yaml"), "--policy", "dedicated",
                                     "--gpus", "40", "--duration", "20"])
    assert small.exit_code == 1 and "40 GPUs cannot hold one instance per model (need 57)" in small.output
