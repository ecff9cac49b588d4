"""The capacity report as Markdown, CSV files and terminal rows (all laid out from `build_report`'s dict)."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def floor_line(report: Mapping[str, Any]) -> str:
    floor = report["floor"]
    ratio = "" if floor["ratio_to_dedicated"] is None else f" ({floor['ratio_to_dedicated']:.2f}x dedicated)"
    classes = ", ".join(f"TP{tp} {c['gpus']}" for tp, c in floor["classes"].items())
    return (f"Floor: {floor['gpus']} {report['gpu'].upper()}s{ratio} - {floor['definition']} ({classes}).")


def to_markdown(report: Mapping[str, Any]) -> str:
    gpu = report["gpu"].upper()
    lines = [f"# Capacity report: {report['fleet']['num_models']} models on {gpu}", "",
             f"**{report['headline']['sentence']}.**", "",
             report["stability"]["sentence"], "", *_seed_lines(report),
             floor_line(report), "",
             f"Target: {report['slo_target']:.1%} SLO attainment, {report['slo_metric']} metric "
             f"({report['slo_metric_definition']}).", "",
             f"Workload: {report['workload']['description']} - {report['workload']['num_requests']} requests over "
             f"{report['workload']['duration_s']:g} s ({report['workload']['rate_rps']:g} req/s).", "",
             "## Policies", "",
             "| policy | GPUs | vs dedicated | $/month | attainment | Aegaeon metric | p99 TTFT ms | p99 TPOT ms | "
             "models/GPU | GPU busy | switches/GPU/min | output tok/s (pool) | tok/s per user | layout |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for policy, e in report["policies"].items():
        saving = "-" if e["savings_vs_dedicated"] is None else f"{-e['savings_vs_dedicated']:+.0%}"
        layout = "; ".join(_layout_text(x) for x in e["layout"])
        lines.append(f"| {policy}{'' if e['met'] else ' (target not met)'} | {e['gpus']} | {saving} | "
                     f"{e['usd_per_month']:,.0f} | {e['attainment']:.2%} | {e['aegaeon_attainment']:.2%} | "
                     f"{e['p99_ttft_ms']:,.0f} | {e['p99_tpot_ms']:.1f} | {e['models_per_gpu']:.2f} | "
                     f"{e['gpu_busy_share']:.0%} | {e['switches_per_gpu_per_minute']:.1f} | {e['output_tokens_per_s']:,.0f} | "
                     f"{e['per_user_output_tokens_per_s']:.1f} | {layout} |")
    unmet = [e["unmet_reason"] for e in report["policies"].values() if e.get("unmet_reason")]
    lines += [""] + [f"- Target not met: {reason}." for reason in unmet]
    lines += ["", "Output tok/s (pool) is every token the pool produces per second; tok/s per user is the speed "
              "one stream sees (1 / its mean TPOT). They differ by the number of concurrent streams.", ""]
    lines += _plan_lines(report)
    types = report["gpu_types"]
    if len(types) > 1:
        names = sorted({p for t in types.values() for p in t.get("policies", {})},
                       key=lambda p: list(report["policies"]).index(p) if p in report["policies"] else 99)
        lines += ["## GPU types", "", "| GPU | $/GPU-hour | " + " | ".join(f"{p} GPUs ($/month)" for p in names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for g, t in types.items():
            if "skipped" in t:
                lines.append(f"| {g} | {t['usd_per_gpu_hour']:g} | " + " | ".join("does not fit" for _ in names) + " |")
                continue
            cells = []
            for p in names:
                e = t["policies"].get(p)
                cells.append("-" if e is None else f"{e['gpus']} (${e['usd_per_month']:,.0f}){'' if e['met'] else ' unmet'}")
            lines.append(f"| {g} | {t['usd_per_gpu_hour']:g} | " + " | ".join(cells) + " |")
        lines.append("")
    if report["tries"]:
        lines += ["## Try", ""] + [f"- {line}" for line in report["tries"]] + [""]
    lines += _sensitivity(report)
    policies = list(report["policies"])
    target = report["slo_target"]
    lines += ["## Per model", "", f"Attainment and p99 TTFT ms / TPOT ms at each policy's answer; **MISS**: under "
              f"{target:.1%}; (few): fewer than {report['stability']['min_requests_to_judge']} requests.", "",
              "| model | TP | requests | req/s | SLO TTFT s / TPOT ms | dedicated GPUs | " + " | ".join(policies) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(policies)]
    for row in report["per_model"]:
        cells = [f"{'**MISS** ' if row[p]['attainment'] < target else ''}{row[p]['attainment']:.2%}, "
                 f"{row[p]['p99_ttft_ms']:,.0f} / {row[p]['p99_tpot_ms']:.1f}" if p in row else "-" for p in policies]
        lines.append(f"| {row['model']} | {row['tp']} | {row['requests']}{' (few)' if row['few_requests'] else ''} | "
                     f"{row['rate_rps']:.3f} | {row['ttft_slo_s']:g} / {row['tpot_slo_ms']:g} | "
                     f"{row['dedicated_gpus'] if row['dedicated_gpus'] else '-'} | " + " | ".join(cells) + " |")
    lines += ["", "## Assumptions", "", "| what | value | status | source |", "|---|---|---|---|"]
    for a in report["assumptions"]:
        lines.append(f"| {a['what']} | {a['value']} | {a['status']} | {a['source']} |")
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    s = report["search"]
    lines += ["", f"Search: {s['evaluations']} class simulations ({s['reused']} answers reused), "
              f"{s['search_wall_s']:g} s; final pool runs {s['pool_runs_wall_s']:g} s"
              + (f"; {s['wall_s']:g} s in all." if s.get("wall_s") else "."), ""]
    return "\n".join(lines)


def _plan_lines(report: Mapping[str, Any]) -> list[str]:
    """The recommended plan model by model (sims.report.recommended_plan); **bold**: a figure past its bound."""
    plan = report.get("recommended")
    if not plan:
        return ["## The recommended plan, model by model", "", "No policy met the target, so none is recommended.", ""]
    under = plan["under_target"]
    gpus = f"{plan['gpus']} {report['gpu'].upper()}{'s' * (plan['gpus'] != 1)}"
    lines = [f"## The recommended plan, model by model: {plan['policy']} on {gpus}",
             "", (f"{len(under)} of {len(plan['rows'])} models under the {report['slo_target']:.1%} target: "
                  f"{', '.join(under)}." if under else f"Every model at or over the {report['slo_target']:.1%} target.")
             + " **Bold**: under the target, or a percentile over the model's SLO.", "",
             "| model | requests | attainment | TTFT SLO s | TTFT p50 / p90 / p99 s | TPOT SLO ms | "
             "TPOT p50 / p90 / p99 ms |", "|---|---|---|---|---|---|---|"]
    for r in plan["rows"]:
        if "attainment" not in r:
            lines.append(f"| {r['model']} | 0 | - | {r['ttft_slo_ms'] / 1e3:g} | - | {r['tpot_slo_ms']:g} | - |")
            continue

        def fig(key: str, text: str) -> str:
            return f"**{text}**" if key in r["misses"] else text

        ttft = " / ".join(fig(f"p{q}_ttft_ms", f"{r[f'p{q}_ttft_ms'] / 1e3:,.2f}") for q in (50, 90, 99))
        tpot = " / ".join(fig(f"p{q}_tpot_ms", f"{r[f'p{q}_tpot_ms']:,.1f}") for q in (50, 90, 99))
        attained = fig("attainment", f"{r['attainment']:.2%}")
        lines.append(f"| {r['model']} | {r['requests']}{' (few)' if r['few_requests'] else ''} | {attained} | "
                     f"{r['ttft_slo_ms'] / 1e3:g} | {ttft} | {r['tpot_slo_ms']:g} | {tpot} |")
    return lines + [""]


def _seed_lines(report: Mapping[str, Any]) -> list[str]:
    st = report["stability"]
    if len(st["seeds"]) < 2:
        return []
    lines = ["| policy | " + " | ".join(f"seed {s}" for s in st["seeds"]) + " | spread |",
             "|---|" + "---|" * (len(st["seeds"]) + 1)]
    for policy, gpus in st["gpus_by_seed"].items():
        lo, hi = st["spread"][policy]
        cells = [f"{g}{'' if ok else ' (unmet)'}" for g, ok in zip(gpus, st["met_by_seed"][policy])]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {lo if lo == hi else f'{lo}-{hi}'} |")
    return lines + [""]


def _layout_text(layout: Mapping[str, Any]) -> str:
    if "replicas" in layout:
        return f"TP{layout['tp']}: {layout['instances']} instances"
    parts = [f"{layout[k]}{k[0].upper()}" for k in ("prefill", "decode", "mixed") if layout.get(k)]
    return f"TP{layout['tp']}: " + "+".join(parts or ["0"])


def write_csvs(report: Mapping[str, Any], out: Path) -> list[Path]:
    """capacity.csv (per GPU type and policy), per_model.csv, curves.csv (every point simulated)."""
    paths = [out / "capacity.csv", out / "per_model.csv", out / "curves.csv"]
    rows = []
    for gpu, t in report["gpu_types"].items():
        for policy, e in t.get("policies", {}).items():
            row = {"gpu": gpu, "policy": policy, "gpus": e["gpus"], "met": e["met"], "attainment": e["attainment"],
                   "usd_per_month": e["usd_per_month"]}
            main = report["policies"].get(policy) if gpu == report["gpu"] else None
            for key in ("aegaeon_attainment", "per_request_attainment", "p99_ttft_ms", "p99_tpot_ms", "models_per_gpu",
                        "savings_vs_dedicated", "gpu_busy_share", "switches_per_gpu_per_minute", "output_tokens_per_s",
                        "per_user_output_tokens_per_s"):
                row[key] = main.get(key) if main else None
            rows.append(row)
    _write(paths[0], rows)
    flat = []
    for r in report["per_model"]:
        row = {k: v for k, v in r.items() if not isinstance(v, dict)}
        for policy in report["policies"]:
            for key, value in (r.get(policy) or {}).items():
                row[f"{policy}_{key}"] = value
        flat.append(row)
    _write(paths[1], flat)
    _write(paths[2], [{**r, "slo_scale": "x".join(f"{v:g}" for v in r["slo_scale"])} for r in report["curves"]])
    return paths


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    fields: dict[str, None] = {}
    for row in rows:
        fields.update(dict.fromkeys(row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)


def summary_rows(report: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """(policy, GPUs, vs dedicated, $/month, attainment, p99 TTFT, p99 TPOT) for a terminal table."""
    out: list[tuple[str, ...]] = []
    for policy, e in report["policies"].items():
        saving = "-" if e["savings_vs_dedicated"] is None else f"{-e['savings_vs_dedicated']:+.0%}"
        out.append((policy + ("" if e["met"] else " (unmet)"), str(e["gpus"]), saving, f"${e['usd_per_month']:,.0f}",
                    f"{e['attainment']:.2%}", f"{e['p99_ttft_ms']:,.0f}", f"{e['p99_tpot_ms']:.1f}"))
    return out


def _sensitivity(report: Mapping[str, Any]) -> list[str]:
    """The answer if the least certain terms are worse (sims.sensitivity), as a section; none if not searched."""
    entry = report.get("sensitivity")
    if not entry:
        return []
    lines = ["## Sensitivity", "", entry["line"], "",
             f"| policy | GPUs | GPUs, {entry['worse_by']:.0%} worse |", "|---|---|---|"]
    for policy, e in entry["policies"].items():
        lines.append(f"| {policy} | {e['gpus']}{'' if e['met'] else ' (unmet)'} | "
                     f"{e['worse_gpus']}{'' if e['worse_met'] else ' (unmet)'} |")
    return lines + ["", f"Terms made worse: {', '.join(entry['terms'])} (rates lower, overheads higher).", ""]
