"""benchmarks/gpu_pool.py end to end on CPU (tiny shapes): modelpool serve with the default layout on the
processes backend, a Poisson trace through the gateway, the standalone prefill timing and the simulator on
the same trace - what the H200 run does, small enough for CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # a short live H200 run (its trace and summary) and a profile


@pytest.mark.slow
def test_tiny_harness_serves_every_request_with_no_capture_on_the_request_path(tmp_path) -> None:
    out = tmp_path / "gp"
    done = subprocess.run([sys.executable, "benchmarks/gpu_pool.py", "--tiny", "--out", str(out), "--rate", "3",
                           "--rate", "3", "--duration", "6", "--backend", "processes",
                           "--serve-arg=--async-decode"],  # as on CUDA, where it is the default
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run = json.loads((out / "run-processes-pd-r3.json").read_text())
    aggregate = run["aggregate"]
    assert aggregate["requests"] > 5 and aggregate["failed"] == 0 and aggregate["served"] == aggregate["requests"]
    served = [r for r in run["requests"] if r["served"]]
    assert all(r["chunks"] == r["tokens"] for r in served), "one streamed chunk per token"
    assert all(r["ttft_s"] > 0 and r["tokens"] >= 1 for r in served)
    assert sum(run["graph_captures_after_warmup"].values()) == 0
    assert run["cpu_cores"]["process"] > 0 and sum(k.startswith("child ") for k in run["cpu_cores"]) >= 2  # engines
    assert set(run["decode_timings"]) == {"slot0", "slot1"}  # two instances (on CPU both mixed: see below)
    # On CPU the default layout is two *mixed* instances (a prefill and a decode instance is the GPU's), and
    # dispatch puts each prompt where its prefill is predicted to end first (ties to slot0, then to where its
    # model is held): on a loaded box slot0 can take every request, warm-up's included, and slot1 decode none.
    # So no instance is "the decoder" by name: the ones that decoded are those with decode steps in this run.
    decoders = sorted(iid for iid, by_method in run["call_s_by_engine"].items() if "decode_step" in by_method)
    assert decoders, "some instance decoded the run's requests"
    # every request got >= 8 tokens (greedy, ignore_eos: --tiny's outputs are 8-32): its first decode step left
    # >= 2 to go, so with async decode on, every instance that decoded in this run queued steps ahead of the host
    assert all(r["tokens"] >= 3 for r in served)
    assert all(run["decode_steps_ahead"][iid] > 0 for iid in decoders), (run["decode_steps_ahead"], decoders)
    assert run["prefill_vs_standalone"]["samples"] > 0
    assert run["fidelity"]["ttft_s"]["pairs"] == len(served)  # the simulator ran the same trace
    assert all(r["sim_ttft_s"] > 0 for r in served)  # side by side, per request
    sim = run["sim_aggregate"]
    assert 0 < sim["ttft_s"]["p50"] <= sim["ttft_s"]["p99"] and 0 < sim["tpot_s"]["p50"] <= sim["tpot_s"]["p99"]
    trace = (out / run["trace"]).read_text().splitlines()
    assert trace[0] == "timestamp_s,model,input_tokens,output_tokens" and len(trace) == aggregate["requests"] + 1
    # each instance's engine calls, timed on one clock, written when its process stopped
    calls = {p.stem: json.loads(p.read_text()) for p in (out / "serve-processes-pd.calls").glob("calls-*.json")}
    assert set(calls) == {"calls-slot0", "calls-slot1"}
    assert "prefill" in {m for m, _, _ in calls["calls-slot0"]}
    for iid in decoders:
        decodes = [(t, d) for m, t, d in calls[f"calls-{iid}"] if m == "decode_step"]
        assert len(decodes) >= run["call_timings"][iid]["decode_step"]["calls"] > 0
        assert all(d > 0 for _, d in decodes) and all(b[0] >= a[0] + a[1] for a, b in zip(decodes, decodes[1:]))
    # the requests' times on the calls' clock: each first token after a prefill call (of either instance) that
    # began after it was sent
    t0 = run["replay_t0_monotonic"]
    prefills = [(t, t + d) for log in calls.values() for m, t, d in log if m == "prefill"]
    for r in served:
        sent, first = t0 + r["sent_s"], t0 + r["first_s"]
        assert sent < first and any(sent <= begin and end <= first for begin, end in prefills), r["index"]
    from benchmarks.gpu_pool_calls import load, ttft_parts

    parts = ttft_parts(load(out / "serve-processes-pd.calls"), run)  # every request's TTFT split in three
    assert parts["requests"] == len(served)
    assert all(parts[name]["n"] == len(served) and parts[name]["p50_ms"] >= 0
               for name in ("to_prefill", "prefill", "delivery"))
    assert run["ttft_parts"] == parts  # the harness saved it in the run JSON (calibrate --request-path reads it)
    plans = run["plan_summary"]  # this run's Plans (its lines of the plan log), action by action
    assert sum(p.get("Prefill", {}).get("actions", 0) for p in plans.values()) >= 1
    assert all(plans[iid]["Decode"]["max_steps_mean"] >= 1 for iid in decoders)
    assert sum(p.get("Switch", {}).get("actions", 0) for p in plans.values()) == run["switches_planned"]
    for iid in decoders:  # this run's share of the engine's calls
        mine = run["call_s_by_engine"][iid]["decode_step"]
        assert 0 < mine["calls"] <= run["call_timings"][iid]["decode_step"]["calls"] and mine["s"] > 0
    # a rate given twice replays its trace again, on the same server, saved as its own run
    again = json.loads((out / "run-processes-pd-r3-2.json").read_text())
    assert (out / again["trace"]).read_text() == (out / run["trace"]).read_text()
    assert again["plans_range"][0] >= run["plans_range"][1] and again["aggregate"]["requests"] == aggregate["requests"]
    # and each instance's KV calls, a row each (this tiny load hands nothing off: test_graph_bookkeeping has rows)
    kv = {p.stem: json.loads(p.read_text()) for p in (out / "serve-processes-pd.calls").glob("kv-*.json")}
    assert set(kv) == {"kv-slot0", "kv-slot1"} and all(len(row) == 7 for rows in kv.values() for row in rows)


def test_simulator_side_of_the_two_gpu_prefill_decode_layout(tmp_path) -> None:
    """--gpus 2 (issue 21): the fleet says two GPUs and the simulator puts the prefill instance on one and the
    decode instance on the other, as serve does on a two-GPU box (the live side needs the GPUs)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchmarks.gpu_pool_sim import simulate_live_layout
    from gpu_pool import TINY_FLEET, build_models, make_trace, write_trace

    fleet = build_models(tmp_path, TINY_FLEET, "cpu", num_gpus=2)
    assert "num_gpus: 2" in fleet.read_text()
    write_trace(make_trace([name for name, _ in TINY_FLEET], 2.0, 5.0, (20, 60), (4, 8), 1), tmp_path / "t.csv")
    one = simulate_live_layout(fleet, tmp_path / "t.csv", cpu=False, num_gpus=1)
    two = simulate_live_layout(fleet, tmp_path / "t.csv", cpu=False, num_gpus=2)
    assert one["gpu_of"] == {"slot0": 0, "slot1": 0} and two["gpu_of"] == {"slot0": 0, "slot1": 1}
    from benchmarks.gpu_pool_sim import time_budget

    live = {"call_s_by_engine": {"slot1": {"decode_step": {"calls": 40, "s": 0.2}, "import_kv": {"calls": 3, "s": 0.03}}}}
    budget = time_budget(live, one)  # each instance's time side by side; no calls recorded for slot0: None
    assert budget["slot0"]["live"] is None and budget["slot1"]["live"] == {
        "decode_steps": 40, "decode_s": 0.2, "other_calls_s": {"import_kv": 0.03}}
    assert budget["slot0"]["sim"]["decode_steps"] > 0 and budget["slot0"]["sim"]["decode_s"] > 0  # the first tokens
    assert set(budget) == {"slot0", "slot1"}  # every instance of the layout, those given no work too
    assert len(two["requests"]) == len(one["requests"]) > 3
    assert one["plan_summary"]["slot0"]["Prefill"]["requests_mean"] >= 1  # the simulator's Plans, as the live ones
    for result in (one, two):  # the aggregate over the simulated requests, as the live side reports its own
        ttft, tpot = result["aggregate"]["ttft_s"], result["aggregate"]["tpot_s"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] and 0 < tpot["p50"] <= tpot["p99"]
        assert ttft["p99"] == pytest.approx(float(np.percentile([r["ttft_s"] for r in result["requests"].values()], 99)),
                                            abs=1e-5)


def test_call_logs_say_what_delayed_each_decode_step(tmp_path) -> None:
    """benchmarks/gpu_pool_calls.py on hand-made logs: a decode step after a Prefetch is told apart from one after
    a step, and one overlapping another instance's prefill from one alone."""
    from benchmarks.gpu_pool_calls import load, summarize

    folder = tmp_path / "serve-processes-pd.calls"
    folder.mkdir()
    decode = [["decode_step", 10.0, 0.005], ["prefetch", 10.01, 0.0002], ["decode_step", 10.02, 0.3],
              ["decode_step", 10.33, 0.005], ["import_kv", 10.34, 0.004], ["restore_kv", 10.345, 0.0001],
              ["decode_step", 10.35, 0.006]]
    prefill = [["prefill", 10.1, 0.1], ["export_kv", 10.2, 0.003]]
    (folder / "calls-slot1.json").write_text(json.dumps(decode))
    (folder / "calls-slot0.json").write_text(json.dumps(prefill))
    steps = summarize(load(folder), 5.0)["instances"]["slot1"]
    assert steps["decode_steps"]["after prefetch"] == {"n": 1, "mean_ms": 300.0, "p50_ms": 300.0, "max_ms": 300.0,
                                                       "sum_s": 0.3}
    assert steps["decode_steps"]["after a decode step"]["n"] == 1 and steps["decode_steps"]["after a swap-in"]["n"] == 1
    assert steps["decode_steps"]["after -"]["n"] == 1  # the first one
    assert steps["decode_steps_by_overlap"]["beside a prefill"]["n"] == 1  # the 0.3 s one spans 10.1-10.2
    assert steps["decode_steps_by_overlap"]["alone"]["n"] == 3
    assert steps["seconds_by_method"]["decode_step"] == pytest.approx(0.316)
    # two steps back to back: the one ending at 10.32 and the one starting at 10.33 (the window starts at 5.356)
    assert steps["gaps_between_decode_steps"]["n"] == 1
    assert steps["longest_gaps_between_decode_steps"] == [{"ms": pytest.approx(10.0), "at_s": pytest.approx(4.974)}]


def test_ttft_parts_split_each_requests_first_token_and_time_the_admission_of_those_sent_to_an_idle_instance(
        tmp_path) -> None:
    """benchmarks/gpu_pool_calls.py's TTFT split on hand-made logs: sent -> prefill call, the call, -> first token;
    the admission (sent -> the instance's next call) only of requests an idle instance went straight to."""
    from benchmarks.gpu_pool_calls import load, ttft_parts

    folder = tmp_path / "calls"
    folder.mkdir()
    # r0 at 100.000 to an idle slot0: a switch 4 ms later, its prefill; r1 at 100.100 while slot0 prefills r0's
    # successor r2 (sent 100.090, straight to its prefill 3 ms later); stats polls do not count as work
    (folder / "calls-slot0.json").write_text(json.dumps([
        ["stats", 100.001, 0.001], ["activate", 100.004, 0.050], ["prefill", 100.055, 0.020],
        ["prefill", 100.093, 0.030], ["prefill", 100.124, 0.020]]))
    (folder / "calls-slot1.json").write_text(json.dumps([["decode_step", 100.2, 0.003]]))
    run = {"replay_t0_monotonic": 100.0, "requests": [
        {"served": True, "sent_s": 0.0, "first_s": 0.0765},     # after the 100.055 prefill (ends 100.075)
        {"served": True, "sent_s": 0.1, "first_s": 0.1455},     # after the 100.124 prefill (ends 100.144)
        {"served": True, "sent_s": 0.09, "first_s": 0.1245},    # after the 100.093 prefill (ends 100.123)
        {"served": False, "sent_s": 0.2}]}
    parts = ttft_parts(load(folder), run)
    assert parts["requests"] == 3
    assert parts["to_prefill"]["n"] == 3 and parts["prefill"]["p50_ms"] == pytest.approx(20.0)
    assert parts["delivery"]["p50_ms"] == pytest.approx(1.5)
    admission = parts["admission (sent while idle)"]  # r0 (4 ms, through its switch) and r2 (3 ms); r1 queued
    assert admission["n"] == 2 and admission["mean_ms"] == pytest.approx(3.5)
    assert parts["to_prefill (sent while idle)"]["n"] == 2


def test_gpu_pool_sim_sets_a_recorded_run_beside_the_simulator_on_its_trace(tmp_path) -> None:
    """benchmarks/gpu_pool_sim.py on a live H200 run (tests/data: its trace, and the run less its token gaps and
    call logs) with the shipped profile: every request paired, the live side's figures as the run has them, the
    simulator's by-model figures adding up to its totals. No recorded ratio is pinned: the fidelity figures are
    GPU results (BENCHMARKS.md), re-measured when the simulator or cost model changes, not asserted here."""
    run = DATA / "h200-pool-s18-processes-pd-r1.json"
    out = tmp_path / "fidelity.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_pool_sim.py"), str(run),
                    "--profile", str(ROOT / "sims" / "profiles" / "h200-cudagraph.json"), "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    live = json.loads(run.read_text())
    got = json.loads(out.read_text())[run.name]
    served = [r for r in live["requests"] if r["served"]]
    assert got["ttft_s"]["pairs"] == len(served) > 0 and got["tpot_s"]["pairs"] == sum(bool(r["tpot_s"]) for r in served)
    assert got["switches"][0] == live["switches_planned"] and got["plans"]["live"] == live["plan_summary"]
    assert got["attainment"][0] == live["aggregate"]["slo_attainment"]
    sim_switches = sum(m["n"] for i in got["switch_times"]["sim"].values() for m in i.values())
    assert got["switches"][1] == sim_switches == sum(p.get("Switch", {}).get("actions", 0)
                                                       for p in got["plans"]["sim"].values())
    for iid, rounds in got["prefill_rounds"]["sim"].items():
        assert sum(r["rounds"] for r in rounds.values()) == got["plans"]["sim"][iid]["Prefill"]["actions"]
    for iid, budget in got["time_budget"].items():
        steps = got["decode_by_model"]["sim"].get(iid, {})
        assert sum(b["steps"] for m in steps.values() for b in m.values()) == budget["sim"]["decode_steps"]


def test_cpu_sampling_finds_a_busy_child_process() -> None:
    """The harness's per-process CPU use (from /proc): a child spinning for a second shows as one busy core below
    this process, an idle parent near none."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("no /proc here")
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_pool import cpu_seconds, cpu_use

    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)
        before, started = cpu_seconds(os.getpid()), time.monotonic()
        time.sleep(1.5)
        use = cpu_use(before, cpu_seconds(os.getpid()), time.monotonic() - started)
    finally:
        child.kill()
        child.wait()
    assert use[f"child {child.pid}"] > 0.5 and use["process"] < 0.5


def test_prefill_ratios_take_each_shape_against_the_engine_alone() -> None:
    """Live prefill seconds over the standalone engine's at the same (model, tokens, batch): its first run and its
    repeats; the fresh-shape extra is the median of each shape's first run less its repeats."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_pool import prefill_ratios

    alone = {"a|100|1": (0.030, 0.020), "a|200|1": (0.040, 0.039), "b|100|2": (0.012, 0.010)}
    live = [["a", 100, 1, 0.030], ["a", 200, 1, 0.078], ["b", 100, 2, 0.010], ["c", 5, 1, 1.0]]  # c: never alone
    got = prefill_ratios(live, alone)
    assert got["samples"] == 3
    assert got["ratio_p50"] == pytest.approx(1.0) and got["ratio_vs_best_p50"] == pytest.approx(1.5)
    assert got["standalone_fresh_extra_ms_p50"] == pytest.approx(2.0)  # of 10, 1 and 2 ms
    assert prefill_ratios([["c", 5, 1, 1.0]], alone) == {"samples": 0}


def test_plan_summary_counts_each_instances_actions_from_plan_log_lines() -> None:
    """benchmarks/gpu_pool_calls.plan_summary on Plans written as the live pool and the simulator write them."""
    from benchmarks.gpu_pool_calls import plan_summary
    from scheduler import Decode, Plan, Prefill, Switch

    plans = [Plan(1.0, {"slot0": (Switch("m1", "head group"), Prefill(("a", "b", "c"), "group")),
                        "slot1": (Decode(("x", "y"), 8, "turn"),)}),
             Plan(2.0, {"slot0": (Prefill(("d",), "group"),), "slot1": (Decode(("x",), 4, "turn"),)})]
    summary = plan_summary([p.to_json() for p in plans])
    assert summary == {"slot0": {"Prefill": {"actions": 2, "requests_mean": 2.0}, "Switch": {"actions": 1, "requests_mean": 0.0}},
                       "slot1": {"Decode": {"actions": 2, "requests_mean": 1.5, "max_steps_mean": 6.0}}}


def test_call_gaps_are_the_host_between_two_calls_in_the_replay_by_method_pair() -> None:
    """gpu_pool_calls.call_gaps: from one call's end to the next's start, per pair of methods, over the calls
    that began during the run's replay; stats() polls are not calls of the work."""
    from benchmarks.gpu_pool_calls import call_gaps

    logs = {"slot0": [["activate", 9.0, 0.5],  # before the replay
                      ["activate", 10.0, 0.1], ["stats", 10.101, 0.001], ["prefill", 10.104, 0.05],
                      ["decode_step", 10.156, 0.004], ["export_kv", 10.161, 0.01], ["activate", 10.2, 0.1],
                      ["prefill", 10.302, 0.05], ["prefill", 13.0, 0.05]]}  # after it
    gaps = call_gaps(logs, {"replay_t0_monotonic": 10.0, "replay_s": 2.0})["slot0"]
    assert gaps["activate -> prefill"]["n"] == 2 and gaps["activate -> prefill"]["mean_ms"] == pytest.approx(3.0)
    assert gaps["prefill -> decode_step"]["p50_ms"] == pytest.approx(2.0)
    assert gaps["export_kv -> activate"]["max_ms"] == pytest.approx(29.0)
    assert not any("stats" in pair for pair in gaps)
    assert list(gaps)[0] == "export_kv -> activate"  # the largest sum first


def test_prefill_rounds_split_each_instances_group_prefills_by_model() -> None:
    """benchmarks/gpu_pool_calls.prefill_rounds: a Prefill's model is its instance's latest Switch; a round holds
    its instance until that instance's next Plan (another instance's Plans in between do not end it); the last
    round, with no Plan after it, has no held time."""
    from benchmarks.gpu_pool_calls import prefill_rounds
    from scheduler import Decode, Plan, Prefill, Switch

    plans = [Plan(1.0, {"slot0": (Switch("m1", "head group"), Prefill(("a", "b", "c"), "group"))}),
             Plan(1.05, {"slot1": (Decode(("x",), 4, "turn"),)}),
             Plan(1.1, {"slot0": (Prefill(("d",), "group"),)}),  # m1 again, no switch
             Plan(1.4, {"slot0": (Switch("m2", "head group"), Prefill(("e", "f"), "group"))}),
             Plan(1.9, {"slot0": (Decode(("e", "f"), 7, "first tokens"),)}),
             Plan(2.0, {"slot0": (Switch("m1", "head group"), Prefill(("g",), "group"))})]
    rounds = prefill_rounds([p.to_json() for p in plans])
    assert set(rounds) == {"slot0"}  # slot1 prefilled nothing
    assert rounds["slot0"]["m1"] == {"rounds": 3, "prompts_mean": pytest.approx(5 / 3, abs=1e-3),
                                     "switched_share": pytest.approx(2 / 3, abs=1e-3),
                                     "held_ms_mean": pytest.approx(200.0)}  # 100 and 300 ms; the last has none
    assert rounds["slot0"]["m2"] == {"rounds": 1, "prompts_mean": 2.0, "switched_share": 1.0,
                                     "held_ms_mean": pytest.approx(500.0)}
    # a run's window (gpu_pool.py: its plans_range): the Switch before it still names the model of its first round
    window = prefill_rounds([p.to_json() for p in plans], first=2)
    assert window["slot0"]["m1"]["rounds"] == 2 and window["slot0"]["m1"]["switched_share"] == 0.5
    assert "?" not in window["slot0"]


def test_switch_times_match_each_switch_to_its_activate_call_by_model() -> None:
    """benchmarks/gpu_pool_calls.switch_times: the n-th Switch of an instance in the plan log ran as its n-th
    activate call; only the window's are kept; an instance whose counts differ (a restart) is left out. The
    simulator's side (SimResult.switches_by_model) adds up to its switch seconds per instance."""
    from benchmarks.gpu_pool_calls import switch_summary, switch_times
    from scheduler import Plan, Prefetch, Prefill, Switch

    plans = [Plan(1.0, {"slot0": (Switch("m1", "head"), Prefetch("m2", "next"), Prefill(("a",), "group")),
                        "slot1": (Switch("m2", "turn"),)}),
             Plan(1.5, {"slot0": (Switch("m2", "head"), Prefill(("b",), "group"))}),
             Plan(2.0, {"slot0": (Switch("m1", "head"), Prefill(("c",), "group")), "slot1": (Switch("m1", "turn"),)})]
    logs = {"slot0": [("activate", 1.0, 0.3), ("prefetch", 1.3, 0.001), ("prefill", 1.31, 0.05),
                      ("activate", 1.5, 0.02), ("prefill", 1.52, 0.05), ("activate", 2.0, 0.004)],
            "slot1": [("activate", 1.0, 0.2)]}  # one activate for two Switches: left out
    lines = [p.to_json() for p in plans]
    assert switch_times(lines, logs) == {"slot0": {"m1": [0.3, 0.004], "m2": [0.02]}}
    assert switch_times(lines, logs, first=1, end=3) == {"slot0": {"m1": [0.004], "m2": [0.02]}}
    assert switch_summary({"m1": [0.3, 0.004], "m2": []}) == {"m1": {"n": 2, "mean_ms": 152.0, "p90_ms": 4.0}}


def test_the_simulators_switches_and_decode_steps_by_model_add_up_to_its_totals(tmp_path) -> None:
    from benchmarks.gpu_pool import FLEET, build_models
    from benchmarks.gpu_pool_sim import simulate_live_layout

    fleet = build_models(tmp_path / "models", FLEET, "h200")
    trace = DATA / "h200-pool-s18-processes-pd-r1.csv"
    sim = simulate_live_layout(fleet, trace, "default")
    for iid, per in sim["per_instance"].items():
        times = sim["switch_times"][iid]
        assert sum(m["n"] for m in times.values()) == per["num_switches"] > 0
        # each model's mean is rounded to 0.1 ms
        assert sum(m["n"] * m["mean_ms"] for m in times.values()) == pytest.approx(
            1e3 * per["switch_s"], abs=0.05 * per["num_switches"] + 1e-6)
        # its decode steps by model and batch bucket (beside the live engine's decode_timings_by_model)
        buckets = [b for m in sim["decode_by_model"][iid].values() for b in m.values()]
        assert sum(b["steps"] for b in buckets) == per["decode_steps"] > 0
        assert sum(b["steps"] * b["step_ms_mean"] for b in buckets) == pytest.approx(1e3 * per["decode_s"], rel=1e-3)
        for model in sim["decode_by_model"][iid].values():
            for name, b in model.items():
                low = {"<=1": 0, "<=4": 1, "<=8": 4, "<=16": 8, "<=32": 16, "<=64": 32, "<=256": 64}[name]
                assert low < b["batch_mean"] <= int(name.removeprefix("<="))


def test_prefill_samples_are_matched_to_their_calls_and_kv_calls_cut_to_the_run() -> None:
    """gpu_pool_calls.prefill_overlaps: a run's prefill samples found in the serve's call log by their seconds
    (the run of consecutive prefill calls that agrees), each with the share of its call the other instance's
    decode steps overlapped; run_kv_calls: the KV calls that began during the run's replay."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchmarks.gpu_pool_calls import prefill_overlaps, run_kv_calls

    logs = {"slot0": [["prefill", 10.0, 0.05], ["decode_step", 10.06, 0.004], ["prefill", 11.0, 0.1],
                      ["prefill", 12.0, 0.2], ["prefill", 13.0, 0.3]],
                      # an earlier run's 0.05 s prefill; this run's 0.1, 0.2, 0.3
            "slot1": [["decode_step", 11.0, 0.05], ["decode_step", 12.1, 0.2], ["decode_step", 14.0, 0.01]]}
    run = {"prefill_samples": {"slot0": [["m", 100, 1, 0.1002], ["m", 200, 1, 0.2], ["m", 300, 2, 0.2999]]}}
    assert prefill_overlaps(logs, run) == {"slot0": [0.5, 0.5, 0.0]}
    stale = {"prefill_samples": {"slot0": [["m", 100, 1, 0.4]]}}  # no call took 0.4 s
    assert prefill_overlaps(logs, stale) == {"slot0": [None]}
    kv = {"slot1": [["import_kv(device)", 3, 100, 9.0, 0.01, 0.0, 0.01],  # before the run
                    ["import_kv(device)", 4, 100, 11.5, 0.02, 0.001, 0.015],
                    ["restore_kv", 4, 0, 15.0, 0.001, 0.0, 0.001]]}  # after it
    assert run_kv_calls(kv, {"replay_t0_monotonic": 10.0, "replay_s": 2.5}) == {"slot1": [["import_kv(device)", 4, 0.02]]}


def test_the_noise_floor_compares_the_simulator_with_itself_perturbed(tmp_path) -> None:
    """gpu_pool_sim.noise_floor: the same trace simulated with the prefill 1% slower and faster, per request
    against the unperturbed run - the ratios no cost model beats; a 50% change moves TTFT, as it must."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchmarks.gpu_pool_sim import aggregate_band, noise_floor, simulate_live_layout
    from gpu_pool import TINY_FLEET, build_models, make_trace, write_trace

    fleet = build_models(tmp_path, TINY_FLEET, "cpu")
    write_trace(make_trace([name for name, _ in TINY_FLEET], 1.0, 6.0, (200, 400), (4, 8), 1), tmp_path / "t.csv")
    sim = simulate_live_layout(fleet, tmp_path / "t.csv", "h200-cudagraph")
    floor = noise_floor(fleet, tmp_path / "t.csv", "h200-cudagraph", sim)
    assert set(floor) == {"prefill 1% slower", "prefill 1% faster"}
    for figures in floor.values():
        assert figures["ttft_s"]["pairs"] == len(sim["requests"]) > 3
        assert 0.9 < figures["ttft_s"]["ratio_p50"] < 1.1
    big = noise_floor(fleet, tmp_path / "t.csv", "h200-cudagraph", sim, scale=0.5)
    assert big["prefill 50% slower"]["ttft_s"]["ratio_p50"] > 1.05 > 0.95 > big["prefill 50% faster"]["ttft_s"]["ratio_p50"]
    # the simulator's own band of its aggregates spans the unperturbed run and both perturbed ones
    band = aggregate_band(sim, big)
    slower, faster = (big[f"prefill 50% {w}"]["aggregate"]["ttft_s"]["p50"] for w in ("slower", "faster"))
    assert band["ttft_s"]["p50"] == [faster, slower] and faster < sim["aggregate"]["ttft_s"]["p50"] < slower
    assert band["tpot_s"]["p90"][0] <= sim["aggregate"]["tpot_s"]["p90"] <= band["tpot_s"]["p90"][1]


def test_inside_calls_reads_the_kv_gc_and_slow_call_logs_from_a_moment_on(tmp_path) -> None:
    """gpu_pool_calls.inside_calls: per instance, the slowest KV calls split before / during / after the
    compute-stream wait, the collector's pauses by generation and SlowCalls' innermost frames - from `start` on."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchmarks.gpu_pool_calls import inside_calls

    (tmp_path / "kv-slot1.json").write_text(json.dumps([
        ["import_kv(device)", 7, 100, 5.0, 0.5, 0.0, 0.1],  # before `start`: left out
        ["import_kv(device)", 7, 100, 20.0, 0.15, 0.01, 0.02], ["restore_kv", 7, 10, 21.0, 0.001, 0.0, 0.001]]))
    (tmp_path / "gc-slot1.json").write_text(json.dumps([[2, 5.0, 0.3], [0, 20.0, 0.001], [0, 21.0, 0.003], [2, 22.0, 0.02]]))
    (tmp_path / "slow-slot1.json").write_text(json.dumps([
        ["import_kv", 20.0, 45.0, ["procs.py:1 main", "kvstore.py:205 write_tokens"]],
        ["import_kv", 20.0, 55.0, ["procs.py:1 main", "kvstore.py:205 write_tokens"]],
        ["activate", 4.0, 45.0, ["streams.py:254 synchronize"]]]))
    inside = inside_calls(tmp_path, start=10.0)["slot1"]
    assert inside["slowest_kv_calls"][0] == {"method": "import_kv(device)", "requests": 7, "ms": 150.0,
                                             "before_wait_ms": 20.0, "wait_ms": 10.0, "after_wait_ms": 120.0}
    assert [c["method"] for c in inside["slowest_kv_calls"]] == ["import_kv(device)", "restore_kv"]
    assert inside["gc"] == {"gen0": {"collections": 2, "ms_sum": 4.0, "ms_max": 3.0},
                            "gen2": {"collections": 1, "ms_sum": 20.0, "ms_max": 20.0}}
    assert inside["slow_call_frames"] == {"import_kv: kvstore.py:205 write_tokens": 2}
