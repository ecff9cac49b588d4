"""`modelpool validate SCENARIO`: the simulator against the live pool on a scenario no term was fitted to.

1. builds the scenario's fleet as random-weight models of its real shapes (on a machine without a GPU: tiny
   models of the same families) and a fleet file for them (`sims.scenarios`);
2. picks the loads: the knee is the highest total rate at which the simulator, costed with the profile, still
   meets the SLO for 90% of the scenario's requests; light and knee are fractions of it (`sims.scenarios.LOADS`);
3. serves the fleet with `modelpool serve` on this machine (the layout serve gives one GPU: a prefill and a
   decode instance; on CPU two slots) and replays each load's requests through the gateway as streaming
   clients, recording every token's time;
4. simulates the very same requests on the very same layout with the profile, nothing refitted, after the
   warm-up serve runs first (one short request per model, `simulated`);
5. prints live and simulated side by side - SLO attainment, TTFT and TPOT p50/p90, switches - with the error
   of each against the targets (attainment within 3 points, the rest within 15%), and writes the comparison
   as JSON (default under ./out/validate, which git ignores).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sims.scenarios import KNEE_ATTAINMENT, LOADS, TINY_SHAPES, FleetSpec, Scenario
from sims.workload import TraceError, Workload

QUICK_DURATION_S = 8.0
QUICK_MAX_INPUT, QUICK_MAX_OUTPUT = 512, 24  # --quick clips the lengths too: a smoke run in a minute on a CPU
MAX_KNEE_RATE = 64.0  # req/s: above it the search stops (tiny models costed as a datacenter GPU never saturate)
PROMPT_VOCAB = 2000  # prompt token ids are drawn below this (every model's vocabulary is larger)


@dataclass(frozen=True, slots=True)
class Targets:
    """What the simulator must meet on every scenario (issue 34)."""

    attainment_points: float = 3.0
    latency_rel: float = 0.15
    switches_rel: float = 0.15


# ---- the fleet on disk -------------------------------------------------------------------------------------
def model_config(spec: FleetSpec, arch_key: str, tiny: bool) -> Any:
    """The Hugging Face config of one of `spec`'s models: the catalogue shape, or a tiny one of its family."""
    from modelpool.replay import hf_config
    from scheduler.fleet import catalogue_arch, hf_shape

    family = spec.family(arch_key)
    if tiny:
        return hf_config(family, TINY_SHAPES[family], "float32")
    arch = catalogue_arch(arch_key)
    return hf_config(family, hf_shape(arch) | ({"head_dim": arch.head_dim} if arch.head_dim else {}), "bfloat16")


def build_fleet(spec: FleetSpec, folder: Path, gpu: str, tiny: bool,
                gpus: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """Random-weight model folders of `spec`'s shapes (tiny ones of the same families when `tiny`) and a fleet
    file for them on one `gpu` (`gpus`: its figures, where the catalogue lacks it); returns the fleet file."""
    import yaml

    from modelpool.replay import write_model

    folder.mkdir(parents=True, exist_ok=True)
    tokenizers: dict[int, Path] = {}  # vocabulary size -> the first folder holding its tokenizer
    for seed, (name, arch_key) in enumerate(spec.models):
        config = model_config(spec, arch_key, tiny)
        write_model(folder / name, config, seed, tokenizers.get(config.vocab_size))
        tokenizers.setdefault(config.vocab_size, folder / name)
    data = spec.fleet_dict(gpu, archs={name: f"./{name}" for name in spec.names}, gpus=gpus)
    for entry in data["models"]:
        entry["weights"] = entry["arch"]
    path = folder / "fleet.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def served_fleet(spec: FleetSpec, gpu: str) -> Any:
    """The fleet of `spec`'s real shapes as `build_fleet` serves them: each model's shape read back from the config
    written for it (`model_config`). The catalogue's own figures differ by up to 0.3% in weight bytes (published
    parameter counts, rounded), enough that twelve small models no longer fit the shared weights region the
    engines laid out for the served ones, and the simulation evicted and copied models the live pool never did."""
    from scheduler.fleet import Fleet, arch_from_hf_config

    archs = {name: arch_from_hf_config(model_config(spec, key, False).to_dict()) for name, key in spec.models}
    return Fleet.model_validate(spec.fleet_dict(gpu, archs=archs))


# ---- one side's figures ------------------------------------------------------------------------------------
Row = Mapping[str, Any]  # one request: served, ttft_s, tpot_s (None for one token)


def attained(row: Row, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """vLLM's goodput rule, as sims.metrics counts slo_attainment: TTFT and mean TPOT within their SLOs."""
    return bool(row.get("served")) and row["ttft_s"] <= ttft_slo_s and (row.get("tpot_s") or 0.0) <= tpot_slo_s


def side_figures(rows: Sequence[Row], num_requests: int, slo: Callable[[str], tuple[float, float]],
                 switches: int | None, weight_copies: int | None = None) -> dict[str, Any]:
    """Attainment over every request (failed ones miss), TTFT and TPOT p50/p90 over the served ones, switches
    (model switches: plans that changed the models an instance computes with, scheduler.instance.resident_after;
    free where the weights are held; not Switch actions, of which a joint decode turn planned step by step orders
    two a step and changes nothing) and weight copies (models' weights copied onto an instance by a switch or a
    prefetch, as scheduler.instance.ModelSlots rules: the engines' count live, the simulated devices' count)."""
    served = [r for r in rows if r.get("served")]
    ttft = [r["ttft_s"] for r in served]
    tpot = [r["tpot_s"] for r in served if r.get("tpot_s") is not None]

    def pct(values: list[float], q: int) -> float | None:
        return float(np.percentile(values, q)) if values else None

    hits = sum(attained(r, *slo(r["model"])) for r in rows)
    return {"requests": num_requests, "served": len(served),
            "slo_attainment": hits / num_requests if num_requests else None,
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "tpot_p50_s": pct(tpot, 50), "tpot_p90_s": pct(tpot, 90), "switches": switches,
            "weight_copies": weight_copies}


def compare(live: Mapping[str, Any], sim: Mapping[str, Any], targets: Targets = Targets()) -> list[dict[str, Any]]:
    """Each figure live and simulated, the simulator's error (points for attainment, relative for the rest) and
    whether it is within its target."""
    out = []
    for key, unit in (("slo_attainment", "points"), ("ttft_p50_s", "rel"), ("ttft_p90_s", "rel"),
                      ("tpot_p50_s", "rel"), ("tpot_p90_s", "rel"), ("switches", "rel"), ("weight_copies", "rel")):
        a, b = live.get(key), sim.get(key)
        if a is None or b is None:
            error, ok = None, a is None and b is None
        elif unit == "points":
            error = 100.0 * (b - a)
            ok = abs(error) <= targets.attainment_points
        else:
            error = (b - a) / a if a else (0.0 if b == 0 else float("inf"))
            limit = targets.switches_rel if key in ("switches", "weight_copies") else targets.latency_rel
            ok = abs(error) <= limit
        out.append({"figure": key, "live": a, "sim": b, "error": error, "unit": unit, "ok": ok})
    return out


# ---- the simulated side ------------------------------------------------------------------------------------
@dataclass
class SimLayout:
    """The fleet, the live pool's instance layout and the costs the simulator times it with."""

    fleet: Any
    instances: list[Any]
    gpu_of: dict[str, int]
    costs: Any
    profile: str
    shared_weights: bool = False  # the GPU's instances map one weights region (serve's torch engines, all fitting)


def sim_layout(fleet_path: Path, num_gpus: int, profile: str | None) -> SimLayout:
    """The layout `modelpool serve` builds for this fleet on `num_gpus` GPUs (CPU slots when 0), each instance
    with the KV and model regions its engine is given (what the live scheduler plans with: without them the
    simulated scheduler sized them by the fleet's load figures instead), costed by `profile` (default: the cost
    model's own)."""
    from modelpool.config import load_fleet
    from modelpool.deploy import engine_regions, fleet_deployment
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile

    fleet = load_fleet(fleet_path)
    dep = fleet_deployment(fleet_path, "torch", num_gpus, None, "token-level", None)
    gpu_of = {spec.instance_id: int(dep.devices.get(spec.instance_id, "cuda:0").partition(":")[2] or 0)
              for spec in dep.instances}
    costs = RooflineCostModel(fleet, profile=load_profile(profile) if profile else None, gpus_per_host_link=1)
    return SimLayout(fleet, engine_regions(dep), gpu_of, costs, profile or "default",
                     bool(dep.engine.options.get("shared_weights")))


WARM_UP_S = 60.0  # simulated seconds the warm-up gets before the first request (it takes a few)


def simulated(layout: SimLayout, workload: Workload,
              plan_log: Path | None = None) -> tuple[list[dict[str, Any]], int, int]:
    """Each request's TTFT and TPOT as the simulator gives them (rows in workload order), its switches and its
    weight copies (side_figures); every Plan into `plan_log` where given.

    The simulated pool starts as the live one does: `modelpool serve` warms up with one short request per model
    (modelpool.serve.warm_up: a one-token prompt, two tokens out, all at once) before any client's, which copies
    every model onto the instances. Here those requests come WARM_UP_S before the workload's (its times shifted
    that much), and the switches and weight copies they make are left out of the counts, as the live pool's
    Plan log ranges leave them out."""
    count = len(workload.models)
    _, warm_switches, warm_copies = _simulated(layout, _after_warm_up(workload, with_requests=False), None, count)
    rows, switches, copies = _simulated(layout, _after_warm_up(workload), plan_log, count)
    return rows, switches - warm_switches, copies - warm_copies


def _after_warm_up(workload: Workload, with_requests: bool = True) -> Workload:
    """`workload` WARM_UP_S later, after one warm-up request per model (its first rows); only those without
    `with_requests`."""
    from dataclasses import replace

    count, kept = len(workload.models), slice(None) if with_requests else slice(0)
    warmed = Workload.from_columns(
        np.concatenate([np.zeros(count), workload.arrival_s[kept] + WARM_UP_S]),
        np.concatenate([np.arange(count), workload.model_index[kept]]),
        np.concatenate([np.ones(count, dtype=np.int64), workload.input_tokens[kept]]),
        np.concatenate([np.full(count, 2, dtype=np.int64), workload.output_tokens[kept]]),
        models=workload.models, source=workload.source, duration_s=workload.duration_s + WARM_UP_S)
    return replace(warmed, notes=workload.notes)


def _simulated(layout: SimLayout, workload: Workload, plan_log: Path | None,
               skip: int) -> tuple[list[dict[str, Any]], int, int]:
    """Rows for the workload's requests past its first `skip` (the warm-up's)."""
    from sims.run import simulate
    from sims.workload import request_id

    log = plan_log.open("w") if plan_log is not None else None
    try:
        result = simulate(layout.fleet, workload, "token-level", instances=layout.instances, gpu_of=layout.gpu_of,
                          costs=layout.costs, plan_log=log, shared_weights=layout.shared_weights)
    finally:
        if log is not None:
            log.close()
    rows = []
    names = workload.models
    for k, index in enumerate(workload.model_index.tolist()[skip:]):
        record = result.records.get(request_id(skip + k))
        row: dict[str, Any] = {"index": k, "model": names[index], "served": False}
        if record is not None and record.first_token_at is not None and not record.failed \
                and record.finished_at is not None:
            row.update(served=True, ttft_s=record.first_token_at - record.arrival_at,
                       tpot_s=((record.finished_at - record.first_token_at) / (record.generated - 1)
                               if record.generated > 1 else None))
        rows.append(row)
    # weight copies past each instance's first of each model: the live pool's warm-up made those before the loads
    return rows, int(result.metrics["num_model_switches"]), int(result.metrics["num_weight_recopies"])


def clip_lengths(workload: Workload, max_input: int, max_output: int) -> Workload:
    """The workload with prompts and outputs cut to these lengths (--quick), said in its notes."""
    from dataclasses import replace

    return replace(workload, input_tokens=np.minimum(workload.input_tokens, max_input),
                   output_tokens=np.minimum(workload.output_tokens, max_output),
                   notes=workload.notes + (f"--quick: prompts cut to {max_input}, outputs to {max_output} tokens",))


def slo_of(fleet: Any) -> Callable[[str], tuple[float, float]]:
    slos = {m.name: fleet.slo(m) for m in fleet.models}
    return lambda name: (slos[name].ttft_s, slos[name].tpot_s)


def knee_rate(scenario: Scenario, layout: SimLayout, duration_s: float, seed: int,
              traces_dir: Path | None = None, steps: int = 6) -> float:
    """The highest total rate (req/s) at which the simulator meets the SLO for KNEE_ATTAINMENT of the scenario's
    requests over `duration_s`: doubling from 1 req/s to bracket it, then bisecting in log space."""
    slo = slo_of(layout.fleet)

    def attainment(rate: float) -> float:
        workload = scenario.workload(rate, duration_s, seed, traces_dir)
        rows, switches, _ = simulated(layout, workload)
        return float(side_figures(rows, len(workload), slo, switches)["slo_attainment"] or 0.0)

    low, high = 0.0, 1.0
    while high <= MAX_KNEE_RATE:
        try:
            if attainment(high) < KNEE_ATTAINMENT:
                break
        except TraceError:  # the trace has no more requests for a higher rate over this window
            return max(low, high / 2)
        low, high = high, high * 2
    else:
        return low
    if low == 0.0:
        low = high / 64
    for _ in range(steps):
        middle = float(np.sqrt(low * high))
        if attainment(middle) >= KNEE_ATTAINMENT:
            low = middle
        else:
            high = middle
    return low


# ---- the live side -----------------------------------------------------------------------------------------
def live_runs(fleet_path: Path, workloads: Mapping[str, Workload], out_dir: Path, profile: str | None,
              start_timeout_s: float, request_timeout_s: float, seed: int,
              log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """One server for the fleet; each workload replayed on it in turn: per load its requests' rows, its
    switches (the pool's count before and after) and the replay's wall time."""
    import httpx

    from modelpool.replay import (fresh_status, free_port, per_request, replay, start_server, stop_server,
                                  wait_ready)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = out_dir / "serve.log"
    extra = ["--profile", profile] if profile else []
    proc = start_server(fleet_path, port, log_path, "processes", extra)
    runs: dict[str, dict[str, Any]] = {}
    previous = signal.signal(signal.SIGTERM, _exit_on_term)  # `timeout` and kill stop the server too
    try:
        ready_s = wait_ready(url, proc, start_timeout_s)
        log(f"  served in {ready_s:.0f} s (log: {log_path})")
        for load, workload in workloads.items():
            rows = [{"timestamp_s": r.arrival_at, "model": r.model, "input_tokens": r.input_tokens,
                     "output_tokens": r.output_tokens} for r in workload.requests()]
            before = fresh_status(url)
            started = time.monotonic()
            results, _ = asyncio.run(replay(url, rows, PROMPT_VOCAB, seed, request_timeout_s))
            wall_s = time.monotonic() - started
            after = fresh_status(url)
            fresh = before["fresh"] and after["fresh"] and None not in (before.get("weight_copies"),
                                                                         after.get("weight_copies"))
            runs[load] = {"rows": per_request(results), "wall_s": wall_s,
                          "switches": int((after.get("model_switches") or 0) - (before.get("model_switches") or 0)),
                          "switch_actions": int((after.get("switches") or 0) - (before.get("switches") or 0)),
                          "weight_copies": int(after["weight_copies"]) - int(before["weight_copies"]) if fresh
                          else None,  # None: an engine's stats came late
                          "plans": [before.get("plans"), after.get("plans")],  # this load's lines of the plan log
                          "restarts": after.get("restarts"),
                          # what a diagnosis needs that the Plan log lacks: each instance's KV capacity as the
                          # scheduler planned with it, and its engine's stats (timings, hand-off paths)
                          "status": [_instances_of(before), _instances_of(after)]}
            log(f"  {load}: {len(rows)} requests replayed in {wall_s:.0f} s")
            if proc.poll() is not None:
                raise RuntimeError(f"modelpool serve exited with {proc.returncode} during the {load} run "
                                   f"(log: {log_path})")
    finally:
        stop_server(proc)
        signal.signal(signal.SIGTERM, previous)
    return runs


def _instances_of(status: Mapping[str, Any]) -> dict[str, Any]:
    """/pool/status's per-instance part (KV capacity and use, its engine's latest stats) and its KV refusals."""
    return {"instances": status.get("instances", {}), "kv_refusals": status.get("kv_refusals"),
            "stats_at": status.get("stats_at")}


def _exit_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# ---- the command -------------------------------------------------------------------------------------------
def machine() -> tuple[int, str, str]:
    """(GPUs, the catalogue GPU key to cost with, a description of the device) of this machine. The GPU's name
    comes from nvidia-smi: this process must not open a CUDA context beside the pool's MPS daemon."""
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        listed = []
    names = [name.strip() for name in listed if name.strip()]
    if not names:
        return 0, "h200", "cpu (tiny shapes; costed as an h200 unless the profile describes this CPU)"
    from modelpool.gpus import gpu_key

    return 1, gpu_key(None, lambda: names[0]), names[0]


def cpu_device(profile: str, gpu: str, device: str) -> tuple[str, dict[str, Any] | None, str]:
    """(the GPU type, its figures, the description) a CPU run is costed with: the device a measurements file was
    calibrated on where that is a CPU (its measured figures go into the fleet's `gpus:`), else unchanged."""
    from sims.profiles import load_profile

    measured = load_profile(profile)
    run = measured.calibration
    if run is None or measured.device_spec is None or "cpu" not in run.device.lower():
        return gpu, None, device
    return run.gpu, {run.gpu: measured.device_spec.model_dump()}, f"cpu (tiny shapes; costed as measured: {run.device})"


def commit() -> str:
    if os.environ.get("MODELPOOL_COMMIT"):
        return os.environ["MODELPOOL_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def validate_scenario(name: str, profile: str | None, duration_s: float | None, quick: bool,
                      loads: Sequence[str], rate: float | None, out_dir: Path, seed: int = 0,
                      traces_dir: Path | None = None, start_timeout_s: float = 600.0,
                      request_timeout_s: float = 300.0, log: Callable[[str], None] = print,
                      knee: float | None = None, max_output: int | None = None) -> dict[str, Any]:
    """Serve, replay, simulate and compare one scenario at each of `loads`; returns (and writes) the comparison."""
    from dataclasses import replace

    from sims.scenarios import scenario as find

    spec = find(name)
    if max_output is not None:
        spec = replace(spec, max_output_tokens=max_output)
    unknown = [load for load in loads if load not in LOADS]
    if unknown:
        raise TraceError(f"unknown load {unknown[0]!r}; choose from {', '.join(LOADS)}")
    duration_s = duration_s or (QUICK_DURATION_S if quick else 60.0)
    num_gpus, gpu, device = machine()
    gpus = None
    if num_gpus == 0 and profile:  # a profile measured on this CPU (modelpool calibrate --device cpu) costs it
        gpu, gpus, device = cpu_device(profile, gpu, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"{name}: {spec.describe()}\n  on {device}; profile {profile or 'default'}")
    fleet_path = build_fleet(spec.fleet_spec(), out_dir / f"models-{spec.fleet}", gpu, tiny=num_gpus == 0, gpus=gpus)
    layout = sim_layout(fleet_path, num_gpus, profile)
    if rate is None and knee is None:
        knee = knee_rate(spec, layout, duration_s, seed, traces_dir)
        log(f"  knee (simulated, {KNEE_ATTAINMENT:.0%} attainment): {knee:.3g} req/s")
    rates = {load: rate if rate is not None else LOADS[load] * float(knee or 0.0) for load in loads}
    workloads = {load: spec.workload(rates[load], duration_s, seed, traces_dir) for load in loads}
    if quick:
        workloads = {load: clip_lengths(w, QUICK_MAX_INPUT, QUICK_MAX_OUTPUT) for load, w in workloads.items()}
    gc.collect()
    gc.freeze()  # the imports (torch, transformers) out of every later collection, the one at exit too
    live = live_runs(fleet_path, workloads, out_dir, profile, start_timeout_s, request_timeout_s, seed, log)
    report: dict[str, Any] = {
        "scenario": name, "description": spec.describe(), "device": device, "gpu": gpu, "commit": commit(),
        "command": "modelpool validate " + shlex.join(sys.argv[2:]) if len(sys.argv) > 1 else "",
        "profile": layout.profile, "duration_s": duration_s, "seed": seed, "knee_rps": knee,
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "max_output_tokens": spec.max_output_tokens,
        "quick": quick, "tiny": num_gpus == 0,
        "layout": {"instances": [[i.instance_id, i.tp, i.memory_bytes, i.role, i.kv_bytes, i.weight_bytes,
                                    i.host_kv_bytes]
                                 for i in layout.instances],
                   "gpu_of": layout.gpu_of, "shared_weights": layout.shared_weights},
        "loads": {load: {"rate_rps": rates[load], "requests": len(workloads[load]),
                         "notes": list(workloads[load].notes), "live_switches": live[load]["switches"],
                         "live_weight_copies": live[load]["weight_copies"], "live_plans": live[load]["plans"],
                         "live_switch_actions": live[load]["switch_actions"],
                         "live_wall_s": round(live[load]["wall_s"], 1), "live_restarts": live[load]["restarts"],
                         "live_status": live[load]["status"],
                         "live_rows": [{k: v for k, v in row.items() if k != "itl_s"} for row in live[load]["rows"]]}
                  for load in loads}}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=1, default=str))  # the live side is kept if the rest is cut short
    return simulate_report(report, layout, workloads, path)


def simulate_report(report: dict[str, Any], layout: SimLayout, workloads: Mapping[str, Workload],
                    path: Path) -> dict[str, Any]:
    """The simulated side of a report whose live side is recorded: each load's requests simulated on the
    layout, both sides' figures, the errors and the requests side by side; written to `path`."""
    slo = slo_of(layout.fleet)
    report["profile"] = layout.profile
    for load, workload in workloads.items():
        part = report["loads"][load]
        live_rows = part["live_rows"]
        sim_rows, sim_switches, sim_copies = simulated(layout, workload, path.parent / f"sim-{load}.plans.jsonl")
        part["live"] = side_figures(live_rows, len(workload), slo, part["live_switches"],
                                    part.get("live_weight_copies"))
        part["sim"] = side_figures(sim_rows, len(workload), slo,
                                   sim_switches if part["live_switches"] is not None else None,
                                   sim_copies if part.get("live_weight_copies") is not None else None)
        part["errors"] = compare(part["live"], part["sim"])
        if part.get("live_status"):
            part["steps"] = step_check(part["live_status"][-1], layout.costs, workload)
        part["requests_side_by_side"] = [
            {"index": k, "model": a["model"], "live_ttft_s": a.get("ttft_s"), "sim_ttft_s": b.get("ttft_s"),
             "live_tpot_s": a.get("tpot_s"), "sim_tpot_s": b.get("tpot_s"), "error": a.get("error")}
            for k, (a, b) in enumerate(zip(live_rows, sim_rows))]
    path.write_text(json.dumps(report, indent=1, default=str))
    report["path"] = str(path)
    return report


def decode_context(workload: Workload) -> float:
    """The context a decode step's request has on average over the workload's steps: a request of prompt p and
    output o decodes o steps at contexts p .. p + o (mean p + o/2), so it weighs o."""
    prompt = workload.input_tokens.astype(np.float64)
    out = workload.output_tokens.astype(np.float64)
    return float((out * (prompt + out / 2)).sum() / max(1.0, out.sum()))


def step_check(status: Mapping[str, Any], costs: Any, workload: Workload) -> dict[str, Any]:
    """The live engines' own step times (an instance's latest ~4096 decode steps and 256 prefills, as /pool/status
    gave them after the load) beside the cost model's time for the same step run alone: decode steps by instance and
    batch bucket at the workload's mean decode context, prefills by instance and by model (the median of live /
    model: a calibrated shape's against a carried one's). A ratio well off 1 names the term a miss sits in; it
    includes what the GPU's other instance took from the step (the simulator charges that apart, by the share
    tables), so read it beside the figures."""
    context = decode_context(workload)
    decode, prefill = [], []
    for iid, inst in sorted((status.get("instances") or {}).items()):
        timings = ((inst.get("engine_extra") or {}).get("timings") or {})
        buckets: dict[str, list[float]] = {}
        for model, by_batch in (timings.get("decode_by_model") or {}).items():
            for bucket, row in by_batch.items():
                batch = max(1, round(row["batch_mean"]))
                try:
                    alone = costs.decode_step_s(model, batch, int(context * batch))
                except KeyError:  # a mixed batch ("a+b") or a model the cost model lacks
                    continue
                acc = buckets.setdefault(bucket, [0.0, 0.0, 0.0])
                acc[0] += row["steps"]
                acc[1] += row["steps"] * row["forward_ms_mean"] / 1e3
                acc[2] += row["steps"] * alone
        for bucket, (steps, live, alone) in sorted(buckets.items(), key=lambda kv: int(kv[0].lstrip("<="))):
            decode.append({"instance": iid, "role": inst.get("role"), "batch": bucket, "steps": int(steps),
                           "live_ms": round(live / steps * 1e3, 3), "model_ms": round(alone / steps * 1e3, 3),
                           "ratio": round(live / alone, 3)})
        ratios: dict[str, list[float]] = {}
        after_discard: dict[bool, list[float]] = {True: [], False: []}
        for model, tokens, requests, seconds, *flag in timings.get("prefills") or []:
            try:
                alone = costs.prefill_s(model, int(tokens), int(requests))
            except KeyError:
                continue
            ratios.setdefault(model, []).append(seconds / alone)
            if flag:  # files before it: (model, tokens, requests, seconds)
                after_discard[bool(flag[0])].append(seconds / alone)
        if ratios:
            every = [r for of_model in ratios.values() for r in of_model]
            prefill.append({"instance": iid, "role": inst.get("role"), "prefills": len(every),
                            "ratio_p50": round(float(np.median(every)), 3),
                            "by_model": {model: _ratios(of_model) for model, of_model in sorted(ratios.items())},
                            # the calls that began by discarding a decode step launched ahead (its device time
                            # inside theirs: the simulator charges it apart) and the others
                            "after_discard": _ratios(after_discard[True]),
                            "fresh": _ratios(after_discard[False])})
    return {"decode_context": round(context), "decode": decode, "prefill": prefill}


def recorded_shared_weights(report: Mapping[str, Any]) -> bool:
    """Whether a recorded run's engines mapped one weights region per GPU: as its layout says, or (files before
    it) as its engines' status shows - a device buffer that is the KV region alone, the weights outside it."""
    if "shared_weights" in report["layout"]:
        return bool(report["layout"]["shared_weights"])
    engines = [inst.get("engine") or {} for part in report["loads"].values()
               for status in part.get("live_status") or [] for inst in (status.get("instances") or {}).values()]
    engines = [e for e in engines if str(e.get("device", "")).startswith("cuda") and e.get("device_buffer_bytes")]
    return bool(engines) and all(
        e["device_buffer_bytes"] - e.get("kv_device_bytes", 0) < 0.01 * e["device_buffer_bytes"] for e in engines)


def _ratios(ratios: Sequence[float]) -> dict[str, Any]:
    return {"prefills": len(ratios), "ratio_p50": round(float(np.median(ratios)), 3) if ratios else None}


def recorded_instance(row: Sequence[Any]) -> Any:
    """An instance of a report's layout: [id, tp, memory, role], then (recorded since session 22) the KV and model
    regions of its engine (older reports: none, and the simulated scheduler sizes them itself), then (since
    session 23) its engine's host KV bound (older reports: none, unbounded as simulated then)."""
    from scheduler import InstanceSpec

    iid, tp, memory, role, *regions = row
    kv, weights, host = (list(regions) + [None, None, None])[:3]
    return InstanceSpec(iid, tp, memory, role, kv_bytes=kv, weight_bytes=weights, host_kv_bytes=host)


def recorded_layout(report: Mapping[str, Any], recorded: Path, profile: str | None) -> SimLayout:
    """The simulated layout of a recorded run (`recorded`: its JSON file): the same instances on the same GPUs,
    costed by `profile` (default: the one recorded). On a real-shape run the fleet's shapes are the served
    configs' (`served_fleet`)."""
    from modelpool.config import load_fleet
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile
    from sims.scenarios import scenario as find

    spec = find(report["scenario"])
    if report.get("tiny"):
        fleet = load_fleet(recorded.parent / f"models-{spec.fleet}" / "fleet.yaml")
    else:
        fleet = served_fleet(spec.fleet_spec(), report["gpu"])
    profile = profile or (None if report["profile"] == "default" else report["profile"])
    return SimLayout(fleet, [recorded_instance(row) for row in report["layout"]["instances"]],
                     {k: int(v) for k, v in report["layout"]["gpu_of"].items()},
                     RooflineCostModel(fleet, profile=load_profile(profile) if profile else None, gpus_per_host_link=1),
                     profile or "default", recorded_shared_weights(report))


def recorded_workload(report: Mapping[str, Any], recorded: Path, load: str,
                      traces_dir: Path | None = None) -> Workload:
    """The requests of a recorded run's `load` (the scenario's workload regenerated from its rate, duration and
    seed, clipped as a quick run clips them); a TraceError where that is not the run's number of requests."""
    from dataclasses import replace

    from sims.scenarios import scenario as find

    spec = replace(find(report["scenario"]), max_output_tokens=report["max_output_tokens"])
    part = report["loads"][load]
    workload = spec.workload(part["rate_rps"], report["duration_s"], report["seed"], traces_dir)
    if report.get("quick"):
        workload = clip_lengths(workload, QUICK_MAX_INPUT, QUICK_MAX_OUTPUT)
    if len(workload) != part["requests"]:
        raise TraceError(f"{recorded}: the {load} load regenerates {len(workload)} requests, the run had "
                         f"{part['requests']} (another version of the scenario?)")
    return workload


def resimulate(recorded: Path, profile: str | None, out_dir: Path, traces_dir: Path | None = None) -> dict[str, Any]:
    """The simulated side again, with `profile` (default: the one recorded), for a recorded live run: the same
    requests (recorded_workload), the same instance layout (recorded_layout)."""
    report = json.loads(recorded.read_text())
    layout = recorded_layout(report, recorded, profile)
    workloads = {}
    for load, part in report["loads"].items():
        workloads[load] = recorded_workload(report, recorded, load, traces_dir)
        part.setdefault("live_switches", part.get("live", {}).get("switches", 0))
        if "live_switch_actions" not in part:  # recorded before session 22: its switches were Switch actions
            part["live_switch_actions"] = part.pop("live_switches")
            part["live_switches"] = None
    out_dir.mkdir(parents=True, exist_ok=True)
    return simulate_report(report, layout, workloads, out_dir / recorded.name)


def _prefill_line(row: Mapping[str, Any]) -> str:
    """An instance's prefill ratios (step_check): all, by model, after a discarded step and not."""
    by_model = ", ".join(f"{m} {b['ratio_p50']:.2f}x" for m, b in (row.get("by_model") or {}).items())
    split = "".join(f"; {label} {row[key]['ratio_p50']:.2f}x of {row[key]['prefills']}"
                    for key, label in (("after_discard", "after a discarded step"), ("fresh", "else"))
                    if (row.get(key) or {}).get("prefills"))
    return f"prefills {row['ratio_p50']:.2f}x ({by_model}{split})"


def format_report(report: Mapping[str, Any]) -> str:
    """Live and simulated side by side, per load, with each error against its target."""
    lines = [f"{report['scenario']} on {report['device']} (commit {report['commit']}, profile {report['profile']})"]
    for load, part in report["loads"].items():
        lines.append(f"  {load}: {part['rate_rps']:.3g} req/s, {part['requests']} requests "
                     f"({part['live']['served']} served live, {part['sim']['served']} simulated)")
        lines.append(f"    {'figure':16s} {'live':>10s} {'sim':>10s} {'error':>9s}  target")
        for row in part["errors"]:
            scale, unit = (100.0, "%") if row["figure"] == "slo_attainment" else \
                (1e3, "ms") if row["figure"].endswith("_s") else (1.0, "")
            show = lambda v: "-" if v is None else f"{v * scale:.1f}{unit}"  # noqa: E731
            if row["error"] is None:
                error = "-"
            elif row["unit"] == "points":
                error = f"{row['error']:+.1f}pt"
            else:
                error = f"{row['error'] * 100:+.0f}%" if np.isfinite(row["error"]) else "inf"
            target = "3 pt" if row["unit"] == "points" else "15%"
            lines.append(f"    {row['figure']:16s} {show(row['live']):>10s} {show(row['sim']):>10s} {error:>9s}  "
                         f"{target} {'ok' if row['ok'] else 'MISS'}")
        steps = part.get("steps")
        if steps and (steps["decode"] or steps["prefill"]):
            lines.append(f"    engine steps, live / the model's step alone (context {steps['decode_context']}; "
                         "the other instance's share included):")
            for iid in dict.fromkeys([r["instance"] for r in steps["decode"] + steps["prefill"]]):
                decode = " ".join(f"{r['batch']} {r['ratio']:.2f}x" for r in steps["decode"] if r["instance"] == iid)
                prefill = [_prefill_line(r) for r in steps["prefill"] if r["instance"] == iid]
                lines.append(f"      {iid}: " + "; ".join(([f"decode {decode}"] if decode else []) + prefill))
    lines.append(f"  written: {report.get('path', '-')}")
    return "\n".join(lines)
