"""`modelpool calibrate`: one command that measures every cost-model term on this machine.

Microbenchmarks only, nothing fitted to a loaded run: the torch engine on random weights of several shapes
across qwen2, qwen3 and llama (modelpool.measure: prefill, decode steps, weight copies, KV moves), and the
live pool's own host costs on an idle pool with a zero-time engine, on the backend `modelpool serve` would
run the engines on here (modelpool.measure_live; `--backend` for another). The terms are
fitted with each shape's leave-one-out error (sims.profiles.measurements) and written as one versioned
measurements file that `simulate`, `capacity`, `estimate` and `serve` read with `--profile FILE`.

    modelpool calibrate --device cuda --out h100-measured.json      # six shapes 0.5B-7B: a few minutes
    modelpool calibrate --device cpu --quick --out /tmp/cpu.json     # tiny shapes: a CPU smoke run (CI)

On a device the GPU catalogue does not describe (a CPU), its figures (FLOP rate, memory bandwidth, host copy
rate) are measured too and carried in the file: no GPU entry to write by hand.
"""

from __future__ import annotations

import datetime
import re
import shlex
import time
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from modelpool.extras import SERVE_EXTRA

console = Console()


def calibrate_command(
    out: Path = typer.Option(Path("measurements.json"), "--out", "-o", help="Measurements file to write."),
    device: str = typer.Option("cuda", "--device", help="cpu | cuda | cuda:N (the torch device to measure)."),
    quick: bool = typer.Option(False, "--quick", help="A smoke run: five smaller shapes, fewer points and repeats "
                               "(the host costs on processes where serve's default is Ray: no cluster to start)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and prompts."),
    backend: str | None = typer.Option(None, "--backend", help="ray | processes | threads: where the idle pool's "
                                       "engine calls run while its host costs are measured. Default: serve's "
                                       "(ray, or processes where Ray is not installed; processes for --quick), so "
                                       "the terms are what `modelpool serve` pays; give serve's --backend if you "
                                       "serve with another."),
) -> None:
    """Microbenchmark the engine and the pool on this device; write one measurements file."""
    started = time.perf_counter()
    try:
        import torch

        from modelpool.measure import Calibration, plan_for, shapes_for
        from modelpool.measure_live import measure_host
    except ModuleNotFoundError as exc:  # a planner's install: no serve extra
        _fail(f"modelpool calibrate runs the engine and needs {exc.name}, not installed here: {SERVE_EXTRA}")
    host_backend = pick_host_backend(backend, quick)
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        _fail(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}); use --device cpu")
    from sims.profiles.measurements import Points, build

    name = torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu"
    gpu, spec = _device_spec(name, device, cuda, quick)
    shapes = shapes_for(cuda, quick)
    calibration = Calibration(shapes, device, plan_for(cuda, quick), seed=seed)
    console.print(f"[bold]modelpool calibrate[/]: {len(shapes)} shapes on {name} (GPU type {gpu}), the pool's host "
                  f"costs on the {host_backend} backend{', quick' if quick else ''}")
    serves_on = pick_host_backend(backend)
    if host_backend != serves_on:
        console.print(f"[yellow]serve's default backend here is {serves_on}: a --quick run measures the host costs "
                      f"on {host_backend} (no cluster to start); --backend {serves_on} for serve's[/]")
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("building random weights", total=calibration.num_steps + 2)
        measured = calibration.run(lambda what: bar.update(task, advance=1, description=what))
        bar.update(task, description=f"the idle pool's host costs ({host_backend} backend)")
        host = measure_host(host_backend, probes=8 if quick else 30, tokens=16 if quick else 48)
        bar.update(task, advance=1, description="two instances' processes on the device")
        share, share_decode = _measure_share(shapes, device, cuda, quick, seed)
        bar.update(task, advance=1)
    points = Points(prefill=measured["prefill"], decode=measured["decode"], swap=measured["swap"],
                    kv_move=measured["kv_move"], host=host, share=share, share_decode=share_decode)
    figures = {key: float(value) for key, value in measured["figures"].items()}
    command = " ".join(["modelpool calibrate", "--device", device, "--out", shlex.quote(str(out))]
                       + (["--quick"] if quick else []) + ([f"--seed {seed}"] if seed else [])
                       + ([f"--backend {backend}"] if backend else []))
    measurements = build(
        points, shapes, spec, device=name, gpu=gpu, command=command, quick=quick,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        settings={name: bool(figures.pop(name, 0.0)) for name in ("prefill_padded", "decode_ahead")},
        software={**measured["software"], "modelpool": _version()}, figures=figures,
        wall_s=time.perf_counter() - started)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(measurements.model_dump_json(by_alias=True, indent=1) + "\n")
    console.print(_terms_table(measurements))
    profile = measurements.profile()
    if profile.decode_pairs:
        console.print("a decode step beside another process's decode steps (the profile's decode_pairs): "
                      + ", ".join(f"{p.decode_shape} beside {p.peer_shape} {p.slowdown:.3g}x"
                                  for p in profile.decode_pairs))
    if profile.shape_scales:
        console.print("each shape's prefill points over the formula (median; the profile's shape_scales): "
                      + ", ".join(f"{s.shape} {s.prefill:.3g}x" for s in profile.shape_scales))
    console.print(f"wrote {out} in {time.perf_counter() - started:.0f} s; use it with "
                  f"`modelpool simulate --profile {out}` or `modelpool capacity --profile {out}`")


def pick_host_backend(backend: str | None, quick: bool = False) -> str:
    """The backend the idle pool's host costs are measured on: the one asked for, else the one `modelpool serve`
    runs the torch engine on here (one rule: `modelpool.serve.pick_backend`) - except that a --quick run takes
    processes for Ray: engines in other processes too, without a cluster to start (~10 s more on 2 cores), though
    Ray's hop costs more than a pipe's (the file names the backend measured)."""
    from modelpool.serve import pick_backend

    chosen = pick_backend(backend, "torch", ("ray", "processes", "threads"))
    return "processes" if quick and backend is None and chosen == "ray" else chosen


def _measure_share(shapes: dict[str, Any], device: str, cuda: bool, quick: bool, seed: int) -> Any:
    """The smallest and the largest shape in prefilling and decoding engine processes side by side, each pair of
    them, as serve places a prefill and a decode instance on one device (on a GPU as clients of a private MPS
    daemon, serve's default; time-sliced where none can start, and the file says which): the decoder beside the
    prefiller, then beside it decoding too (a hand-off's first decode steps). Both lists of points."""
    from modelpool.measure_share import ShareSetup, measure_share
    from pool.mps import MpsDaemon, MpsError

    by_size = sorted(shapes, key=lambda key: shapes[key].weight_bytes)
    setups = [ShareSetup.default(shape, shapes[shape], device, quick, seed) for shape in dict.fromkeys(
        (by_size[0], by_size[-1]))]
    daemon, env = None, None
    if cuda:
        daemon = MpsDaemon()
        try:
            env = daemon.start()
            daemon.check_client()  # as serve's default: where no CUDA client runs under it, time-sliced
        except MpsError as exc:
            daemon.stop()
            daemon, env = None, None
            console.print(f"[yellow]the share benchmark runs time-sliced, as serve would: {exc}[/]")
    try:
        return measure_share(setups, env)
    finally:
        if daemon is not None:
            daemon.stop()


def _device_spec(name: str, device: str, cuda: bool, quick: bool) -> tuple[str, Any]:
    """The GPU type the terms count for and the figures its efficiencies are shares of: a catalogue GPU's
    datasheet where the device is one, else the device's own rates, measured (modelpool.measure.device_peaks)."""
    from modelpool.measure import device_peaks
    from scheduler.fleet import GPUS, GpuSpec

    if cuda:
        words = set(re.split(r"[^a-z0-9]+", name.lower()))
        known = sorted(key for key in GPUS if key in words)  # "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100
        if known:
            return known[0], GPUS[known[0]]
    peaks = device_peaks(device, quick=quick)
    key = "cpu" if not cuda else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return key, GpuSpec(memory_gb=round(peaks["memory_gb"], 1), hbm_tb_s=round(peaks["memory_tb_s"], 5),
                        bf16_tflops=round(peaks["tflops"], 5), h2d_gb_s=round(peaks["h2d_gb_s"], 3), nvlink_gb_s=1.0,
                        usd_per_hour=0.1, source=f"measured by modelpool calibrate on {name}: a large GEMM, a large "
                                                 f"copy, a host copy (NVLink and the price: placeholders)")


def _terms_table(m: Any) -> Table:
    table = Table(title=f"terms measured on {m.device} ({m.gpu}); held-out error: each shape predicted by the "
                        f"others' fit (median / max)")
    for column in ("term", "value", "unit", "points", "held-out error"):
        table.add_column(column, justify="left" if column == "term" else "right")
    for term, entry in m.terms.items():
        value = str(entry.value) if isinstance(entry.value, bool) else f"{entry.value:.4g}"
        held = "-" if entry.loo_error is None else f"{entry.loo_error:.1%} / {entry.loo_max_error or 0.0:.1%}"
        points = str(entry.points) if entry.points else "setting" if entry.unit == "setting" else "assumed"
        table.add_row(term, value, entry.unit, points, held)
    return table


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("modelpool")
    except Exception:  # not installed (a source tree on the GPU box)
        return ""


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)
