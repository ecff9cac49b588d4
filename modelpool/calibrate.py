"""`modelpool calibrate`: measure the cost model's terms on this machine for a fleet's model shapes.

Random weights of each shape (no downloads), the torch engine, and a short
load through the live pool (modelpool.measure); the fit and the provenance of
every term (sims.profiles.calibrated); a profile JSON that `modelpool
simulate --profile` and `modelpool capacity --profile` read.

    modelpool calibrate --fleet models.yaml --device cuda --out h200-mine.json   # ~3 shapes: < 3 min on an H200
    modelpool calibrate --fleet tiny.yaml --device cpu --quick --out /tmp/p.json  # a smoke run, seconds
"""

from __future__ import annotations

import datetime
import json
import re
import shlex
import time
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from modelpool.config import FleetFileError, load_fleet

console = Console()
DEVICE_FRACTION = 0.8  # of device memory two engines (two model slots each) and the KV may take


def calibrate_command(
    fleet_path: Path = typer.Option(Path("models.yaml"), "--fleet", "-f", help="Fleet file: its models' shapes are measured."),
    out: Path = typer.Option(Path("calibrated-profile.json"), "--out", "-o", help="Profile JSON to write."),
    device: str = typer.Option("cuda", "--device", help="cpu | cuda | cuda:N (the torch device to measure)."),
    quick: bool = typer.Option(False, "--quick", help="A smoke run: fewer points and repeats (~1 min on an H200)."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU type the measurements count for: a catalogue key or one "
                                   "of the fleet's `gpus:` (default: the fleet's pool.gpu; with --from-live: the "
                                   "GPU type --profile was calibrated on)."),
    models: str = typer.Option("", "--models", help="Comma-separated fleet models whose shapes to measure (default: "
                               "up to --max-shapes shapes spanning the fleet's sizes)."),
    max_shapes: int = typer.Option(3, "--max-shapes", min=1, help="Most distinct shapes measured."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights and prompts."),
    from_live: Path | None = typer.Option(None, "--from-live", help="Measure nothing: fit the live pool's host time "
                                          "per decode step (decode_host_s, decode_host_request_s), and what it has of "
                                          "the hand-off and request-path terms, to this run of the live pool (a "
                                          "benchmarks/gpu_pool.py run JSON) on top of --profile."),
    base: str | None = typer.Option(None, "--profile", help="With --from-live or --gpu-share: the profile to start "
                                    "from (a file `modelpool calibrate` wrote, or a shipped name)."),
    gpu_share: Path | None = typer.Option(None, "--gpu-share", help="Also fit gpu_share_slowdown (instances on one "
                                          "GPU slowing each other) to this benchmarks/gpu_prefill_probe.py --share "
                                          "result; with --profile and no --from-live, measure nothing else."),
    gpu_share_decode: Path | None = typer.Option(None, "--gpu-share-decode", help="With --gpu-share: fit "
                                                 "gpu_share_decode_slowdown (a decode step beside a prefill) to this "
                                                 "gpu_prefill_probe.py --decode-share result instead of the "
                                                 "--gpu-share one's (both measured with or both without MPS)."),
    request_path: Path | None = typer.Option(None, "--request-path", help="With --profile: fit the live pool's way "
                                             "in and out of each request (request_admit_s, token_deliver_s) to this "
                                             "light-load benchmarks/gpu_pool.py run JSON (its ttft_parts), after "
                                             "--from-live."),
    link_share: Path | None = typer.Option(None, "--link-share", help="Read link_sharing and eff_pcie_shared (two "
                                           "instances' copies on one GPU's host link) from this "
                                           "benchmarks/gpu_link_share.py result (two engine processes, as the pool "
                                           "serves) instead of calibrate's two threads; with --profile, measure "
                                           "nothing else."),
    refit_engine: bool = typer.Option(False, "--refit-engine", help="With --profile (one calibrate measured) and "
                                      "--fleet (its shapes): measure nothing, fit the engine terms again to the "
                                      "measurements the profile carries, with this modelpool's fits; keep the rest."),
) -> None:
    """Measure prefill, decode, switch, KV-move, shared-link and live-pool host times on this device; write a profile."""
    started = time.perf_counter()
    if gpu_share_decode is not None and gpu_share is None:
        _fail("--gpu-share-decode needs --gpu-share: the probe the prefill's slowdown is fitted to")
    if request_path is not None and base is None:
        _fail("--request-path needs --profile: the profile the request-path terms go on top of")
    if refit_engine and base is None:
        _fail("--refit-engine needs --profile: the profile whose measurements the engine terms are fitted to again")
    if from_live is not None or request_path is not None or refit_engine or (
            (gpu_share is not None or link_share is not None) and base is not None):
        _refit(from_live, gpu_share, base, out, gpu, gpu_share_decode, request_path, fleet_path, refit_engine,
               link_share)
        return
    try:
        fleet = load_fleet(fleet_path)
    except FleetFileError as exc:
        _fail(str(exc))
    gpu_key = (gpu or fleet.pool.gpu).lower()
    if gpu_key not in {*fleet.gpus, *_catalogue()}:
        _fail(f"--gpu {gpu_key!r}: not in the GPU catalogue ({', '.join(sorted(_catalogue()))}) nor the fleet's gpus")
    cuda = device.startswith("cuda")
    if not cuda and gpu_key in _catalogue():
        _fail(f"--device {device} measures this machine's CPU, not a {gpu_key.upper()}: the profile would say its "
              f"terms were measured on {gpu_key}. Describe the CPU as a GPU type in the fleet's `gpus:` (memory_gb, "
              f"hbm_tb_s, bf16_tflops, h2d_gb_s, nvlink_gb_s, usd_per_hour) and pass --gpu NAME")
    import torch

    if cuda and not torch.cuda.is_available():
        _fail(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}); use --device cpu")
    memory = torch.cuda.get_device_properties(torch.device(device)).total_memory if cuda else None
    archs, skipped = pick_shapes(fleet, [m.strip() for m in models.split(",") if m.strip()], max_shapes, memory)
    for line in skipped:
        console.print(f"[yellow]skipped[/] {line}")
    if not archs:
        _fail("no model shape of the fleet can be measured with the torch engine here (see the lines above)")
    from modelpool.measure import Calibration, plan_for
    from sims.profiles.calibrated import build_profile, fit_errors

    calibration = Calibration(archs, device, plan_for(cuda, quick), seed=seed)
    name = calibration.result["device"]
    _check_device(name, gpu_key, cuda)
    console.print(f"[bold]modelpool calibrate[/]: {len(archs)} shape(s) ({', '.join(archs)}) on {name}, "
                  f"counted for {gpu_key}{', quick' if quick else ''}")
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("building random weights", total=calibration.num_steps)
        measurements = calibration.run(lambda what: bar.update(task, advance=1, description=what))
    given = [("--fleet", str(fleet_path)), ("--device", device), ("--out", str(out)), ("--gpu", gpu or ""),
             ("--models", models), ("--max-shapes", "" if max_shapes == 3 else str(max_shapes)),
             ("--seed", str(seed) if seed else "")]
    command = " ".join(["modelpool calibrate"] + [f"{k} {shlex.quote(v)}" for k, v in given if v]
                       + (["--quick"] if quick else []))
    run = {"command": command,
           "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "quick": quick, "shapes": tuple(archs), "wall_s": round(time.perf_counter() - started, 1),
           "software": {"modelpool": _version()}}
    profile = build_profile(measurements, archs, gpu_key, fleet.gpu(gpu_key), run=run, name=out.stem)
    if gpu_share is not None:
        profile = _with_gpu_share(profile, gpu_share, gpu_share_decode)
    if link_share is not None:
        profile = _with_link_share(profile, link_share)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.model_dump(mode="json"), indent=2) + "\n")
    console.print(_shape_table(measurements))
    console.print(_terms_table(profile, fit_errors(profile, archs, fleet.gpu(gpu_key))))
    console.print(f"wrote {out} in {time.perf_counter() - started:.0f} s; use it with "
                  f"`modelpool simulate --profile {out}` or `modelpool capacity --profile {out}`")


def _with_gpu_share(profile: Any, probe_path: Path, decode_path: Path | None = None) -> Any:
    """`profile` with gpu_share_slowdown (and gpu_share_decode_slowdown, where measured) fitted to a
    benchmarks/gpu_prefill_probe.py --share result; the decode term to a --decode-share one, where given."""
    from sims.profiles.calibrated import with_gpu_share

    def read(path: Path, option: str, what: str) -> tuple[dict, str]:
        try:
            when = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc).date().isoformat()
            return json.loads(path.read_text()), f"{path.name}, {when}"
        except (OSError, ValueError) as exc:
            _fail(f"{option} {path}: cannot read a gpu_prefill_probe.py {what} result ({exc})")

    probe, where = read(probe_path, "--gpu-share", "--share")
    if decode_path is not None:
        decode, decode_where = read(decode_path, "--gpu-share-decode", "--decode-share")
        if not isinstance(decode, dict) or "decode_share" not in decode:
            _fail(f"--gpu-share-decode {decode_path}: no decode_share series (gpu_prefill_probe.py --decode-share)")
        if decode.get("mps") != probe.get("mps"):
            def how(mps: object) -> str:
                return "under MPS" if mps else "without MPS" if mps is not None else "with MPS not recorded"

            _fail(f"--gpu-share-decode {decode_path}: measured {how(decode.get('mps'))}, --gpu-share {probe_path} "
                  f"{how(probe.get('mps'))}: the two terms must describe one way of sharing the GPU")
        probe, where = {**probe, "decode_share": decode["decode_share"]}, f"{where}; decode steps: {decode_where}"
    try:
        return with_gpu_share(profile, probe, where)
    except (ValueError, KeyError, TypeError) as exc:
        _fail(f"--gpu-share {probe_path}: not a gpu_prefill_probe.py --share result ({exc!r})")


def _with_link_share(profile: Any, probe_path: Path) -> Any:
    """`profile` with link_sharing and eff_pcie_shared read from a benchmarks/gpu_link_share.py result."""
    from sims.profiles.calibrated import with_link_share

    try:
        probe = json.loads(probe_path.read_text())
        when = datetime.datetime.fromtimestamp(probe_path.stat().st_mtime, datetime.timezone.utc).date().isoformat()
    except (OSError, ValueError) as exc:
        _fail(f"--link-share {probe_path}: cannot read a gpu_link_share.py result ({exc})")
    try:
        return with_link_share(profile, probe, f"{probe_path.name}, {probe.get('measured_at', when)[:10]}")
    except (ValueError, KeyError, TypeError) as exc:
        _fail(f"--link-share {probe_path}: not a gpu_link_share.py result ({exc!r})")


def _refit(run_path: Path | None, share_path: Path | None, base: str | None, out: Path, gpu: str | None,
           decode_path: Path | None = None, path_run: Path | None = None, fleet_path: Path | None = None,
           refit_engine: bool = False, link_path: Path | None = None) -> None:
    """`--from-live` / `--gpu-share` / `--refit-engine` with `--profile`: the base profile with its engine terms
    fitted again to its own measurements (`refit_engine`, first), the host terms fitted to a live pool run and/or
    gpu_share_slowdown to a probe (sims.profiles.calibrated), named after `out` as a profile `modelpool
    calibrate` measures is. Where `fleet_path` names the run's models (the fleet it served), their shapes let the
    run's prefills fit prefill_live_scale too."""
    from sims.profiles import load_profile
    from sims.profiles.calibrated import with_live_host, with_request_path

    if base is None:
        _fail("--from-live needs --profile: the profile whose engine terms the live pool's host time goes on top of")
    try:
        profile = load_profile(base)
    except (FileNotFoundError, ValueError) as exc:
        _fail(f"--profile {base}: {exc}")
    if gpu is not None and gpu.lower() not in _catalogue() and (
            profile.calibration is None or gpu.lower() != profile.calibration.gpu):
        _fail(f"--gpu {gpu!r}: not in the GPU catalogue ({', '.join(sorted(_catalogue()))}) nor the GPU type "
              f"--profile {base} was calibrated on")
    if refit_engine:
        profile = _engine_refit(profile, base, fleet_path, out.stem)
    if run_path is not None:
        try:
            run = json.loads(run_path.read_text())
        except (OSError, ValueError) as exc:
            _fail(f"--from-live {run_path}: cannot read a run JSON ({exc})")
        when = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        archs, missing = _run_archs(run, fleet_path)
        if missing:
            console.print(f"prefill_live_scale not fitted: --fleet {fleet_path} does not have the run's model(s) "
                          f"{', '.join(missing)} (pass the fleet file the run served)")
        try:
            profile = with_live_host(profile, run, f"{run_path.name}, fitted {when}", gpu, name=out.stem, archs=archs)
        except ValueError as exc:
            _fail(f"--from-live {run_path}: {exc}")
    else:
        profile = profile.model_copy(update={"name": out.stem})
    if path_run is not None:
        try:
            light = json.loads(path_run.read_text())
            when = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
            profile = with_request_path(profile, light, f"{path_run.name}, fitted {when}", gpu, name=out.stem)
        except (OSError, ValueError) as exc:
            _fail(f"--request-path {path_run}: {exc}")
    if share_path is not None:
        profile = _with_gpu_share(profile, share_path, decode_path)
    if link_path is not None:
        profile = _with_link_share(profile, link_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.model_dump(mode="json"), indent=2) + "\n")
    terms = profile.terms
    if link_path is not None:
        console.print(f"link_sharing {terms.link_sharing}, eff_pcie_shared {terms.eff_pcie_shared:.4g}, from "
                      f"{link_path}")
    if share_path is not None:
        console.print(f"gpu_share_slowdown {terms.gpu_share_slowdown:.4g}, from {share_path}")
        if terms.gpu_share_decode_slowdown is not None:
            console.print(f"gpu_share_decode_slowdown {terms.gpu_share_decode_slowdown:.4g}, from "
                          f"{decode_path or share_path}")
    if path_run is not None:
        console.print(f"request_admit_s {terms.request_admit_s * 1e3:.4g} ms and token_deliver_s "
                      f"{terms.token_deliver_s * 1e3:.4g} ms per request, from {path_run}")
    if run_path is None:
        console.print(f"wrote {out}; use it with `modelpool simulate --profile {out}`")
        return
    console.print(f"decode_host_s {terms.decode_host_s * 1e3:.4g} ms + decode_host_request_s "
                  f"{terms.decode_host_request_s * 1e6:.4g} us per request, from {run_path}")
    if "kv_handoff_fixed_s" in profile.provenance and terms.kv_handoff_fixed_s is not None:
        console.print(f"kv_handoff_fixed_s {terms.kv_handoff_fixed_s * 1e3:.4g} ms per staged hand-off move")
    if "request_admit_s" in profile.provenance and path_run is None:
        console.print(f"request_admit_s {terms.request_admit_s * 1e3:.4g} ms and token_deliver_s "
                      f"{terms.token_deliver_s * 1e3:.4g} ms per request, the live pool's way in and out")
    if "prefill_live_scale" in profile.provenance and profile.provenance["prefill_live_scale"].status == "measured":
        console.print(f"prefill_live_scale {terms.prefill_live_scale:.4g}: the live pool's prefill over the engine "
                      f"terms'")
    if "prefill_fresh_s" in profile.provenance and terms.prefill_fresh_s:
        console.print(f"prefill_fresh_s {terms.prefill_fresh_s * 1e3:.4g} ms per prefill at a fresh shape")
    console.print(f"wrote {out}; use it with `modelpool simulate --profile {out}`")


def _engine_refit(profile: Any, base: str, fleet_path: Path | None, name: str) -> Any:
    """`profile`'s engine terms fitted again to its measurements (sims.profiles.calibrated.with_engine_refit),
    the shapes from the fleet file; prints the terms that moved."""
    from sims.profiles.calibrated import with_engine_refit

    if profile.calibration is None:
        _fail(f"--refit-engine: --profile {base} carries no calibration measurements (a shipped profile?)")
    try:
        fleet = load_fleet(fleet_path if fleet_path is not None else Path("models.yaml"))
    except FleetFileError as exc:
        _fail(f"--refit-engine needs the fleet file whose shapes the profile measured: {exc}")
    try:
        refitted = with_engine_refit(profile, fleet_shapes(fleet), fleet.gpu(profile.calibration.gpu), name)
    except (ValueError, KeyError) as exc:
        _fail(f"--refit-engine: {exc}")
    for term in type(refitted.terms).model_fields:
        before, after = getattr(profile.terms, term), getattr(refitted.terms, term)
        if before != after:
            console.print(" ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in (f"{term}:", before, "->", after)))
    return refitted


def fleet_shapes(fleet: Any) -> dict[str, Any]:
    """Every model shape of the fleet as the engine builds it (parameters counted from the shape), by the key
    calibrate measures it under: the fleet's arch name (the model's name for an inline arch)."""
    from scheduler.fleet import Arch

    return {entry.arch_name or entry.name: Arch.model_validate({**entry.arch.model_dump(), "total_params": None})
            for entry in fleet.models}


def _run_archs(run: dict[str, Any], fleet_path: Path | None) -> tuple[dict[str, Any], list[str]]:
    """The (arch, tp) of each model a live run prefilled, from the fleet file at `fleet_path`, and the models it
    lacks (all of them where the file cannot be read)."""
    wanted = sorted({row[0] for samples in (run.get("prefill_samples") or {}).values() for row in samples or []})
    if not wanted:
        return {}, []
    try:
        fleet = load_fleet(fleet_path) if fleet_path is not None else None
    except FleetFileError:
        fleet = None
    known = {m.name: (m.arch, m.tp) for m in fleet.models} if fleet is not None else {}
    return {name: known[name] for name in wanted if name in known}, [name for name in wanted if name not in known]


def pick_shapes(fleet: Any, names: list[str], max_shapes: int, device_bytes: int | None) -> tuple[dict[str, Any], list[str]]:
    """The shapes to measure (key: the fleet's arch name, parameters counted from the shape, as the engine
    builds it) and why others were left out. Without `names`: distinct shapes sorted by size, at most
    `max_shapes` spread from the smallest to the largest that fits the device."""
    from modelpool.measure import unsupported

    built = fleet_shapes(fleet)
    entries = fleet.models
    if names:
        unknown = sorted(set(names) - {m.name for m in entries})
        if unknown:
            _fail(f"--models: not in the fleet: {', '.join(unknown)}")
        entries = [m for m in entries if m.name in names]
    shapes: dict[str, Any] = {}
    seen: set[str] = set()  # shapes already taken, by their fields (inline archs have no catalogue name)
    skipped = []
    for entry in entries:
        key = entry.arch_name or entry.name
        fields = entry.arch.model_dump_json()
        why = unsupported(entry.arch, entry.tp)
        if fields in seen:
            continue
        seen.add(fields)
        if why:
            skipped.append(f"{key} ({entry.name}): {why}")
            continue
        arch = built[key]
        if device_bytes is not None and 4 * arch.weight_bytes > DEVICE_FRACTION * device_bytes:
            skipped.append(f"{key}: {arch.weight_bytes / 1e9:.1f} GB of weights; two engines with two model slots "
                           f"each do not fit {device_bytes / 1e9:.0f} GB")
            continue
        shapes[key] = arch
    ordered = sorted(shapes, key=lambda k: (shapes[k].weight_bytes, k))
    if len(ordered) > max_shapes:
        picks = sorted({round(i * (len(ordered) - 1) / (max_shapes - 1)) for i in range(max_shapes)}) \
            if max_shapes > 1 else [len(ordered) - 1]
        skipped.append(f"{len(ordered) - len(picks)} more shape(s) of the fleet (--max-shapes {max_shapes}): "
                       + ", ".join(k for i, k in enumerate(ordered) if i not in picks))
        ordered = [ordered[i] for i in picks]
    return {key: shapes[key] for key in ordered}, skipped


def _check_device(name: str, gpu_key: str, cuda: bool) -> None:
    """Refuse to count a device that is one catalogue GPU for another (an H200 measured as the fleet's H20: the
    profile would say its terms were measured on the H20); note a name that matches no catalogue GPU."""
    if not cuda:
        return
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    device_is = sorted(key for key in _catalogue() if key.split("-")[0] in words)  # "NVIDIA H200" -> h200
    if device_is and gpu_key in _catalogue() and gpu_key not in device_is:
        _fail(f"this device is {name} (GPU type {' or '.join(device_is)}), not {gpu_key}: the profile would say its "
              f"terms were measured on {gpu_key}; pass --gpu {device_is[0]} (on {gpu_key} they then read as estimates)")
    if gpu_key not in device_is:
        console.print(f"[yellow]note[/]: measuring {name} for GPU type {gpu_key!r}: the profile says it was "
                      f"measured on {gpu_key}; pass --gpu if that is not what this device is")


def _shape_table(m: dict[str, Any]) -> Table:
    table = Table(title=f"measured on {m['device']} (medians)")
    for column in ("shape", "GB", "switch s (GB/s)", "prefill ms (tokens)", "decode ms (batch x ctx)", "KV out/in GB/s"):
        table.add_column(column, justify="left" if column == "shape" else "right")
    for name, shape in m["shapes"].items():
        swap = next(s for s in m["swap"] if s["arch"] == name)
        prefill = " ".join(f"{p['seconds'] * 1e3:.1f} ({p['tokens']})" for p in m["prefill"]
                           if p["arch"] == name and p["batch"] == 1)
        decode = " ".join(f"{d['seconds'] * 1e3:.2f} ({d['batch']}x{d['context']}{'' if d['graphs'] else ' eager'})"
                          for d in m["decode"] if d["arch"] == name)
        kv = [k for k in m["kv_move"] if k["arch"] == name]
        moved = f"{kv[-1]['bytes'] / kv[-1]['save_s'] / 1e9:.1f} / {kv[-1]['bytes'] / kv[-1]['restore_s'] / 1e9:.1f}" \
            if kv else "-"
        table.add_row(name, f"{shape['weight_bytes'] / 1e9:.2f}",
                      f"{swap['seconds']:.3f} ({swap['bytes'] / swap['seconds'] / 1e9:.1f})", prefill, decode, moved)
    return table


def _terms_table(profile: Any, checks: list[Any]) -> Table:
    from sims.profiles import TERM_NAMES

    worst: dict[str, float] = {}
    for check in checks:
        family = check.label.split(" ")[0]
        worst[family] = max(worst.get(family, 0.0), abs(check.error))
    gpu = profile.calibration.gpu
    table = Table(title=f"profile {profile.name}: terms on {gpu} (fit error: worst |predicted/measured - 1| "
                        + ", ".join(f"{k} {v:.1%}" for k, v in worst.items()) + ")")
    table.add_column("term")
    table.add_column("value", justify="right")
    table.add_column("from")
    for term in TERM_NAMES:
        value = getattr(profile.terms, term)
        shown = "-" if value is None else str(value) if isinstance(value, (bool, str)) else f"{value:g}"
        table.add_row(term, shown, "measured here" if profile.status(term, gpu) == "measured" else "base profile")
    return table


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("modelpool")
    except Exception:  # not installed (a source tree on the GPU box)
        return ""


def _catalogue() -> dict[str, Any]:
    from scheduler.fleet import GPUS

    return dict(GPUS)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)
