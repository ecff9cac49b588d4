"""The simulator on a trace the live pool served (benchmarks/gpu_pool.py): same fleet, same instance layout.

    python benchmarks/gpu_pool_sim.py RUN.json... --profile PROFILE   # live runs against the simulator, side by side

The layout is the one `modelpool serve` builds for one GPU (`modelpool.deploy.fleet_deployment`), both
instances on GPU 0 so that their copies share its host link; the cost model is the roofline with a
calibration profile (default: the shipped h200-cudagraph one; `modelpool calibrate` writes others).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

PROFILE = "h200-cudagraph"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo's packages


def quantiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 of `values` (None when there are none): the live and the simulated aggregates alike."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=float)
    return {f"p{q}": round(float(np.percentile(a, q)), 5) for q in (50, 90, 99)}


def simulate_live_layout(fleet_path: Path, trace_path: Path, profile: Path | str | None = None, *,
                         cpu: bool = False, policy: str = "token-level", num_instances: int | None = None,
                         num_gpus: int = 1, planned_with: Path | str | None = None) -> dict[str, Any]:
    """The simulator on `trace_path` in the layout serve gives `fleet_path`, its steps costed by `profile`; its
    scheduler plans with `planned_with` (the profile the live pool served with: its turn quotas and group sizes
    came from that one's costs; default: `profile`)."""
    from modelpool.config import load_fleet
    from modelpool.deploy import fleet_deployment
    import io

    from benchmarks.gpu_pool_calls import plan_summary, prefill_rounds, switch_summary
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile
    from sims.run import simulate
    from sims.trace_readers import read_generic
    from sims.workload import request_id

    fleet = load_fleet(fleet_path)
    dep = fleet_deployment(fleet_path, "torch", 0 if cpu else num_gpus, num_instances, policy, None)
    workload = read_generic(trace_path)
    costs = RooflineCostModel(fleet, profile=load_profile(profile or PROFILE), gpus_per_host_link=1)
    # each instance on the GPU serve gives it (two GPUs: the prefill instance on one, the decode one on the other)
    gpu_of = {spec.instance_id: int(dep.devices.get(spec.instance_id, "cuda:0").partition(":")[2] or 0)
              for spec in dep.instances}
    plans = io.StringIO()
    planner = (RooflineCostModel(fleet, profile=load_profile(planned_with), gpus_per_host_link=1)
               if planned_with is not None and str(planned_with) != str(profile) else None)
    result = simulate(fleet, workload, policy, instances=dep.instances, gpu_of=gpu_of, costs=costs, plan_log=plans,
                      plan_costs=planner)
    rows: dict[int, dict[str, Any]] = {}
    for k in range(len(workload.arrival_s)):
        record = result.records.get(request_id(k))
        if record is None or record.first_token_at is None or record.failed:
            continue
        tpot = ((record.finished_at - record.first_token_at) / (record.generated - 1)
                if record.finished_at is not None and record.generated > 1 else None)
        rows[k] = {"ttft_s": record.first_token_at - record.arrival_at, "tpot_s": tpot}
    # per request as the live side measures it (benchmarks/gpu_pool.py's aggregate), over the requests served
    aggregate = {"slo_attainment": result.metrics["slo_attainment"],
                 "ttft_s": quantiles([r["ttft_s"] for r in rows.values()]),
                 "tpot_s": quantiles([r["tpot_s"] for r in rows.values() if r["tpot_s"] is not None])}
    lines = plans.getvalue().splitlines()
    return {"requests": rows, "aggregate": aggregate, "switches": result.metrics["num_switches"],
            "profile": str(profile or PROFILE), "planned_with": str(planned_with or profile or PROFILE),
            "instances": [s.instance_id for s in dep.instances], "gpu_of": gpu_of, "per_instance": result.per_instance,
            "plan_summary": plan_summary(lines), "prefill_rounds": prefill_rounds(lines),
            "switch_times": {iid: switch_summary(v) for iid, v in result.switches_by_model.items()},
            "decode_by_model": {iid: decode_buckets(v) for iid, v in result.decode_by_shape.items()}}


def decode_buckets(by_shape: dict[tuple[str, int], list[float]]) -> dict[str, dict[str, dict[str, float]]]:
    """The simulator's decode steps by model and batch size in the live engine's batch buckets
    (pool.engines.timings.BATCH_BUCKETS): steps, their mean batch and mean ms - beside the live run's
    decode_timings_by_model (its period_ms_mean: a step's time on the engine's side, call to call)."""
    from pool.engines.timings import BATCH_BUCKETS

    out: dict[str, dict[str, dict[str, float]]] = {}
    for model in sorted({m for m, _ in by_shape}):
        low = 0
        for high in BATCH_BUCKETS:
            rows = [(b, steps, sec) for (m, b), (steps, sec) in by_shape.items() if m == model and low < b <= high]
            steps = sum(r[1] for r in rows)
            if steps:
                out.setdefault(model, {})[f"<={high}"] = {
                    "steps": int(steps), "batch_mean": round(sum(b * n for b, n, _ in rows) / steps, 3),
                    "step_ms_mean": round(1e3 * sum(r[2] for r in rows) / steps, 4)}
            low = high
    return out


def time_budget(live: dict[str, Any], sim: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each instance's time, live (its engine calls in the run, by method: gpu_pool.py's call_s_by_engine; runs
    recorded before it have none) beside the simulator's (decode steps and their seconds, switches, prefills, KV
    moves, busy)."""
    out = {}
    for iid, figures in sim["per_instance"].items():
        calls = (live.get("call_s_by_engine") or {}).get(iid) or {}
        steps = calls.get("decode_step", {})
        out[iid] = {
            "live": {"decode_steps": steps.get("calls"), "decode_s": steps.get("s"),
                     "other_calls_s": {m: f["s"] for m, f in calls.items() if m != "decode_step"}} if calls else None,
            "sim": {k: round(v, 4) for k, v in figures.items()}}
    return out


NOISE_SCALE = 0.01  # the floor's perturbation: the live pool's prefill 1% slower, and 1% faster


def noise_floor(fleet: Path, trace_path: Path, profile: Path | str, sim: dict[str, Any],
                scale: float = NOISE_SCALE, cpu: bool = False, planned_with: Path | str | None = None) -> dict[str, Any]:
    """The simulator against itself with its prefill `scale` slower and faster (eff_compute / (1 +- scale), its
    fixed prefill times * (1 +- scale)):
    per-request ratios a cost model no better than that cannot beat. Near saturation a request's round of its
    model's group prefill, and its turn, hang on small timing differences: if a 1% change moves the per-request
    p90 ratio to 2, a live/sim p90 of 2 says nothing about the terms."""
    import json
    import tempfile

    from benchmarks.gpu_pool import compare
    from sims.profiles import load_profile

    base = load_profile(profile)
    out = {}
    for sign, label in ((1, "slower"), (-1, "faster")):
        factor = 1 + sign * scale  # every prefill term: its compute rate and its fixed, per-layer, per-request times
        terms = base.terms.model_copy(update={
            "eff_compute": min(1.0, base.terms.eff_compute / factor),
            **{name: getattr(base.terms, name) * factor
               for name in ("prefill_fixed_s", "prefill_layer_s", "prefill_request_s")}})
        path = Path(tempfile.mkdtemp(prefix="floor-")) / "profile.json"
        path.write_text(json.dumps(base.model_copy(update={"terms": terms}).model_dump(mode="json")))
        other = simulate_live_layout(fleet, trace_path, path, cpu=cpu, planned_with=planned_with or profile)
        rows = [{"index": k, "served": True, **v} for k, v in other["requests"].items()]
        out[f"prefill {scale:.0%} {label}"] = {**compare(rows, sim["requests"]), "aggregate": other["aggregate"]}
    return out


def aggregate_band(sim: dict[str, Any], floor: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """The simulator's own spread of its aggregates on one trace: [lowest, highest] of each TTFT and TPOT
    p50/p90/p99 over the unperturbed run and the noise floor's perturbed ones. A live aggregate inside the band
    differs from the simulator's by no more than a 1% change of one term moves the simulator itself."""
    runs = [sim["aggregate"], *(f["aggregate"] for f in floor.values())]
    return {key: {q: [min(r[key][q] for r in runs), max(r[key][q] for r in runs)] for q in ("p50", "p90", "p99")}
            for key in ("ttft_s", "tpot_s")}


def served_profile(run: dict[str, Any], profile: str) -> str:
    """The profile file the run's serve was given (`--profile` in its serve_args), where it is a file here; else
    `profile`."""
    args = run.get("serve_args") or []
    given = next((args[k + 1] for k, arg in enumerate(args[:-1]) if arg == "--profile"), None)
    return given if given is not None and Path(given).is_file() else profile


def _actions(figures: dict[str, float] | None) -> str:
    if not figures:
        return "-"
    steps = f" ({figures['max_steps_mean']:.1f} steps)" if "max_steps_mean" in figures else ""
    return f"{figures['actions']:.0f} x {figures['requests_mean']:.2f}{steps}"


def _round(figures: dict[str, Any] | None) -> str:
    if not figures:
        return "-"
    held = "-" if figures["held_ms_mean"] is None else f"{figures['held_ms_mean']:.0f} ms"
    return f"{figures['rounds']} x {figures['prompts_mean']:.2f} ({figures['switched_share']:.0%} sw, {held})"


def _steps(figures: dict[str, float] | None) -> str:
    if not figures:
        return "-"
    ms = figures.get("step_ms_mean", figures.get("period_ms_mean"))
    return f"{figures['steps']} x {ms:.2f} ms (batch {figures['batch_mean']:.1f})"


def _switches(figures: dict[str, float] | None) -> str:
    return "-" if not figures else f"{figures['n']} x {figures['mean_ms']:.0f} ms (p90 {figures['p90_ms']:.0f})"


def _side_by_side(out: dict[str, Any], key: str, shown: Any, title: str) -> None:
    """Print each run's `key` figures (instance -> name -> figures), live | sim, name by name."""
    print(f"\n{title}")
    for name, cmp in out.items():
        live, sim = cmp[key]["live"] or {}, cmp[key]["sim"]
        for iid in sim:
            print(f"{name:44s} {iid}: " + ", ".join(
                f"{what} {shown(live.get(iid, {}).get(what))} | {shown(sim[iid].get(what))}"
                for what in sorted(set(sim[iid]) | set(live.get(iid, {})))))


def main(argv: list[str] | None = None) -> int:
    """Live runs saved by benchmarks/gpu_pool.py against the simulator on their traces, side by side."""
    import argparse
    import json
    import tempfile

    from benchmarks.gpu_pool import FLEET, build_models, compare
    from benchmarks.gpu_pool_calls import switch_summary

    parser = argparse.ArgumentParser(description="live gpu_pool.py runs against the simulator on the same traces")
    parser.add_argument("runs", nargs="+", type=Path, help="run JSONs (each with its trace CSV beside it, same stem)")
    parser.add_argument("--profile", required=True, help="the profile the live pool served with (serve --profile)")
    parser.add_argument("--out", type=Path, help="write the comparison here as JSON")
    parser.add_argument("--planned-with", default="served", help="the profile the simulator's scheduler plans "
                        "with: 'served' (default: the one the run's serve was given, where it is a file here, else "
                        "--profile), 'same' (--profile) or a profile file")
    parser.add_argument("--noise-floor", action="store_true", help="also the simulator against itself with its "
                        "prefill 1%% slower and faster: the per-request ratios no cost model can beat on these traces")
    args = parser.parse_args(argv)
    fleet = build_models(Path(tempfile.mkdtemp(prefix="fidelity-")), FLEET, "h200")
    out = {}
    print(f"{'run':44s} {'TTFT live/sim p10/p50/p90 (corr)':34s} {'TPOT live/sim':26s} "
          f"{'TTFT p50/p90/p99 ms live | sim':32s} {'TPOT p50/p90/p99 ms live | sim':32s} {'attain':11s} switches")
    for path in args.runs:
        live = json.loads(path.read_text())
        planner = served_profile(live, args.profile) if args.planned_with == "served" else \
            args.profile if args.planned_with == "same" else args.planned_with
        sim = simulate_live_layout(fleet, path.with_suffix(".csv"), args.profile, planned_with=planner)
        cmp = compare(live["requests"], sim["requests"])
        cmp["attainment"] = [live["aggregate"]["slo_attainment"], sim["aggregate"]["slo_attainment"]]
        cmp["switches"] = [live["switches_planned"], sim["switches"]]
        cmp["time_budget"] = time_budget(live, sim)
        cmp["plans"] = {"live": live.get("plan_summary"), "sim": sim["plan_summary"]}  # live: runs since session 15
        cmp["prefill_rounds"] = {"live": live.get("prefill_rounds"), "sim": sim["prefill_rounds"]}  # since session 17
        cmp["decode_by_model"] = {"live": live.get("decode_timings_by_model"), "sim": sim["decode_by_model"]}
        cmp["switch_times"] = {"live": {iid: switch_summary(v) for iid, v in live["switch_times"].items()}
                               if live.get("switch_times") else None, "sim": sim["switch_times"]}  # since session 18
        if args.noise_floor:
            cmp["noise_floor"] = noise_floor(fleet, path.with_suffix(".csv"), args.profile, sim, planned_with=planner)
            cmp["sim_band"] = aggregate_band(sim, cmp["noise_floor"])
        if str(planner) != str(args.profile):
            cmp["planned_with"] = str(planner)
        out[path.name] = cmp

        def ratios(key: str) -> str:
            c = cmp[key]
            return f"{c['ratio_p10']:.2f}/{c['ratio_p50']:.2f}/{c['ratio_p90']:.2f} ({c['log_corr']:.2f})"

        def ms(key: str, side: str) -> str:
            return "/".join(f"{cmp[key][side][q] * 1e3:.0f}" if key == "ttft_s" else f"{cmp[key][side][q] * 1e3:.1f}"
                            for q in ("p50", "p90", "p99"))

        print(f"{path.name:44s} {ratios('ttft_s'):34s} {ratios('tpot_s'):26s} "
              f"{ms('ttft_s', 'live') + ' | ' + ms('ttft_s', 'sim'):32s} {ms('tpot_s', 'live') + ' | ' + ms('tpot_s', 'sim'):32s} "
              f"{cmp['attainment'][0]:.3f}/{cmp['attainment'][1]:.3f} {cmp['switches'][0]}/{cmp['switches'][1]}")
    if args.noise_floor:
        print("\nthe noise floor: the simulator against itself, its prefill 1% slower | 1% faster (per-request "
              "ratios p10/p50/p90)")
        for name, cmp in out.items():
            print(f"{name:44s} " + " | ".join(
                f"TTFT {f['ttft_s'].get('ratio_p10', 0):.2f}/{f['ttft_s'].get('ratio_p50', 0):.2f}/"
                f"{f['ttft_s'].get('ratio_p90', 0):.2f} TPOT {f['tpot_s'].get('ratio_p10', 0):.2f}/"
                f"{f['tpot_s'].get('ratio_p50', 0):.2f}/{f['tpot_s'].get('ratio_p90', 0):.2f}"
                for f in cmp["noise_floor"].values()))
        print("\nthe simulator's own spread of its aggregates (as is, prefill 1% slower and faster): TTFT p50/p90/p99 "
              "ms | TPOT p50/p90/p99 ms, lowest-highest")
        for name, cmp in out.items():
            band = cmp["sim_band"]
            print(f"{name:44s} " + " | ".join(" / ".join(
                f"{band[key][q][0] * 1e3:.{digits}f}-{band[key][q][1] * 1e3:.{digits}f}" for q in ("p50", "p90", "p99"))
                for key, digits in (("ttft_s", 0), ("tpot_s", 1))))
    print("\neach instance's time, live (engine calls in the run) | sim: decode steps, their seconds (mean ms); "
          "other seconds")
    for name, cmp in out.items():
        for iid, budget in cmp["time_budget"].items():
            live_side, sim_side = budget["live"], budget["sim"]
            shown = "-" if live_side is None else (
                f"{live_side['decode_steps']} steps {live_side['decode_s']:.1f} s "
                f"({1e3 * live_side['decode_s'] / max(1, live_side['decode_steps']):.2f} ms); "
                + ", ".join(f"{m} {s:.2f} s" for m, s in sorted(live_side["other_calls_s"].items(), key=lambda kv: -kv[1])
                            if s >= 0.01))
            print(f"{name:44s} {iid}: {shown} | {sim_side['decode_steps']} steps {sim_side['decode_s']:.1f} s "
                  f"({1e3 * sim_side['decode_s'] / max(1, sim_side['decode_steps']):.2f} ms); switches "
                  f"{sim_side['switch_s']:.2f} s, prefill {sim_side.get('prefill_s', 0.0):.2f} s, KV moves "
                  f"{sim_side.get('kv_s', 0.0):.2f} s, busy {sim_side['busy_s']:.1f} s")
    _side_by_side(out, "plans", _actions, "each instance's Plans, live | sim: actions x requests on average "
                  "(Decode: and its max steps)")
    _side_by_side(out, "prefill_rounds", _round, "each instance's group prefills by model, live | sim: rounds x "
                  "prompts on average, the share that switched, the mean ms each held the instance (its switch and "
                  "prefill)")
    _side_by_side(out, "switch_times", _switches, "each instance's switches by model, live (its activate calls) | sim: "
                  "how many, the mean and p90 ms each held the instance (a prefetched model's: what was left of its copy)")
    print("\neach instance's decode steps by model and batch bucket, live (the engine's period, call to call) | sim: "
          "steps x mean ms (mean batch)")
    for name, cmp in out.items():
        live_all, sim_all = cmp["decode_by_model"]["live"] or {}, cmp["decode_by_model"]["sim"]
        for iid in sim_all:
            for model in sorted(set(sim_all[iid]) | set(live_all.get(iid) or {})):
                live_m, sim_m = (live_all.get(iid) or {}).get(model, {}), sim_all[iid].get(model, {})
                print(f"{name:44s} {iid} {model}: " + ", ".join(
                    f"{b} {_steps(live_m.get(b))} | {_steps(sim_m.get(b))}"
                    for b in sorted(set(live_m) | set(sim_m), key=lambda k: int(k.removeprefix("<=")))))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
