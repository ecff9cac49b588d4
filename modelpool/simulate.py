"""`modelpool simulate`: replay a workload through one policy on a virtual clock."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from modelpool.config import FleetFileError, load_fleet

console = Console()


def simulate_command(
    fleet_path: Path = typer.Option(Path("models.yaml"), "--fleet", "-f", help="Fleet file."),
    trace: str = typer.Option("fleet", "--trace", "-t", help="A CSV/JSONL path, a trace name (`modelpool traces`) or "
                              "spec (`sims.traces`); `fleet` = Poisson at each model's traffic hint, ShareGPT lengths."),
    policy: str = typer.Option("token-level", "--policy", "-p", help="dedicated | request-level | spatial | token-level"),
    gpus: int | None = typer.Option(None, "--gpus", help="GPUs in the pool (default: the fleet's pool.num_gpus, or "
                                    "the fewest the policy can run on when that is more: dedicated, one per model)."),
    duration: float = typer.Option(600.0, "--duration", help="Seconds of workload for `fleet` and synthetic traces."),
    seed: int = typer.Option(0, "--seed", help="Seed for generated workloads."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for metrics.json and requests.csv."),
    plan_log: Path | None = typer.Option(None, "--plan-log", help="Write every Plan as JSONL here."),
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="Skip (and count) malformed trace rows."),
    policy_option: list[str] = typer.Option([], "--policy-option", metavar="KEY=VALUE",
                                            help="A keyword of the policy, repeatable: e.g. -o min_turn_tpot=0 "
                                                 "(token-level's quota formula alone), -o first_tokens=1."),
    profile: str = typer.Option("default", "--profile", help="Calibration profile: a shipped name (default, "
                                "h200-cudagraph, h200-eager) or a JSON file (`modelpool calibrate` writes one)."),
    force_profile: bool = typer.Option(False, "--force-profile", help="Use --profile even where it was measured on a "
                                       "CPU and the pool's GPU is a catalogue GPU (refused otherwise): the CPU's step "
                                       "times then stand for the GPU's, with a warning."),
    layout: str | None = typer.Option(None, "--layout", help="The pool's cut instead of --gpus: a capacity report "
                                      "(capacity-report/report.json: the --policy answer's instances) or "
                                      "TP1:4P+4D,TP2:2M,TP4:1M (P prefill, D decode, M mixed; every TP class of the "
                                      "fleet). Default: the GPUs cut by traffic share and pool.prefill_fraction."),
) -> None:
    """Simulate a policy on a fleet and a trace; print latency and SLO figures."""
    from sims.metrics import request_rows
    from sims.costmodel import RooflineCostModel
    from sims.profiles import load_profile
    from sims.run import compiled, fleet_workload_spec, pool_size, simulate
    from sims.workload import TraceError

    try:
        fleet = load_fleet(fleet_path)
    except FleetFileError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    try:
        options = policy_options(policy, policy_option)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    spec = fleet_workload_spec(fleet, duration) if trace == "fleet" else trace
    names = [m.name for m in fleet.models]
    try:
        from sims.traces import load_workload

        workload = load_workload(spec, names, seed=seed, skip_bad_rows=skip_bad_rows)
    except TraceError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        calibration = load_profile(profile)
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: --profile: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        mismatch = profile_device_check(calibration, fleet.pool.gpu, profile, force_profile)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if mismatch:
        console.print(mismatch, markup=False, highlight=False, soft_wrap=True)
    instances = None
    if layout is not None:
        instances, gpus = _layout_instances(fleet, layout, policy, gpus, options)
        sized = None
    else:
        gpus, sized = pool_size(fleet, policy, gpus)
    for note in ([sized] if sized else []) + list(workload.notes):
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    log = plan_log.open("w") if plan_log else None
    started = time.perf_counter()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s simulated"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(f"{policy} on {len(workload)} requests", total=workload.duration_s)
        try:
            result = simulate(fleet, workload, policy, num_gpus=gpus, plan_log=log, instances=instances,
                              costs=RooflineCostModel(fleet, profile=calibration),
                              progress=lambda now: bar.update(task, completed=min(now, workload.duration_s)), **options)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except TypeError as exc:  # an unknown policy keyword, under the compiled build (see policy_options)
            if not options or "keyword argument" not in str(exc):
                raise
            typer.echo(f"error: --policy-option: {exc}", err=True)
            raise typer.Exit(1) from None
        finally:
            if log:
                log.close()
    wall = time.perf_counter() - started
    metrics = {**result.metrics, "policy": policy, "policy_options": options, "num_gpus": result.num_gpus, "trace": spec,
               "num_requests": len(workload), "wall_s": round(wall, 3), "compiled": compiled(),
               "profile": {**calibration.summary(fleet.pool.gpu), "source": profile},
               "notes": ([sized] if sized else []) + result.notes + list(workload.notes)}
    metrics["workload"] = workload_text(trace, workload)
    metrics["layout"] = layout_text(result.instances)
    metrics["layout_source"] = "--layout" if layout is not None else "cut"
    console.print(_summary_table(metrics))
    console.print(f"{len(workload)} requests, {workload.duration_s:.0f} s of traffic simulated in {wall:.1f} s")
    console.print(profile_line(metrics["profile"]))
    hint = shortfall_hint(metrics, fleet.pool.gpu)
    if hint:
        console.print(hint, markup=False, highlight=False, soft_wrap=True)
    if not metrics["compiled"] and wall > 60:
        console.print("the compiled build simulates ~6x faster (token-level): "
                      "MODELPOOL_MYPYC=1 pip install --no-build-isolation .  (needs mypy and a C compiler; README)")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=float))
        rows = request_rows(result.records.values(), {m.name: (fleet.slo(m).ttft_s, fleet.slo(m).tpot_s) for m in fleet.models})
        with (out / "requests.csv").open("w", newline="") as handle:
            if rows:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        console.print(f"wrote {out / 'metrics.json'} and {out / 'requests.csv'}")


# set by `simulate` from the fleet file (or by the simulator itself), not from the command line
_FIXED_OPTIONS = {"rng", "max_batch_size", "max_prefill_tokens", "keep_ended"}


def policy_options(policy: str, pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings as keyword arguments of `policy`'s class; a value is read as JSON (numbers, true,
    false, null) and else kept as a string. Unknown or fixed keys are refused by name (an unknown policy is
    left to `make_scheduler`, which names the choices)."""
    import inspect

    from scheduler import POLICIES

    cls = POLICIES.get(policy)
    params = inspect.signature(cls.__init__).parameters.values() if cls is not None else ()
    # the compiled build's constructors show only (*args, **kwargs): the policy itself then refuses unknown keys
    opaque = cls is None or any(p.kind is p.VAR_KEYWORD for p in params)
    accepted = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in _FIXED_OPTIONS]
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--policy-option {pair!r}: expected KEY=VALUE")
        if key in _FIXED_OPTIONS:
            raise ValueError(f"--policy-option {key}: set from the fleet file's pool section or by the simulator, "
                             f"not here")
        if key not in accepted and not opaque:
            raise ValueError(f"--policy-option {key}: {policy} takes {', '.join(accepted) or 'no options'}")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


SHORTFALL = 0.9  # below this per-request attainment, a run says the pool falls short and what to run


def shortfall_hint(m: dict[str, Any], gpu: str) -> str | None:
    """What to run when most requests miss: the pool is too small or cut wrongly for the traffic (the default
    cut goes by traffic share, not by load), and `modelpool capacity` is the command that sizes and cuts it."""
    if m["slo_attainment"] >= SHORTFALL or not m["num_requests"]:
        return None
    how = ("as given by --layout" if m.get("layout_source") == "--layout" else
           "cut by traffic share and pool.prefill_fraction")
    return (f"note: only {m['slo_attainment']:.0%} of requests met their SLO (TTFT p50 {m['p50_ttft_ms'] / 1e3:,.1f} s): "
            f"{m['num_gpus']} {gpu.upper()}s under {m['policy']}, {how} ({m['layout']}), fall short of this traffic. "
            f"`modelpool capacity` finds the fewest GPUs each policy needs to meet a target and how to cut them per "
            f"TP class; then `modelpool simulate --layout capacity-report/report.json` runs its answer as one pool.")


def layout_text(instances: Any) -> str:
    """The pool's instances per TP class in the report's label form: `TP1: 2P+2D, TP4: 1M`."""
    counts: dict[int, dict[str, int]] = {}
    for spec in instances:
        counts.setdefault(spec.tp, {"prefill": 0, "decode": 0, "mixed": 0})[spec.role] += 1
    return ", ".join(f"TP{tp}: " + "+".join(f"{n}{role[0].upper()}" for role, n in c.items() if n)
                     for tp, c in sorted(counts.items()))


def _layout_instances(fleet: Any, value: str, policy: str, gpus: int | None,
                      options: dict[str, Any]) -> tuple[list[Any], int]:
    """`--layout`'s instances and their GPUs; dedicated's per-model replicas go into `options`. A bad layout, or
    --gpus that disagrees with it, ends the command."""
    from modelpool.layout import LayoutError, pool_layouts
    from sims.capacity_eval import build_instances

    try:
        layouts = pool_layouts(value, policy, [m.tp for m in fleet.models])
    except LayoutError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    total = sum(layout.gpus for layout in layouts)
    if gpus is not None and gpus != total:
        typer.echo(f"error: --gpus {gpus} but --layout {value} has {total} GPUs: give one of them", err=True)
        raise typer.Exit(1)
    replicas = {name: n for layout in layouts for name, n in layout.replicas}
    if replicas:
        options["replicas"] = replicas
    return [spec for layout in layouts for spec in build_instances(fleet, layout)], total


def workload_text(trace: str, workload: Any) -> str:
    """The workload in words: the fleet's traffic hints are named as such, any other spec is given whole."""
    if trace != "fleet":
        return workload.source
    return (f"each model's traffic hint (Poisson, {workload.rate_per_s:.2f} req/s in all), ShareGPT lengths, "
            f"{workload.duration_s:g} s")


def _summary_table(m: dict) -> Table:
    table = Table(title=f"{m['policy']} on {m['num_gpus']} GPUs")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("workload", m["workload"]),
        ("instances per TP class", m["layout"]),
        ("completed / failed", f"{m['completed']} / {m['failed']}"),
        ("SLO attainment, per request (TTFT and mean TPOT)", f"{m['slo_attainment']:.2%}"),
        ("SLO attainment, Aegaeon (token deadlines)", f"{m['aegaeon_slo_attainment']:.2%}"),
        ("TTFT p50 / p90 / p99 ms", f"{m['p50_ttft_ms']:.0f} / {m['p90_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f}"),
        ("TPOT p50 / p90 / p99 ms", f"{m['p50_tpot_ms']:.1f} / {m['p90_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f}"),
        ("ITL p99 ms", f"{m['p99_itl_ms']:.1f}"),
        ("aggregate output tokens/s (whole pool)", f"{m['output_throughput']:.1f}"),
        ("per-user output tokens/s (mean stream)", f"{m['per_user_output_tokens_per_s']:.1f}"),
        ("request goodput req/s", f"{m['request_goodput']:.3f}"),
        ("GPU busy share", f"{m.get('gpu_busy_share', 0.0):.1%}"),
        ("model switches (per GPU per minute)", f"{m.get('num_switches', 0)} ({m.get('switches_per_gpu_per_minute', 0.0):.2f})"),
        ("KV moved GB", f"{m.get('kv_bytes_moved', 0) / 1e9:.1f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def profile_device_check(profile: Any, gpu: str, source: str, force: bool = False) -> str | None:
    """A warning when `profile` (loaded from `source`) was calibrated on another device than GPU type `gpu`;
    ValueError when it was measured on a CPU and `gpu` is a catalogue GPU (a CPU's step times say nothing
    of a GPU's: the simulation would report a pool that cannot serve anything), unless `force`
    (`--force-profile`), which turns the refusal into a warning. None when they agree or the profile was not
    written by `modelpool calibrate` (its provenance line says what it is)."""
    from scheduler.fleet import GPUS

    run = profile.calibration
    if run is None or run.gpu == gpu.lower():
        return None
    measured = f"{run.device} (calibrated as GPU type {run.gpu})"
    if "cpu" in run.device.lower() and gpu.lower() in GPUS:
        if force:
            return (f"warning: --profile {source} was measured on {measured}, but the fleet runs on {gpu.upper()}; "
                    f"used anyway (--force-profile): the CPU's step times stand for the {gpu.upper()}'s, so the "
                    f"figures describe that CPU, not a {gpu.upper()}")
        raise ValueError(f"--profile {source} was measured on {measured}, but the fleet runs on {gpu.upper()}: a "
                         f"CPU's step times say nothing of a {gpu.upper()}'s. Use a profile measured on a "
                         f"{gpu.upper()} (`modelpool calibrate --device cuda` there) or the shipped default, or "
                         f"simulate a fleet whose pool.gpu is {run.gpu} (examples/cpu.yaml), or pass "
                         f"--force-profile to use it anyway")
    return (f"warning: --profile {source} was measured on {measured}, not on {gpu.upper()}: its measured terms "
            f"count on {gpu.upper()} only as estimates (efficiencies by datasheet ratios, times carried over)")


def profile_line(summary: dict[str, Any]) -> str:
    """One line on the profile a run used: how much of it was measured on the fleet's GPU, and where."""
    measured, gpu = summary["terms_measured_here"], summary["gpu"]
    total = len(measured) + len(summary["terms_estimated"])
    run = summary["calibration"]
    where = f"; calibrated on {run['device']} ({run['gpu']}) at {run['measured_at']}" if run else ""
    return f"profile {summary['name']}: {len(measured)} of {total} terms measured on {gpu}{where}"
