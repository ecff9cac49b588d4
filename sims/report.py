"""The capacity report: one JSON-ready dict built from a study, and its Markdown and CSV renderings.

`build_report` is the single source: the Markdown and CSVs (`sims.report_text`)
and the HTML (`sims.report_html`) only lay out what it holds. Required keys (the JSON
schema the issue fixes, checked by tests): `slo_target`, `slo_metric`,
`dedicated_gpus` and `policies` mapping each policy to `gpus`, `attainment`
(0-1, the chosen metric, whole pool), `p99_ttft_ms`, `p99_tpot_ms`,
`models_per_gpu` and `usd_per_month`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from scheduler.fleet import Fleet
from sims.capacity import POLICY_ORDER
from sims.capacity_eval import Context
from sims.capacity_study import NO_SCALE, StudyResult
from sims.metrics import PERCENTILES
from sims.profiles import BASES, TERM_NAMES, CalibrationProfile, ProfileTerms

HOURS_PER_MONTH = 730.0
SCHEMA_VERSION = 1
METRIC_KEYS = {"per-request": "slo_attainment", "aegaeon": "aegaeon_slo_attainment"}
METRIC_TEXT = {
    "per-request": "per-request (vLLM goodput rule): a request attains when TTFT <= TTFT SLO and its mean TPOT "
                   "<= TPOT SLO; the share of all requests",
    "aegaeon": "Aegaeon's (SOSP'25): token k is due at arrival + TTFT SLO + (k-1) * TPOT SLO; a request scores "
               "the share of its service time not behind a deadline; the mean score",
}
REQUIRED_POLICY_KEYS = ("gpus", "attainment", "p99_ttft_ms", "p99_tpot_ms", "models_per_gpu", "usd_per_month")


def usd_per_month(fleet: Fleet, gpu: str, gpus: int) -> float:
    return round(gpus * fleet.gpu(gpu).usd_per_hour * HOURS_PER_MONTH, 2)


def build_report(result: StudyResult, ctx: Context, *, fleet_path: str = "", trace: str = "", seed: int = 0,
                 command: str = "", wall_s: float | None = None,
                 repeats: Mapping[int, Mapping[str, tuple[int, bool]]] | None = None,
                 sensitivity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report's dict; `repeats` holds the other seeds' answers (seed -> policy -> (GPUs, met)), `--seeds`;
    `sensitivity` the answers with the least certain terms worse (sims.sensitivity)."""
    fleet, gpu, goal = ctx.fleet, result.gpu, result.config.goal
    policies = {policy: _policy_entry(result, ctx, policy) for policy in result.pool_runs}
    dedicated = result.answer("dedicated")
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "generated_by": command or "modelpool capacity",
        "slo_target": goal.target,
        "slo_metric": goal.metric,
        "slo_metric_definition": METRIC_TEXT[goal.metric],
        "dedicated_gpus": dedicated.gpus if dedicated else None,
        "gpu": gpu,
        "usd_per_gpu_hour": fleet.gpu(gpu).usd_per_hour,
        "fleet": _fleet_entry(fleet, fleet_path),
        "workload": _workload_entry(ctx, trace, seed),
        "policies": policies,
        "headline": _headline(result, ctx, policies),
        "floor": _floor(result, dedicated.gpus if dedicated else None, policies),
        "per_model": _per_model(result, ctx),
        "curves": _curves(result),
        "gpu_types": _gpu_types(result, ctx),
        "what_if": _what_ifs(result, ctx),
        "search": {"evaluations": result.stats.evaluated, "reused": result.stats.reused,
                   "verify_window": goal.window, "max_instances_per_class": goal.max_instances,
                   "search_wall_s": round(result.search_wall_s, 2), "pool_runs_wall_s": round(result.pool_wall_s, 2),
                   "wall_s": None if wall_s is None else round(wall_s, 2)},
        # how the trace's rows were assigned to the fleet's models comes first (public traces carry no fleet names)
        "notes": [f"workload: {note}" for note in ctx.workload.notes]
                 + sorted({note for a in result.answers.values() for note in a.notes}),
    }
    report["model_misses"] = {p: [r["model"] for r in report["per_model"] if p in r and r[p]["attainment"] < goal.target]
                              for p in policies}
    report["recommended"] = recommended_plan(report)
    report["stability"] = stability(report, seed, repeats or {})
    report["tries"] = _tries(result, ctx, report)
    report["sensitivity"] = dict(sensitivity) if sensitivity else None  # sims.sensitivity
    report["assumptions"] = _assumptions(result, ctx)
    report["profile"] = ctx.costs(gpu).profile.summary(gpu)
    return report


# ---- pieces ----------------------------------------------------------------------------------------------

FLOOR_TEXT = ("no policy serves this traffic on fewer GPUs under the cost model: per TP class, the prefill compute "
              "plus decode steps at exactly the TPOT SLO with every active request of a model in one batch "
              "(no switches, no KV moves, no queueing, 100% busy), rounded up to whole instances")


def _floor(result: StudyResult, dedicated_gpus: int | None, policies: Mapping[str, Any]) -> dict[str, Any]:
    infos = result.infos[result.gpu]
    classes = {str(tp): {"prefill_load": _round(info.prefill_load, 4), "decode_load": _round(info.decode_floor_load, 4),
                         "instances": info.floor_instances, "gpus": info.floor_instances * tp}
               for tp, info in sorted(infos.items())}
    gpus = sum(info.floor_instances * tp for tp, info in infos.items())
    out: dict[str, Any] = {"gpus": gpus, "definition": FLOOR_TEXT, "classes": classes,
                           "ratio_to_dedicated": _round(gpus / dedicated_gpus, 4) if dedicated_gpus else None,
                           "policies_over_floor": {p: _round(e["gpus"] / gpus, 4) for p, e in policies.items()}}
    return out


def _fleet_entry(fleet: Fleet, path: str) -> dict[str, Any]:
    classes: dict[str, int] = {}
    for m in fleet.models:
        classes[f"tp{m.tp}"] = classes.get(f"tp{m.tp}", 0) + 1
    return {"path": path, "num_models": len(fleet.models), "gpu": fleet.pool.gpu, "tp_classes": classes,
            "price_source": fleet.gpu().source}


def _workload_entry(ctx: Context, trace: str, seed: int) -> dict[str, Any]:
    w = ctx.workload
    spec = trace or w.source
    if spec.startswith("poisson;rate=") and spec.count(":") + 1 == len(ctx.fleet.models):
        description = (f"Poisson arrivals at each model's traffic hint, "
                       f"{spec.split('lengths=')[1].split(';')[0] if 'lengths=' in spec else 'ShareGPT'} lengths, seed {seed}")
    else:
        description = spec if len(spec) <= 120 else spec[:117] + "..."
    return {"spec": spec, "description": description, "seed": seed, "num_requests": len(w), "duration_s": w.duration_s,
            "rate_rps": round(w.rate_per_s, 4),
            "mean_prompt_tokens": round(float(w.input_tokens.mean()), 1) if len(w) else 0.0,
            "mean_output_tokens": round(float(w.output_tokens.mean()), 1) if len(w) else 0.0,
            "notes": list(w.notes)}


def _policy_entry(result: StudyResult, ctx: Context, policy: str) -> dict[str, Any]:
    answer = result.answer(policy)
    assert answer is not None
    run = result.pool_runs[policy]
    m = run.metrics
    dedicated = result.answer("dedicated")
    fleet = ctx.fleet
    gpus = answer.gpus
    metric = result.config.goal.metric
    met = answer.met and m[METRIC_KEYS[metric]] >= result.config.goal.target
    missed = _missed_models(m, result.config.goal.target, metric)
    return {
        "gpus": gpus,
        "met": met,
        "attainment": round(m[METRIC_KEYS[metric]], 6),
        "per_request_attainment": round(m["slo_attainment"], 6),
        "aegaeon_attainment": round(m["aegaeon_slo_attainment"], 6),
        "p50_ttft_ms": round(m["median_ttft_ms"], 1), "p99_ttft_ms": round(m["p99_ttft_ms"], 1),
        "p50_tpot_ms": round(m["median_tpot_ms"], 2), "p99_tpot_ms": round(m["p99_tpot_ms"], 2),
        "p99_itl_ms": round(m["p99_itl_ms"], 2),
        "models_per_gpu": round(len(fleet.models) / gpus, 3) if gpus else None,
        "usd_per_month": usd_per_month(fleet, result.gpu, gpus),
        "savings_vs_dedicated": round(1 - gpus / dedicated.gpus, 4) if dedicated and dedicated.gpus else None,
        "gpu_busy_share": round(m.get("gpu_busy_share", 0.0), 4),
        "switches_per_gpu_per_minute": round(m.get("switches_per_gpu_per_minute", 0.0), 3),
        "num_switches": m.get("num_switches", 0),
        "kv_gb_moved": round(m.get("kv_bytes_moved", 0.0) / 1e9, 2),
        "output_tokens_per_s": round(m["output_throughput"], 1),
        "per_user_output_tokens_per_s": round(m["per_user_output_tokens_per_s"], 1),
        "request_goodput_rps": round(m["request_goodput"], 4),
        "completed": m["completed"], "failed": m["failed"], "unfinished": m["unfinished"],
        "layout": [layout.to_json() for layout in answer.layouts],
        "class_attainment": {f"tp{tp}": _round(a.outcome.score(metric)) if a.outcome else None
                             for tp, a in sorted(answer.classes.items())},
        "missed_models": missed,
        "unmet_reason": None if met else _unmet_reason(policy, result.config.goal.target, metric, missed, answer.notes),
        "notes": answer.notes,
    }


def _missed_models(run_metrics: Mapping[str, Any], target: float, metric: str) -> list[dict[str, Any]]:
    """The models whose own attainment in the pool run is under the target, worst first."""
    rows = [{"model": name, "attainment": round(fig[METRIC_KEYS[metric]], 6), "requests": fig.get("num_requests")}
            for name, fig in run_metrics["per_model"].items() if fig[METRIC_KEYS[metric]] < target]
    return sorted(rows, key=lambda r: (r["attainment"], r["model"]))


def _unmet_reason(policy: str, target: float, metric: str, missed: list[dict[str, Any]], notes: list[str]) -> str:
    """Why a policy's answer is marked unmet: who missed, by how much, and what the search said."""
    rule = ("each model must meet it on its own" if policy == "dedicated"
            else "each TP class must meet it over its requests")
    models = ", ".join(f"{r['model']} {r['attainment']:.2%}" for r in missed[:6])
    more = f" and {len(missed) - 6} more" if len(missed) > 6 else ""
    who = f"under it: {models}{more}" if missed else "no single model is under it, but a class is"
    return f"{policy} misses the {target:.1%} {metric} target ({rule}); {who}" + (f" ({'; '.join(notes)})" if notes else "")


def _round(x: float, digits: int = 6) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, digits)


def _headline(result: StudyResult, ctx: Context, policies: Mapping[str, Any]) -> dict[str, Any]:
    dedicated = policies.get("dedicated")
    pooled = {p: e for p, e in policies.items() if p != "dedicated" and e["met"]}
    best = min(pooled, key=lambda p: (policies[p]["gpus"], p)) if pooled else None
    out: dict[str, Any] = {"dedicated_gpus": dedicated["gpus"] if dedicated else None, "best_policy": best}
    if best is None:
        out["sentence"] = "no pooled policy met the target within the search limits"
        return out
    entry = policies[best]
    out.update(best_gpus=entry["gpus"], usd_per_month_best=entry["usd_per_month"])
    if dedicated:
        saved = 1 - entry["gpus"] / dedicated["gpus"]
        out.update(savings=round(saved, 4), ratio=round(entry["gpus"] / dedicated["gpus"], 4),
                   usd_per_month_dedicated=dedicated["usd_per_month"],
                   usd_per_month_saved=round(dedicated["usd_per_month"] - entry["usd_per_month"], 2))
        out["sentence"] = (f"{dedicated['gpus']} dedicated {result.gpu.upper()}s -> {entry['gpus']} pooled ({best}), "
                           f"{saved:.0%} fewer GPUs, ${dedicated['usd_per_month']:,.0f} -> ${entry['usd_per_month']:,.0f} "
                           f"a month at {result.config.goal.target:.0%} {result.config.goal.metric} SLO attainment")
        if not dedicated["met"]:  # a baseline that fails its own target is no fair yardstick: say so in the headline
            names = ", ".join(r["model"] for r in dedicated["missed_models"][:3]) or "a class"
            out["baseline_met"] = False
            out["sentence"] += (f"; but the dedicated baseline misses the target itself ({names} under it), "
                                f"so this saving is measured against a pool that falls short")
    else:
        out["sentence"] = f"{best}: {entry['gpus']} {result.gpu.upper()}s, ${entry['usd_per_month']:,.0f} a month"
    return out


def _per_model(result: StudyResult, ctx: Context) -> list[dict[str, Any]]:
    w = ctx.workload
    counts = w.model_counts()
    duration = max(w.duration_s, 1e-9)
    prompt = np.bincount(w.model_index, weights=w.input_tokens, minlength=len(w.models)) if len(w) else np.zeros(len(w.models))
    output = np.bincount(w.model_index, weights=w.output_tokens, minlength=len(w.models)) if len(w) else np.zeros(len(w.models))
    index = {name: k for k, name in enumerate(w.models)}
    dedicated = result.answer("dedicated")
    replicas = {name: n for layout in (dedicated.layouts if dedicated else ()) for name, n in layout.replicas}
    rows = []
    for m in ctx.fleet.models:
        k, n = index.get(m.name), counts.get(m.name, 0)
        row: dict[str, Any] = {
            "model": m.name, "arch": m.arch_name, "tp": m.tp, "requests": n, "rate_rps": round(n / duration, 4),
            "few_requests": n < min_requests_to_judge(result.config.goal.target),
            "ttft_slo_s": ctx.fleet.slo(m).ttft_s, "tpot_slo_ms": round(ctx.fleet.slo(m).tpot_s * 1e3, 3),
            "mean_prompt_tokens": round(prompt[k] / n, 1) if n and k is not None else 0.0,
            "mean_output_tokens": round(output[k] / n, 1) if n and k is not None else 0.0,
            "dedicated_instances": replicas.get(m.name), "dedicated_gpus": replicas[m.name] * m.tp if m.name in replicas else None,
        }
        for policy, run in result.pool_runs.items():
            fig = run.metrics["per_model"].get(m.name)
            if fig is None:
                continue
            row[policy] = {"attainment": round(fig[METRIC_KEYS[result.config.goal.metric]], 4),
                           **{f"p{q}_ttft_ms": round(fig[f"p{q}_ttft_ms"], 1) for q in PERCENTILES},
                           **{f"p{q}_tpot_ms": round(fig[f"p{q}_tpot_ms"], 2) for q in PERCENTILES}}
        rows.append(row)
    return rows


def recommended_plan(report: Mapping[str, Any]) -> dict[str, Any] | None:
    """The plan the headline recommends (the cheapest pooled policy that met the target, else dedicated where it
    did; None when none did), model by model: its attainment and TTFT / TPOT p50, p90, p99 against its own SLO,
    each figure past its bound named in `misses`. Models under the target come first (worst first), then those
    with only a latency percentile over its SLO, then the rest in the fleet's order."""
    policies, target = report["policies"], report["slo_target"]
    policy = report["headline"].get("best_policy")
    if policy is None and policies.get("dedicated", {}).get("met"):
        policy = "dedicated"
    if policy is None:
        return None
    rows = []
    for r in report["per_model"]:
        x = r.get(policy)
        row: dict[str, Any] = {"model": r["model"], "tp": r["tp"], "requests": r["requests"],
                               "few_requests": r["few_requests"], "ttft_slo_ms": round(r["ttft_slo_s"] * 1e3, 3),
                               "tpot_slo_ms": r["tpot_slo_ms"], **(x or {}), "misses": []}
        if x:
            row["misses"] = (["attainment"] if x["attainment"] < target else []) + [
                f"p{q}_{name}_ms" for name in ("ttft", "tpot") for q in PERCENTILES
                if x[f"p{q}_{name}_ms"] > row[f"{name}_slo_ms"]]
        rows.append(row)
    order = {r["model"]: k for k, r in enumerate(rows)}

    def rank(row: Mapping[str, Any]) -> tuple[int, float, int]:
        if "attainment" in row["misses"]:
            return 0, row["attainment"], order[row["model"]]
        return (1 if row["misses"] else 2), 0.0, order[row["model"]]

    rows.sort(key=rank)
    under = [r["model"] for r in rows if "attainment" in r["misses"]]
    slow = [r["model"] for r in rows if r["misses"] and "attainment" not in r["misses"]]
    return {"policy": policy, "gpus": policies[policy]["gpus"], "met": policies[policy]["met"],
            "under_target": under, "over_slo_only": slow, "rows": rows}


def min_requests_to_judge(target: float) -> int:
    """The fewest requests of a model for one miss to leave it at or over `target`: with fewer, a single
    unlucky request decides whether it passes, and the answer moves with the arrivals drawn."""
    return max(1, math.ceil(1 / (1 - target) - 1e-9)) if target < 1 else 1_000_000


def stability(report: Mapping[str, Any], seed: int, repeats: Mapping[int, Mapping[str, tuple[int, bool]]]) -> dict[str, Any]:
    """How sure the answer is: the models with too few requests to judge, and (with `--seeds`) each policy's
    GPUs under every seed and their spread."""
    target, duration = report["slo_target"], report["workload"]["duration_s"]
    need = min_requests_to_judge(target)
    few = sorted(({"model": r["model"], "requests": r["requests"]} for r in report["per_model"] if r["requests"] < need),
                 key=lambda r: (r["requests"], r["model"]))
    seeds = [seed, *sorted(repeats)]
    gpus = {p: [e["gpus"], *(repeats[s][p][0] for s in sorted(repeats))] for p, e in report["policies"].items()}
    met = {p: [e["met"], *(repeats[s][p][1] for s in sorted(repeats))] for p, e in report["policies"].items()}
    spread = {p: [min(g), max(g)] for p, g in gpus.items()}
    parts = []
    if few:
        named = ", ".join(f"{r['model']} {r['requests']}" for r in few[:5]) + (f" and {len(few) - 5} more" if len(few) > 5 else "")
        parts.append(f"{len(few)} of {len(report['per_model'])} models get fewer than {need} requests in {duration:g} s "
                     f"({named}): at a {target:.1%} target one miss fails such a model, so its share of the answer "
                     f"rests on a few arrivals")
    wide = {p: (lo, hi) for p, (lo, hi) in spread.items() if is_wide(lo, hi)}
    if len(seeds) > 1:
        ranges = ", ".join(f"{p} {lo}" + (f"-{hi}" if hi > lo else "") for p, (lo, hi) in spread.items())
        moved = any(hi > lo for lo, hi in spread.values())
        parts.append(f"GPUs across seeds {', '.join(map(str, seeds))}: {ranges}"
                     + ("" if moved else " (the same under every seed)"))
        if wide:
            named = ", ".join(f"{p} {lo}-{hi} (seed {seed} gave {gpus[p][0]})" for p, (lo, hi) in wide.items())
            parts.append(f"the spread is wide for {named}: size for the high end, or steady the answer with a "
                         f"longer --duration")
        missed = {p: [s for s, ok in zip(seeds, oks) if not ok] for p, oks in met.items() if not all(oks)}
        if missed:
            parts.append(", ".join(f"{p} misses the target under seed {', '.join(map(str, s))}"
                                   for p, s in missed.items()))
    else:
        parts.append(f"the answer comes from one seed's arrivals: `--seeds 3` repeats the search with two more and "
                     f"reports the spread{'; a longer --duration steadies it' if few else ''}")
    return {"min_requests_to_judge": need, "few_requests": few, "seeds": seeds, "gpus_by_seed": gpus,
            "met_by_seed": met, "spread": spread, "wide": sorted(wide), "sentence": "Stability: " + "; ".join(parts) + "."}


def is_wide(lo: int, hi: int) -> bool:
    """A spread of GPUs across seeds worth a warning: at least 2 GPUs and more than 10% of the low end."""
    return hi - lo >= 2 and hi - lo > 0.1 * lo


def _curves(result: StudyResult) -> list[dict[str, Any]]:
    rows = []
    for point, o in result.outcomes.items():
        rows.append({"gpu": point.gpu, "policy": point.policy, "tp": point.tp,
                     "slo_scale": list(point.slo_scale), "gpus": point.layout.gpus, "layout": point.layout.label(),
                     "attainment": _round(o.attainment), "aegaeon_attainment": _round(o.aegaeon_attainment),
                     "stopped_early_at_s": o.stopped_at, "error": o.error or None, "wall_s": round(o.wall_s, 3)})
    rows.sort(key=lambda r: (r["gpu"], r["policy"], r["slo_scale"], r["tp"], r["gpus"], r["layout"]))
    return rows


def _gpu_types(result: StudyResult, ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gpu in result.config.gpus:
        spec = ctx.fleet.gpu(gpu)
        entry: dict[str, Any] = {"usd_per_gpu_hour": spec.usd_per_hour, "memory_gb": spec.memory_gb,
                                 "bf16_tflops": spec.bf16_tflops, "hbm_tb_s": spec.hbm_tb_s}
        if gpu in result.skipped_gpus:
            entry["skipped"] = result.skipped_gpus[gpu]
        else:
            entry["policies"] = {
                policy: {"gpus": a.gpus, "met": a.met, "usd_per_month": usd_per_month(ctx.fleet, gpu, a.gpus),
                         "attainment": _round(a.attainment(result.config.goal.metric))}
                for policy in POLICY_ORDER if (a := result.answer(policy, gpu)) is not None}
        out[gpu] = entry
    return out


def _what_ifs(result: StudyResult, ctx: Context) -> list[dict[str, Any]]:
    out = []
    for (gpu, policy, scale), a in result.answers.items():
        if scale == NO_SCALE:
            continue
        base = result.answer(policy, gpu)
        out.append({"gpu": gpu, "policy": policy, "ttft_slo_factor": scale[0], "tpot_slo_factor": scale[1],
                    "gpus": a.gpus, "met": a.met, "usd_per_month": usd_per_month(ctx.fleet, gpu, a.gpus),
                    "gpus_saved": base.gpus - a.gpus if base else None,
                    "attainment": _round(a.attainment(result.config.goal.metric))})
    return out


def _other_metric_estimate(result: StudyResult, policy: str) -> tuple[str, int | None]:
    """From the points already simulated: the fewest class GPUs that meet the target under the other metric."""
    other = "aegaeon" if result.config.goal.metric == "per-request" else "per-request"
    answer = result.answer(policy)
    if answer is None:
        return other, None
    total = 0
    for tp in answer.classes:
        ok = [p.layout.gpus for p, o in result.outcomes.items()
              if p.gpu == result.gpu and p.policy == policy and p.tp == tp and p.slo_scale == NO_SCALE
              and not math.isnan(o.score(other)) and not o.error and o.score(other) >= result.config.goal.target]
        if not ok:
            return other, None
        total += min(ok)
    return other, total


def _tries(result: StudyResult, ctx: Context, report: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    gpu, goal, policies = result.gpu, result.config.goal, report["policies"]
    for entry in report["what_if"]:
        base = policies.get(entry["policy"])
        if not base:
            continue
        tpot, policy = entry["tpot_slo_factor"], entry["policy"]
        saved = base["gpus"] - entry["gpus"]
        if not entry["met"]:
            lines.append(f"Even with every TPOT SLO {tpot:g}x looser, {policy} does not meet the target within the limits.")
        elif saved > 0:
            lines.append(f"With every TPOT SLO {tpot:g}x looser, {policy} needs {entry['gpus']} {gpu.upper()}s: "
                         f"{saved} fewer, ${base['usd_per_month'] - entry['usd_per_month']:,.0f} a month less.")
        else:
            lines.append(f"A TPOT SLO {tpot:g}x looser saves no {policy} GPU here ({entry['gpus']} vs {base['gpus']}).")
    types = report["gpu_types"]
    if len(types) > 1:
        for policy in ("token-level", "dedicated"):
            priced = {g: t["policies"][policy] for g, t in types.items()
                      if "policies" in t and policy in t["policies"] and t["policies"][policy]["met"]}
            if len(priced) > 1:
                cheapest = min(priced, key=lambda g: (priced[g]["usd_per_month"], g))
                here = priced.get(gpu)
                if here and cheapest != gpu:
                    lines.append(f"{policy} on {cheapest.upper()}: {priced[cheapest]['gpus']} GPUs at "
                                 f"${priced[cheapest]['usd_per_month']:,.0f} a month vs ${here['usd_per_month']:,.0f} on "
                                 f"{gpu.upper()}.")
                elif here:
                    lines.append(f"{policy}: {gpu.upper()} is the cheapest of the GPU types compared "
                                 f"(${here['usd_per_month']:,.0f} a month).")
    else:
        lines.append("Other GPU types: `modelpool capacity --gpu-types h20,h20-3e,h100,h200` prices the same fleet "
                     "on each.")
    for policy in ("token-level",):
        if policy in policies:
            other, gpus = _other_metric_estimate(result, policy)
            if gpus is not None:
                lines.append(f"Under the {other} metric at {goal.target:.0%}, the points already simulated put "
                             f"{policy} at {gpus} GPUs or fewer (rerun with `--slo-metric {other}` to search it).")
    dedicated = result.answer("dedicated")
    if dedicated and "per_model" in report:
        quiet = [r for r in report["per_model"] if r["rate_rps"] < 0.1 and r["dedicated_gpus"]]
        total_requests = sum(r["requests"] for r in report["per_model"]) or 1
        if quiet:
            gpus = sum(r["dedicated_gpus"] for r in quiet)
            lines.append(f"Dedicated, the {len(quiet)} models under 0.1 req/s hold {gpus} of {dedicated.gpus} GPUs "
                         f"({gpus / dedicated.gpus:.0%}) and serve {sum(r['requests'] for r in quiet) / total_requests:.1%} "
                         f"of requests: the long tail pooling reclaims.")
    token = result.answer("token-level")
    if token and len(token.classes) > 1:
        big = max(token.classes.items(), key=lambda kv: (kv[1].layout.gpus, kv[0]))
        tp, answer = big
        models = len(result.infos[gpu][tp].models)
        if tp > 1:
            share = answer.layout.gpus / token.gpus
            lines.append(f"token-level spends {answer.layout.gpus} of its {token.gpus} GPUs ({share:.0%}) on the "
                         f"TP{tp} class ({models} models): few large busy models pool least.")
    return lines


def _calibrated(profile: CalibrationProfile, gpu: str) -> str:
    """Whether `profile` was measured on GPU type `gpu`, and by which run of `modelpool calibrate`."""
    run = profile.calibration
    if run is None:
        return "measured on this GPU type" if profile.summary(gpu)["measured_on_this_gpu"] else \
            f"not measured on {gpu}: estimated"
    here = "measured on this GPU type" if run.gpu == gpu.lower() else f"measured on {run.gpu}, not on {gpu}: estimated"
    return f"{here}; `{run.command}` on {run.device} at {run.measured_at}{', quick' if run.quick else ''}"


def _profile_row(profile: CalibrationProfile, gpu: str) -> dict[str, str]:
    """Which of `profile`'s terms were measured on GPU type `gpu`, estimated from datasheet ratios, carried over
    unchanged or assumed."""
    bases = profile.bases(gpu)
    elsewhere = ", ".join(sorted({g for basis in ("datasheet ratio", "carried over") for term in bases[basis]
                                  for g in profile.entry(term, gpu).gpus})) or "another GPU"
    labels = {"measured": f"measured on {gpu}",
              "datasheet ratio": f"estimated from datasheet ratios (efficiencies measured on {elsewhere})",
              "carried over": f"carried over unchanged from {elsewhere}", "assumed": "assumed (measured on no GPU)"}
    groups = [f"{labels[basis]}: {', '.join(bases[basis]) or 'none'}" for basis in BASES]
    return {"what": f"cost model profile on {gpu.upper()}",
            "status": "measured" if len(bases["measured"]) == len(TERM_NAMES) else "estimated",
            "value": f"profile {profile.name} ({_calibrated(profile, gpu)}); " + "; ".join(groups),
            "source": "the profile's provenance (sims/profiles; `modelpool estimate` prints the same split)"}


def _assumptions(result: StudyResult, ctx: Context) -> list[dict[str, str]]:
    fleet, gpu = ctx.fleet, result.gpu
    spec = fleet.gpu(gpu)
    costs = ctx.costs(gpu)
    profile = costs.profile
    out = [
        {"what": f"{gpu.upper()} figures", "status": "input",
         "value": f"{spec.memory_gb:g} GB, {spec.hbm_tb_s:g} TB/s HBM, {spec.bf16_tflops:g} BF16 TFLOPS, "
                  f"{spec.h2d_gb_s:g} GB/s host link, {spec.nvlink_gb_s:g} GB/s NVLink", "source": spec.source},
        {"what": "GPU price", "status": "estimated" if "estimat" in spec.source else "input",
         "value": f"${spec.usd_per_hour:g} per GPU-hour, {HOURS_PER_MONTH:g} hours a month", "source": spec.source},
    ]
    # every GPU type the study sized: the comparison's figures are only as measured as each one's terms
    out += [_profile_row(ctx.costs(g).profile, g) for g in (gpu, *(g for g in result.config.gpus if g != gpu))]
    for term in ("eff_compute", "eff_mem", "eff_kv", "eff_pcie", "eff_nvlink", "decode_fixed_s", "prefill_fixed_s",
                 "allreduce_latency_s"):
        entry = profile.entry(term, gpu)
        basis = profile.basis(term, gpu)
        where = {"datasheet ratio": f" (measured on {', '.join(entry.gpus)}; on {gpu} estimated from datasheet ratios)",
                 "carried over": f" (measured on {', '.join(entry.gpus)}; carried over unchanged to {gpu})"}.get(basis, "")
        out.append({"what": f"cost model: {term}", "status": profile.status(term, gpu),
                    "value": f"{getattr(costs.terms, term):g}", "source": entry.source + where})
    w = ctx.workload
    lengths = next((part.split("=", 1)[1] for part in w.source.split(";") if part.startswith("lengths=")), None)
    if lengths in ("sharegpt", "arxiv"):
        out.append({"what": "prompt and output lengths", "status": "measured",
                    "value": f"drawn from the {lengths} length pairs (a measured distribution of real requests)",
                    "source": "ShareGPT pairs shipped in sims/data (Sarathi-Serve, Apache-2.0)" if lengths == "sharegpt"
                    else "arxiv-summarization pairs (Vidur's processed traces, MIT)"})
    out += [
        {"what": "workload", "status": "input",
         "value": f"{len(w)} requests over {w.duration_s:g} s ({w.rate_per_s:.2f} req/s)", "source": w.source},
        {"what": "SLOs", "status": "input",
         "value": "; ".join(sorted({f"TTFT {fleet.slo(m).ttft_s:g} s / TPOT {fleet.slo(m).tpot_s * 1e3:g} ms"
                                    for m in fleet.models})), "source": "the fleet file (pool.default_slo, models[].slo)"},
        {"what": "pool", "status": "input",
         "value": f"gpu_memory_utilization {fleet.pool.gpu_memory_utilization:g}, max batch {fleet.pool.max_batch_size}, "
                  f"max prefill tokens {fleet.pool.max_prefill_tokens}", "source": "the fleet file (pool)"},
        {"what": "TP classes are searched apart", "status": "estimated",
         "value": "a model runs only on instances of its TP size, so classes never share GPUs; "
                  "each class must meet the target on its own (pooled) or each model (dedicated)",
         "source": "policy design (scheduler/costs.py make_instances)"},
        {"what": "search", "status": "estimated",
         "value": f"bracket x1.5, bisect, verify {result.config.goal.window} counts below each answer; "
                  "runs sure to miss a per-request target are stopped early (their attainment is an upper bound)",
         "source": "sims/capacity.py"},
        _host_links(fleet.pool.gpus_per_host_link, costs.terms),
        _gpu_sharing(costs.terms),
        {"what": "not modelled", "status": "estimated",
         "value": "prefix caching, network and gateway time, engine start-up, failures", "source": "sims/simulator.py"},
    ]
    for policy, options in sorted(ctx.policy_options.items()):
        if options:
            out.append({"what": f"{policy} options", "status": "input", "value": str(dict(options)), "source": "--option"})
    return out


def _host_links(gpus_per_link: int, terms: ProfileTerms) -> dict[str, str]:
    """How the simulation shares host links: the fleet's pool setting; a shared link moves bytes at eff_pcie."""
    if not gpus_per_link:
        return {"what": "host links", "status": "input", "source": "the fleet file (pool.gpus_per_host_link)",
                "value": "not shared (pool.gpus_per_host_link 0): every copy at the full link rate"}
    return {"what": "host links", "status": "input",
            "value": f"{gpus_per_link} GPU(s) per PCIe link: weight and KV copies that overlap on a link share its "
                     f"bytes at the one rate eff_pcie ({terms.eff_pcie:g}) measured, served in the order they start "
                     f"(sims/links.py)",
            "source": "the fleet file (pool.gpus_per_host_link); the link's rate from the profile"}


def _gpu_sharing(terms: ProfileTerms) -> dict[str, str]:
    """GPU time-sharing: the capacity layouts give every instance GPUs of its own, so the sharing rule is idle."""
    return {"what": "GPU time-sharing", "status": "estimated",
            "value": "none: every instance of the layouts searched has its GPUs to itself; where instances share a "
                     "GPU (the live pool's one-GPU layout) its time is split among those busy (k busy: 1/k each)",
            "source": "sims/capacity_eval.py (layouts) and sims/gpu_share.py"}
