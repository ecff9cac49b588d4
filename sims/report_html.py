"""The capacity report as one self-contained HTML page: inline CSS, matplotlib figures as base64 PNGs.

Nothing is fetched when the page opens (no scripts, fonts or images from
elsewhere), so the file can be mailed or attached to a ticket as it is.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sims.capacity_study import NO_SCALE, StudyResult  # noqa: E402
from sims.report_text import floor_line  # noqa: E402

COLOURS = {"dedicated": "#7f7f7f", "request-level": "#1f77b4", "spatial": "#ff7f0e", "token-level": "#2ca02c"}
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem auto;max-width:1200px;
color:#222;line-height:1.45;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}
.headline{font-size:1.25rem;background:#eef7ee;border-left:5px solid #2ca02c;padding:.8rem 1rem;margin:1rem 0}
.stability{background:#fff7e6;border-left:5px solid #b36b00;padding:.6rem 1rem;margin:1rem 0}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:.8rem;margin:.5rem 0;width:100%}
th,td{border:1px solid #ddd;padding:.25rem .4rem;text-align:right;vertical-align:top}
td{white-space:nowrap}td.l{white-space:normal;overflow-wrap:break-word}.anywhere td.l{overflow-wrap:anywhere}
th{background:#f4f4f4}td.l,th.l{text-align:left}.unmet{color:#b00}
td.miss{background:#fde2e2;color:#900;font-weight:600}td.few{color:#b36b00}
.status-measured{color:#1a7f1a;font-weight:600}.status-estimated{color:#b36b00;font-weight:600}
.status-input{color:#555}figure{margin:1rem 0}figure img{max-width:100%}figcaption{font-size:.85rem;color:#555}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:1rem}small{color:#666}
table.fixed{table-layout:fixed}.models td:first-child,.nw{white-space:nowrap}.policies td:last-child{min-width:13em}
"""


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def figures(report: Mapping[str, Any], result: StudyResult) -> dict[str, str]:
    """name -> base64 PNG."""
    out = {"headline": _headline_figure(report), "attainment": _attainment_figure(report, result),
           "latency": _cdf_figure(report, result), "utilisation": _utilisation_figure(report)}
    if len(report["gpu_types"]) > 1:
        out["gpu_types"] = _gpu_types_figure(report)
    return out


def _headline_figure(report: Mapping[str, Any]) -> str:
    policies = report["policies"]
    names = list(policies)
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(names)))
    gpus = [policies[p]["gpus"] for p in names]
    ax.barh(names, gpus, color=[COLOURS.get(p, "#555") for p in names])
    for k, p in enumerate(names):
        e = policies[p]
        ax.text(e["gpus"], k, f"  {e['gpus']} GPUs, ${e['usd_per_month']:,.0f}/month{'' if e['met'] else ' (unmet)'}",
                va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(gpus + [1]) * 1.45)
    ax.set_xlabel(f"{report['gpu'].upper()} GPUs to meet {report['slo_target']:.0%} ({report['slo_metric']})")
    ax.spines[["top", "right"]].set_visible(False)
    return _png(fig)


def _attainment_figure(report: Mapping[str, Any], result: StudyResult) -> str:
    classes = sorted({r["tp"] for r in report["curves"]})
    metric = report["slo_metric"]
    key = "aegaeon_attainment" if metric == "aegaeon" else "attainment"
    fig, axes = plt.subplots(1, len(classes), figsize=(4.2 * len(classes), 3.6), squeeze=False)
    low = 1e-4
    for ax, tp in zip(axes[0], classes):
        for policy in report["policies"]:
            best: dict[int, tuple[float, bool]] = {}
            for r in report["curves"]:
                if r["tp"] != tp or r["policy"] != policy or r["gpu"] != report["gpu"] or r["slo_scale"] != list(NO_SCALE):
                    continue
                value = r[key]
                if value is None or (isinstance(value, float) and math.isnan(value)):
                    continue
                upper = r["stopped_early_at_s"] is not None
                if r["gpus"] not in best or value > best[r["gpus"]][0]:
                    best[r["gpus"]] = (value, upper)
            if not best:
                continue
            xs = sorted(best)
            ys = [min(max(best[x][0], low), 1 - low) for x in xs]
            colour = COLOURS.get(policy, "#555")
            ax.plot(xs, ys, "-", color=colour, alpha=0.6, label=policy)
            ax.scatter([x for x in xs if not best[x][1]], [y for x, y in zip(xs, ys) if not best[x][1]], color=colour, s=18)
            ax.scatter([x for x in xs if best[x][1]], [y for x, y in zip(xs, ys) if best[x][1]], marker="v",
                       facecolors="none", edgecolors=colour, s=26)
            layout = next((x for x in report["policies"][policy]["layout"] if x["tp"] == tp), None)
            if layout:
                answer = layout["gpus"]
                if answer in best:
                    ax.scatter([answer], [min(max(best[answer][0], low), 1 - low)], marker="*", s=140, color=colour,
                               edgecolors="black", linewidths=0.5, zorder=5)
        ax.axhline(report["slo_target"], color="#b00", lw=0.8, ls="--")
        ax.set_yscale("logit")
        ax.set_ylim(0.3, 1 - low)
        ticks = [0.5, 0.9, 0.99, 0.999, 0.9999]
        ax.set_yticks(ticks, [f"{t:.2%}".rstrip("0").rstrip(".") for t in ticks])
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        models = len(result.infos[report["gpu"]][tp].models)
        ax.set_title(f"TP{tp} class: {models} model{'s' * (models != 1)}", fontsize=10)
        ax.set_xlabel("GPUs of this class")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"SLO attainment ({metric}, logit scale)")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _png(fig)


def _cdf_figure(report: Mapping[str, Any], result: StudyResult) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for policy, run in result.pool_runs.items():
        colour = COLOURS.get(policy, "#555")
        for ax, samples in ((left, run.ttft_s), (right, run.tpot_s)):
            if len(samples):
                ax.plot(np.maximum(samples, 1e-4), np.arange(1, len(samples) + 1) / len(samples), color=colour,
                        label=f"{policy} ({report['policies'][policy]['gpus']} GPUs)")
    per_model = next(iter(result.pool_runs.values())).metrics["per_model"] if result.pool_runs else {}
    slos = ({f["ttft_slo_ms"] / 1e3 for f in per_model.values()}, {f["tpot_slo_ms"] / 1e3 for f in per_model.values()})
    for ax, name, values in ((left, "TTFT", slos[0]), (right, "TPOT", slos[1])):
        for value in sorted(values):
            ax.axvline(value, color="#b00", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (s, log scale){' - dashed: SLO' if values else ''}")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
    left.set_title("Time to first token at each policy's answer", fontsize=10)
    right.set_title("Mean time per output token", fontsize=10)
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _png(fig)


def _utilisation_figure(report: Mapping[str, Any]) -> str:
    policies = report["policies"]
    names = list(policies)
    colours = [COLOURS.get(p, "#555") for p in names]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    panels = ((axes[0], [policies[p]["gpu_busy_share"] * 100 for p in names], "GPU busy share (%)"),
              (axes[1], [policies[p]["switches_per_gpu_per_minute"] for p in names], "model switches per GPU per minute"))
    for ax, values, label in panels:
        ax.bar(names, values, color=colours)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax = axes[2]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [policies[p]["output_tokens_per_s"] for p in names], 0.4, color=colours, label="whole pool")
    twin = ax.twinx()
    twin.bar(x + 0.2, [policies[p]["per_user_output_tokens_per_s"] for p in names], 0.4, color=colours, alpha=0.45,
             hatch="//", label="one stream")
    ax.set_xticks(x, names, rotation=20, fontsize=8)
    ax.set_ylabel("pool output tokens/s (solid)")
    twin.set_ylabel("per-user tokens/s (hatched)")
    ax.set_title("aggregate vs per-user output tokens/s", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _gpu_types_figure(report: Mapping[str, Any]) -> str:
    types = {g: t for g, t in report["gpu_types"].items() if "policies" in t}
    names = [p for p in report["policies"]]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / max(1, len(names))
    for k, policy in enumerate(names):
        xs = np.arange(len(types)) + (k - (len(names) - 1) / 2) * width
        ys = [t["policies"].get(policy, {}).get("usd_per_month", 0) / 1e3 for t in types.values()]
        ax.bar(xs, ys, width, color=COLOURS.get(policy, "#555"), label=policy)
    ax.set_xticks(np.arange(len(types)), [g.upper() for g in types])
    ax.set_ylabel("thousand USD a month")
    ax.set_title("The same fleet and SLO on each GPU type", fontsize=10)
    ax.legend(fontsize=8)
    return _png(fig)


# ---- the page -----------------------------------------------------------------------------------------------

def to_html(report: Mapping[str, Any], images: Mapping[str, str]) -> str:
    e = html.escape
    gpu = report["gpu"].upper()
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
             f"<title>Capacity report: {report['fleet']['num_models']} models on {e(gpu)}</title><style>{_CSS}</style>"
             f"</head><body>",
             f"<h1>Capacity report: {report['fleet']['num_models']} models on {e(gpu)}</h1>",
             f"<small>{e(report['generated_by'])}</small>",
             f"<div class='headline'>{e(report['headline']['sentence'])}.</div>",
             f"<div class='stability' id='stability'>{e(report['stability']['sentence'])}</div>",
             _seed_table(report),
             f"<p>{e(floor_line(report))}</p>",
             f"<p>Target: <b>{report['slo_target']:.1%}</b> SLO attainment under the <b>{e(report['slo_metric'])}</b> "
             f"metric: {e(report['slo_metric_definition'])}. Workload: {e(report['workload']['description'])}, "
             f"{report['workload']['num_requests']} requests over {report['workload']['duration_s']:g} s "
             f"({report['workload']['rate_rps']:g} req/s).</p>",
             _img(images, "headline", "GPUs each policy needs to meet the target, and what they cost a month."),
             "<h2>Policies</h2>", _policy_table(report),
             *[f"<p class='unmet'>Target not met: {e(x['unmet_reason'])}.</p>" for x in report["policies"].values()
               if x.get("unmet_reason")],
             "<p><small>Pool output tokens/s counts every token the pool produces per second; tokens/s per user is "
             "what one stream sees (1 / its mean TPOT). They differ by the number of concurrent streams.</small></p>",
             *_plan_section(report),
             "<h2 id='per-model'>Per model: SLO results at each policy's answer</h2>", _misses_line(report),
             _model_table(report),
             "<h2>SLO attainment vs GPUs</h2>",
             _img(images, "attainment", "Every class layout the search simulated (the best split per GPU count); "
                  "stars mark the answers; hollow triangles are runs stopped once sure to miss (at most that value); "
                  "dashed: the target."),
             "<h2>Latency at each policy's answer</h2>",
             _img(images, "latency", "Distributions over every completed request of the whole pool."),
             "<h2>Utilisation</h2>", _img(images, "utilisation", "GPU busy share, model switches, and the two "
                                          "token rates people confuse.")]
    if "gpu_types" in images:
        parts += ["<h2>GPU types</h2>", _gpu_table(report), _img(images, "gpu_types", "Monthly cost per GPU type.")]
    if report["tries"]:
        parts += ["<h2>Try</h2><ul>"] + [f"<li>{e(t)}</li>" for t in report["tries"]] + ["</ul>"]
    parts += _sensitivity(report)
    parts += ["<h2>Assumptions</h2>", _assumption_table(report)]
    if report["notes"]:
        parts += ["<h2>Notes</h2><ul>"] + [f"<li>{e(n)}</li>" for n in report["notes"]] + ["</ul>"]
    s = report["search"]
    parts.append(f"<p><small>Search: {s['evaluations']} class simulations ({s['reused']} reused), "
                 f"{s['search_wall_s']:g} s; final pool runs {s['pool_runs_wall_s']:g} s.</small></p></body></html>")
    return "\n".join(parts)


def _img(images: Mapping[str, str], name: str, caption: str) -> str:
    if name not in images:
        return ""
    return (f"<figure><img alt='{html.escape(name)}' src='data:image/png;base64,{images[name]}'>"
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _policy_table(report: Mapping[str, Any]) -> str:
    head = ["policy", "GPUs", "vs dedicated", "$/month", "attainment", "Aegaeon metric", "p99 TTFT ms", "p99 TPOT ms",
            "models/GPU", "GPU busy", "switches/GPU/min", "pool tok/s", "tok/s per user", "layout"]
    rows = []
    for policy, e in report["policies"].items():
        saving = "-" if e["savings_vs_dedicated"] is None else f"{-e['savings_vs_dedicated']:+.0%}"
        layout = _Raw("<br>".join(html.escape(_layout(x)) for x in e["layout"]))
        name = _Raw(f"<span class='nw'>{html.escape(policy)}</span>"
                    + ("" if e["met"] else " <span class='unmet'>(target not met)</span>"))
        rows.append([name, e["gpus"], saving, f"{e['usd_per_month']:,.0f}", f"{e['attainment']:.2%}",
                     f"{e['aegaeon_attainment']:.2%}", f"{e['p99_ttft_ms']:,.0f}", f"{e['p99_tpot_ms']:.1f}",
                     f"{e['models_per_gpu']:.2f}", f"{e['gpu_busy_share']:.0%}", f"{e['switches_per_gpu_per_minute']:.1f}",
                     f"{e['output_tokens_per_s']:,.0f}", f"{e['per_user_output_tokens_per_s']:.1f}", layout])
    return _table(head, rows, left=(0, 13), css="policies")


def _layout(layout: Mapping[str, Any]) -> str:
    if "replicas" in layout:
        return f"TP{layout['tp']}: {layout['instances']} instances ({layout['gpus']} GPUs)"
    parts = [f"{layout[k]} {k}" for k in ("prefill", "decode", "mixed") if layout.get(k)]
    return f"TP{layout['tp']}: " + " + ".join(parts) + f" ({layout['gpus']} GPUs)"


def _gpu_table(report: Mapping[str, Any]) -> str:
    names = list(report["policies"])
    head = ["GPU", "$/GPU-hour", "memory GB", "BF16 TFLOPS"] + [f"{p} GPUs / $ a month" for p in names]
    rows = []
    for gpu, t in report["gpu_types"].items():
        row: list[Any] = [gpu, f"{t['usd_per_gpu_hour']:g}", f"{t['memory_gb']:g}", f"{t['bf16_tflops']:g}"]
        for p in names:
            if "skipped" in t:
                row.append("does not fit")
                continue
            x = t["policies"].get(p)
            row.append("-" if x is None else f"{x['gpus']} / {x['usd_per_month']:,.0f}" + ("" if x["met"] else " (unmet)"))
        rows.append(row)
    return _table(head, rows, left=(0,))


def _misses_line(report: Mapping[str, Any]) -> str:
    """Who misses the target on their own, policy by policy (the table below highlights the same cells)."""
    target, total = report["slo_target"], len(report["per_model"])
    lines = []
    for policy, names in report["model_misses"].items():
        if names:
            lines.append(f"<li class='unmet'>{html.escape(policy)}: {len(names)} of {total} models under "
                         f"{target:.1%} ({html.escape(_some(names))})</li>")
        else:
            lines.append(f"<li>{html.escape(policy)}: every model at or over {target:.1%}</li>")
    return "<ul>" + "".join(lines) + "</ul>"


def _plan_section(report: Mapping[str, Any]) -> list[str]:
    """The recommended plan model by model (sims.report.recommended_plan): attainment and TTFT / TPOT p50, p90,
    p99 against each model's SLO, every figure past its bound highlighted, the models that miss on top."""
    plan = report.get("recommended")
    if not plan:
        return ["<h2 id='plan'>The recommended plan, model by model</h2>",
                "<p class='unmet'>No policy met the target, so none is recommended: the per-model table below shows "
                "where each falls short.</p>"]
    e, target = html.escape, report["slo_target"]
    title = (f"The recommended plan, model by model: {e(plan['policy'])} on {plan['gpus']} "
             f"{e(report['gpu'].upper())}{'s' * (plan['gpus'] != 1)}")
    under, slow = plan["under_target"], plan["over_slo_only"]
    if under:
        said = (f"<p class='unmet'>{len(under)} of {len(plan['rows'])} models under the {target:.1%} target on their "
                f"own: {e(_some(under))}.")
    else:
        said = f"<p>Every model at or over the {target:.1%} target on its own."
    if slow:
        said += f" {len(slow)} more with a latency percentile over its SLO: {e(_some(slow))}."
    said += (" Highlighted: attainment under the target, and each percentile over the model's SLO (TPOT: each "
             "request's mean time per output token). Models that miss come first.</p>")
    head = ["model", "TP", "requests", "attainment", "TTFT SLO s", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s",
            "TPOT SLO ms", "TPOT p50 ms", "TPOT p90 ms", "TPOT p99 ms"]
    rows = []
    for r in plan["rows"]:
        few = r["few_requests"]
        row: list[Any] = [r["model"], r["tp"], _Cell(f"{r['requests']}{' (few)' if few else ''}", "few" if few else "")]
        if "attainment" not in r:  # no requests of this model in the workload
            rows.append(row + ["-", f"{r['ttft_slo_ms'] / 1e3:g}", *["-"] * 3, f"{r['tpot_slo_ms']:g}", *["-"] * 3])
            continue

        def fig(key: str, text: str) -> _Cell:
            return _Cell(text, "miss" if key in r["misses"] else "")

        row.append(fig("attainment", f"{r['attainment']:.2%}"))
        row.append(f"{r['ttft_slo_ms'] / 1e3:g}")
        row += [fig(f"p{q}_ttft_ms", f"{r[f'p{q}_ttft_ms'] / 1e3:,.2f}") for q in (50, 90, 99)]
        row.append(f"{r['tpot_slo_ms']:g}")
        row += [fig(f"p{q}_tpot_ms", f"{r[f'p{q}_tpot_ms']:,.1f}") for q in (50, 90, 99)]
        rows.append(row)
    return [f"<h2 id='plan'>{title}</h2>", said, _table(head, rows, left=(0,), css="models plan")]


def _some(names: list[str], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _model_table(report: Mapping[str, Any]) -> str:
    """Every model's SLO result under every policy (attainment, p99 TTFT / TPOT against its SLO); misses
    highlighted, models with too few requests to judge marked."""
    policies = list(report["policies"])
    need = report["stability"]["min_requests_to_judge"]
    head = ["model", "TP", "requests", "req/s", "SLO TTFT s / TPOT ms", "dedicated GPUs"]
    head += [f"{p}: attainment, p99 TTFT s / TPOT ms" for p in policies]
    rows = []
    for r in report["per_model"]:
        few = r["requests"] < need
        row: list[Any] = [r["model"], r["tp"],
                          _Cell(f"{r['requests']}{' (few)' if few else ''}", "few" if few else ""),
                          f"{r['rate_rps']:.3f}", f"{r['ttft_slo_s']:g} / {r['tpot_slo_ms']:g}", r["dedicated_gpus"] or "-"]
        for p in policies:
            x = r.get(p)
            if not x:
                row.append("-")
                continue
            miss = x["attainment"] < report["slo_target"]
            text = f"{x['attainment']:.2%}<br>{x['p99_ttft_ms'] / 1e3:,.2f} / {x['p99_tpot_ms']:,.1f}"
            row.append(_Cell(text, "miss" if miss else "", raw=True))
        rows.append(row)
    return _table(head, rows, left=(0,), css="models")


def _seed_table(report: Mapping[str, Any]) -> str:
    """GPUs per policy under each seed, when the search ran under several (`--seeds`)."""
    st = report["stability"]
    if len(st["seeds"]) < 2:
        return ""
    head = ["policy"] + [f"seed {s}" for s in st["seeds"]] + ["spread"]
    rows = []
    for policy, gpus in st["gpus_by_seed"].items():
        cells: list[Any] = [policy]
        cells += [_Cell(str(g) + ("" if ok else " (unmet)"), "" if ok else "miss")
                  for g, ok in zip(gpus, st["met_by_seed"][policy])]
        lo, hi = st["spread"][policy]
        cells.append(f"{lo}" if lo == hi else f"{lo}-{hi}")
        rows.append(cells)
    return _table(head, rows, left=(0,))


def _assumption_table(report: Mapping[str, Any]) -> str:
    rows = [[a["what"], a["value"],
             _Raw(f"<span class='status-{html.escape(a['status'])}'>{html.escape(a['status'])}</span>"), a["source"]]
            for a in report["assumptions"]]
    return _table(["what", "value", "status", "source"], rows, left=(0, 1, 2, 3), anywhere=True,
                  widths=("16%", "37%", "8%", "39%"))


class _Raw(str):
    """A table cell that is HTML already."""


class _Cell:
    """A table cell with a CSS class (a miss, too few requests); `raw` when `text` is HTML already."""

    def __init__(self, text: str, css: str = "", raw: bool = False) -> None:
        self.html = text if raw else html.escape(text)
        self.css = css


def _table(head: list[str], rows: list[list[Any]], left: tuple[int, ...] = (), anywhere: bool = False,
           css: str = "", widths: tuple[str, ...] = ()) -> str:
    """A table in a box of the page's width (it scrolls inside the box, never the page, if it cannot fit);
    `anywhere` lets long unbroken text (paths, term lists) wrap at any character rather than widen the table;
    `css` classes the table; `widths` fixes the columns' shares (a fixed layout: words wrap, not letters)."""
    def cell(tag: str, k: int, value: Any) -> str:
        classes = ["l"] if k in left else []
        if isinstance(value, _Cell):
            classes += [value.css] if value.css else []
            text = value.html
        else:
            text = value if isinstance(value, _Raw) else html.escape(str(value))
        cls = f" class='{' '.join(classes)}'" if classes else ""
        return f"<{tag}{cls}>{text}</{tag}>"
    cols = "".join(f"<col style='width:{w}'>" for w in widths)
    classes = " ".join(filter(None, [css, "fixed" if widths else ""]))
    table = (f"<table class='{classes}'>" if classes else "<table>") + (f"<colgroup>{cols}</colgroup>" if cols else "")
    out = [f"<div class='scroll{' anywhere' if anywhere else ''}'>{table}<thead><tr>"
           + "".join(cell("th", k, h) for k, h in enumerate(head)) + "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>" + "".join(cell("td", k, v) for k, v in enumerate(row)) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _sensitivity(report: Mapping[str, Any]) -> list[str]:
    """The answer if the least certain terms are worse (sims.sensitivity), as a section; none if not searched."""
    entry = report.get("sensitivity")
    if not entry:
        return []
    rows = "".join(f"<tr><td>{html.escape(policy)}</td><td>{v['gpus']}{'' if v['met'] else ' (unmet)'}</td>"
                   f"<td>{v['worse_gpus']}{'' if v['worse_met'] else ' (unmet)'}</td></tr>"
                   for policy, v in entry["policies"].items())
    return ["<h2>Sensitivity</h2>", f"<p>{html.escape(entry['line'])}</p>",
            f"<table><tr><th>policy</th><th>GPUs</th><th>GPUs, {entry['worse_by']:.0%} worse</th></tr>{rows}</table>",
            f"<p>Terms made worse: {html.escape(', '.join(entry['terms']))} (rates lower, overheads higher).</p>"]
