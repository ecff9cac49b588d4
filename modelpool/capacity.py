"""`modelpool capacity`: the fewest GPUs per policy that meet an SLO target, and the report.

Every simulation of the search is a Ray task: on a local cluster started here
(loopback, no dashboard) or on an existing one (`--address`). `--workers 0`
runs everything in this process instead (debugging, tests). The report goes
to `--out`: report.html (self-contained), report.md, report.json and CSVs.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from modelpool.config import FleetFileError, load_fleet
from modelpool.extras import installed

console = Console()
POLICIES = "dedicated,request-level,spatial,token-level"


def capacity_command(
    fleet_path: Path = typer.Option(Path("models.yaml"), "--fleet", "-f", help="Fleet file."),
    trace: str = typer.Option("fleet", "--trace", "-t", help="A CSV/JSONL path, a trace name (`modelpool traces`) or "
                              "spec (`sims.traces`); `fleet` = Poisson at each model's traffic hint, ShareGPT lengths."),
    duration: float = typer.Option(600.0, "--duration", help="Seconds of workload for `fleet` and synthetic traces."),
    seed: int = typer.Option(0, "--seed", help="Seed for generated workloads."),
    slo_target: float = typer.Option(0.99, "--slo-target", min=0.0, max=1.0, help="Share of requests (or of service "
                                     "time, with the Aegaeon metric) that must meet the SLO."),
    slo_metric: str = typer.Option("per-request", "--slo-metric", help="per-request (TTFT and mean TPOT within SLO, "
                                   "vLLM's goodput rule) | aegaeon (token deadlines, the paper's metric)."),
    policies: str = typer.Option(POLICIES, "--policies", "-p", help="Comma-separated policies to size."),
    gpu_types: str = typer.Option("", "--gpu-types", help="Comma-separated GPU types to compare, e.g. "
                                  "h20,h20-3e,h100,h200 (default: the fleet's pool.gpu). The first gets the full report."),
    address: str | None = typer.Option(None, "--address", help="Ray cluster to run on (`ray start --head` prints it); "
                                       "default: a local cluster started here."),
    workers: int | None = typer.Option(None, "--workers", min=0, help="Local Ray workers (default: one per CPU); "
                                       "0 runs every simulation in this process without Ray."),
    out: Path = typer.Option(Path("capacity-report"), "--out", "-o", help="Folder for report.html, report.md, "
                             "report.json and the CSVs."),
    what_if_tpot: float = typer.Option(2.0, "--what-if-tpot", min=0.0, help="Also size token-level with every TPOT "
                                       "SLO this many times looser (the report's 'try' line); 0 skips it."),
    window: int = typer.Option(2, "--verify-window", min=0, help="Instance counts below each answer that are "
                               "simulated to verify it (attainment is not monotone)."),
    max_instances: int = typer.Option(256, "--max-instances", min=1, help="Give up on a TP class beyond this many "
                                      "instances."),
    profile: str = typer.Option("default", "--profile", help="Calibration profile (shipped name or JSON path)."),
    seeds: int = typer.Option(1, "--seeds", min=1, help="Search again with the seeds after --seed (generated "
                              "workloads only) and report each policy's spread of GPUs; costs one search per seed."),
    sensitivity: bool = typer.Option(True, "--sensitivity/--no-sensitivity", help="Search the first GPU type again "
                                     "with eff_mem, the host link and the per-step overhead 20% worse (the report's "
                                     "sensitivity line; about doubles the search)."),
    force_profile: bool = typer.Option(False, "--force-profile", help="Use --profile even where it was measured on a "
                                       "CPU and a GPU type searched is a catalogue GPU (refused otherwise)."),
) -> None:
    """Find the fewest GPUs each policy needs to meet the SLO target; write the report (HTML, Markdown, JSON, CSV)."""
    started = time.perf_counter()
    if slo_metric not in ("per-request", "aegaeon"):
        _fail(f"--slo-metric must be per-request or aegaeon, got {slo_metric!r}")
    try:
        fleet = load_fleet(fleet_path)
    except FleetFileError as exc:
        _fail(str(exc))
    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    unknown = sorted(set(chosen) - set(POLICIES.split(",")))
    if unknown or not chosen:
        _fail(f"--policies: unknown {unknown or 'none given'}; choose from {POLICIES}")
    gpus = tuple(g.strip().lower() for g in gpu_types.split(",") if g.strip()) or (fleet.pool.gpu.lower(),)
    bad = [g for g in gpus if g not in {**_catalogue(), **fleet.gpus}]
    if bad:
        _fail(f"--gpu-types: unknown {bad}; known: {', '.join(sorted({**_catalogue(), **fleet.gpus}))}")
    from sims.capacity import Goal
    from sims.capacity_eval import Context
    from sims.capacity_study import StudyConfig
    from sims.profiles import load_profile
    from sims.run import fleet_workload_spec
    from sims.traces import load_workload
    from sims.workload import TraceError

    spec = fleet_workload_spec(fleet, duration) if trace == "fleet" else trace
    try:
        workload = load_workload(spec, [m.name for m in fleet.models], seed=seed)
    except (TraceError, FileNotFoundError) as exc:
        _fail(str(exc))
    try:
        calibration = load_profile(profile)
    except (FileNotFoundError, ValueError) as exc:
        _fail(f"--profile: {exc}")
    from modelpool.simulate import profile_device_check

    try:
        mismatches = [line for g in gpus if (line := profile_device_check(calibration, g, profile, force_profile))]
    except ValueError as exc:
        _fail(str(exc))
    for line in mismatches:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for note in workload.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    goal = Goal(slo_target, slo_metric, window, max_instances)
    ctx = Context(fleet, workload, calibration, stop_below=slo_target if slo_metric == "per-request" else None)
    config = StudyConfig(chosen, gpus, goal, what_if_tpot or None)
    console.print(f"[bold]modelpool capacity[/]: {len(fleet.models)} models, {len(workload)} requests over "
                  f"{workload.duration_s:g} s; target {slo_target:.1%} ({slo_metric}); "
                  f"{', '.join(chosen)} on {', '.join(g.upper() for g in gpus)}")
    others = [seed + k for k in range(1, seeds)]
    workloads = {}
    for other in others:
        workloads[other] = load_workload(spec, [m.name for m in fleet.models], seed=other)
        if _same_rows(workloads[other], workload):
            _fail(f"--seeds {seeds}: the workload {spec!r} is the same under every seed (a trace file): "
                  "only generated workloads (fleet, poisson, gamma, zipf, ...) vary with it")
    try:
        result = run_study(ctx, config, address, workers)
        repeats = {}
        for other, again in workloads.items():  # the same search on other arrivals: how far the answer moves
            console.print(f"seed {other}: searching again ({len(again)} requests)")
            rerun = run_study(Context(fleet, again, calibration, stop_below=ctx.stop_below),
                              StudyConfig(chosen, gpus[:1], goal, None), address, workers)
            repeats[other] = {p: (a.gpus, a.met) for p in chosen if (a := rerun.answer(p)) is not None}
    except ValueError as exc:
        _fail(str(exc))
    worse = _sensitivity(ctx, config, result, address, workers) if sensitivity else None
    given = {"--fleet": str(fleet_path), "--trace": trace, "--duration": f"{duration:g}", "--seed": str(seed),
             "--slo-target": f"{slo_target:g}", "--slo-metric": slo_metric, "--policies": policies,
             "--gpu-types": gpu_types, "--what-if-tpot": f"{what_if_tpot:g}", "--profile": profile,
             "--seeds": str(seeds)}
    defaults = {"--fleet": "models.yaml", "--trace": "fleet", "--duration": "600", "--seed": "0", "--slo-target": "0.99",
                "--slo-metric": "per-request", "--policies": POLICIES, "--gpu-types": "", "--what-if-tpot": "2",
                "--profile": "default", "--seeds": "1"}
    command = " ".join(["modelpool capacity"] + [f"{k} {shlex.quote(v)}" for k, v in given.items() if v != defaults[k]])
    paths = write_report(result, ctx, out, fleet_path=str(fleet_path), trace=spec, seed=seed, command=command,
                         wall_s=time.perf_counter() - started, repeats=repeats, sensitivity=worse)
    report = json.loads(paths[2].read_text())
    console.print(_summary(report))
    for entry in report["policies"].values():
        if entry["unmet_reason"]:
            console.print(f"(unmet) {entry['unmet_reason']}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"[bold]{report['headline']['sentence']}[/]")
    console.print(report["stability"]["sentence"], markup=False, highlight=False, soft_wrap=True)
    if report.get("sensitivity"):
        console.print(f"  {report['sensitivity']['line']}", markup=False, highlight=False, soft_wrap=True)
    for line in report["tries"]:
        console.print(f"  try: {line}")
    console.print(f"wrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - started:.0f} s")


def _sensitivity(ctx: Any, config: Any, result: Any, address: str | None, workers: int | None) -> dict[str, Any]:
    """The first GPU type searched again with its least certain terms 20% worse (sims.sensitivity)."""
    from dataclasses import replace

    from sims.capacity_eval import Context
    from sims.sensitivity import sensitivity_entry, worse_profile

    gpu = result.gpu
    worse_ctx = Context(ctx.fleet, ctx.workload, worse_profile(ctx.costs(gpu).profile, gpu),
                        policy_options=ctx.policy_options, stop_below=ctx.stop_below)
    console.print("sensitivity: searching again with eff_mem, the host link and the per-step overhead 20% worse")
    worse = run_study(worse_ctx, replace(config, gpus=(gpu,), what_if_tpot=None), address, workers)

    def answers(study: Any) -> dict[str, tuple[int, bool]]:
        return {p: (a.gpus, a.met) for p in config.policies if (a := study.answer(p)) is not None}

    return sensitivity_entry(answers(result), answers(worse), gpu)


def _same_rows(a: Any, b: Any) -> bool:
    import numpy as np

    return len(a) == len(b) and all(np.array_equal(getattr(a, c), getattr(b, c))
                                    for c in ("arrival_s", "model_index", "input_tokens", "output_tokens"))


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _catalogue() -> dict[str, Any]:
    from scheduler.fleet import GPUS

    return dict(GPUS)


def run_study(ctx: Any, config: Any, address: str | None, workers: int | None) -> Any:
    """The study on Ray (or in process with workers=0), with a progress bar over the simulations."""
    from sims.capacity import InlineEvaluator
    from sims.capacity_eval import evaluate, run_pool
    from sims.capacity_study import study

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("simulations"), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def progress(stats: Any, answers: Mapping[object, Any]) -> None:
            done = len(answers)
            bar.update(task, total=stats.submitted, completed=stats.evaluated,
                       description=f"searching ({done} class answers)")

        if workers is None and address is None and not installed("ray"):
            console.print("Ray is not installed: every simulation runs in this process (pip install "
                          "'modelpool[ray]' spreads them over this machine's cores or a cluster)")
            workers = 0
        if workers == 0:
            evaluator = InlineEvaluator(lambda point: evaluate(ctx, point))
            result = study(ctx, config, evaluator, lambda jobs: [run_pool(ctx, *job) for job in jobs], progress)
        else:
            with RayWorkers(ctx, address, workers) as pool:
                bar.update(task, description="searching")
                result = study(ctx, config, pool, pool.run_pools, progress)
            console.print(f"{sum(pool.nodes.values())} simulations ran as Ray tasks on {len(pool.nodes)} node(s): "
                          + ", ".join(f"{node[:8]} {count}" for node, count in pool.nodes.most_common()))
        bar.update(task, description="done")
    return result


class RayWorkers:
    """An Evaluator over Ray tasks; the context goes to the object store once."""

    def __init__(self, ctx: Any, address: str | None, workers: int | None) -> None:
        self.ctx, self.address, self.workers = ctx, address, workers
        self.pending: dict[Any, Any] = {}
        self.nodes: Counter[str] = Counter()  # Ray node id -> simulations it ran

    def __enter__(self) -> RayWorkers:
        if not installed("ray"):
            raise ValueError("--workers/--address run the simulations on Ray, which is not installed: "
                             "pip install 'modelpool[ray]', or --workers 0 to run them in this process")
        import ray

        from sims.capacity_eval import evaluate, run_pool

        env = {"env_vars": {"OMP_NUM_THREADS": "1"}}  # Ray's token auth stays on (see README, Security)
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            if self.address:
                ray.init(address=self.address, log_to_driver=False, runtime_env=env)
            else:
                ray.init(num_cpus=self.workers or os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                         runtime_env=env, _node_ip_address="127.0.0.1")
        self.ray = ray
        self.ctx_ref = ray.put(self.ctx)
        self._evaluate, self._run_pool = evaluate, run_pool
        self._task = ray.remote(num_cpus=1, max_retries=1)(_on_node)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started_ray:
            self.ray.shutdown()

    def submit(self, point: Any) -> None:
        self.pending[self._task.remote(self._evaluate, self.ctx_ref, point)] = point

    def wait(self) -> list[Any]:
        if not self.pending:
            return []
        ready, _ = self.ray.wait(list(self.pending), num_returns=1)
        return [self._counted(self.ray.get(ref)) for ref in ready if self.pending.pop(ref, None) is not None]

    def run_pools(self, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
        refs = [self._task.remote(self._run_pool, self.ctx_ref, *job) for job in jobs]
        return [self._counted(answer) for answer in self.ray.get(refs)]

    def _counted(self, answer: tuple[str, Any]) -> Any:
        node, result = answer
        self.nodes[node] += 1
        return result


def _on_node(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """A Ray task: `fn(*args)` and the id of the node that ran it (the CLI says how the work was spread)."""
    import ray

    return str(ray.get_runtime_context().get_node_id()), fn(*args)


def write_report(result: Any, ctx: Any, out: Path, **meta: Any) -> list[Path]:
    """report.html, report.md, report.json, capacity.csv, per_model.csv, curves.csv under `out`."""
    from sims.report import build_report
    from sims.report_text import to_markdown, write_csvs
    from sims.report_html import figures, to_html

    out.mkdir(parents=True, exist_ok=True)
    report = build_report(result, ctx, **meta)
    paths = [out / "report.html", out / "report.md", out / "report.json"]
    paths[0].write_text(to_html(report, figures(report, result)), encoding="utf-8")
    paths[1].write_text(to_markdown(report), encoding="utf-8")
    paths[2].write_text(json.dumps(report, indent=2, default=_json_default), encoding="utf-8")
    return paths + write_csvs(report, out)


def _json_default(value: object) -> object:
    if hasattr(value, "item"):
        return value.item()  # numpy scalars
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _summary(report: Mapping[str, Any]) -> Group:
    from sims.report_text import summary_rows

    table = Table(title=f"{report['fleet']['num_models']} models on {report['gpu'].upper()}: fewest GPUs for "
                        f"{report['slo_target']:.1%} {report['slo_metric']} SLO attainment")
    for column in ("policy", "GPUs", "vs dedicated", "$/month", "attainment", "p99 TTFT ms", "p99 TPOT ms"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for row in summary_rows(report):
        table.add_row(*row)
    types = report["gpu_types"]
    if len(types) == 1:
        return Group(table)
    compare = Table(title="GPU types: GPUs (monthly cost); * = target not met")
    names = list(report["policies"])
    compare.add_column("GPU")
    for policy in names:
        compare.add_column(policy, justify="right")
    for gpu, t in types.items():
        if "skipped" in t:
            compare.add_row(gpu, *["does not fit"] * len(names))
            continue
        cells = [(f"{e['gpus']} (${e['usd_per_month']:,.0f}){'' if e['met'] else '*'}" if (e := t["policies"].get(p))
                  else "-") for p in names]
        compare.add_row(gpu, *cells)
    return Group(table, compare)


ProgressFn = Callable[[Any, Mapping[object, Any]], None]
