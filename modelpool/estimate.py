"""`modelpool estimate`: what the roofline predicts for one model on one GPU type.

For a batch of `batch` requests of `input_tokens` prompt and `output_tokens`
output tokens: prefill time and TTFT, decode step time and TPOT as context
grows, tokens per second, weight and KV-cache memory, and the switch time.
Every number comes from sims.costmodel with a calibration profile; the report
says which profile terms are measured on that GPU, which are estimated from
datasheet ratios (an efficiency measured on another GPU applied to this GPU's
datasheet figures), which are carried over unchanged, and which are assumed.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from scheduler.catalog import ARCHS
from scheduler.fleet import GB, GPUS, Arch, Fleet, GpuSpec, PoolSpec
from sims.costmodel import RooflineCostModel, device_spec
from sims.profiles import TERM_NAMES, load_profile

DEFAULT_FLEET = Path("models.yaml")


def estimate_report(fleet: Fleet | None, model: str, gpu: str | None, tp: int | None, batch: int,
                    input_tokens: int, output_tokens: int, profile: str = "default") -> dict[str, Any]:
    """Predicted latencies, throughput and memory of `model` (a fleet model name or a catalogue
    arch key) on `gpu`, as a JSON-ready dict. Times in seconds, sizes in bytes.

    TTFT is the prefill of one prompt alone (no queueing); TPOT is the mean decode step over the
    output (max(output_tokens - 1, 1) steps, every request one token per step, context growing).
    KV capacity is GPU memory * utilisation * tp less the weights (activations not deducted).
    """
    if min(batch, input_tokens, output_tokens) < 1:
        raise ValueError(f"batch, input and output tokens must be >= 1, got {batch}, {input_tokens}, {output_tokens}")
    arch, arch_name, fleet_tp, gpu_name, spec, utilisation = _resolve(fleet, model, gpu)
    tp = tp or fleet_tp
    calibration = load_profile(profile)
    # the rates `simulate` costs with: a profile measured on this device (a CPU) brings its own; memory stays the fleet's
    rates = device_spec(gpu_name, calibration, {gpu_name: spec})
    cost = RooflineCostModel.for_models({model: (arch, tp)}, rates, calibration, gpu_name=gpu_name)
    first_context = batch * (input_tokens + 1)  # the first decode step also reads its own token's KV
    num_steps = max(output_tokens - 1, 1)
    decode_s = cost.decode_turn_s(model, batch, first_context, num_steps)
    tpot_s = decode_s / num_steps
    prefill_s = cost.prefill_s(model, batch * input_tokens, batch)
    kv_per_token = cost.constants(model).kv_bytes_per_token_gpu * tp
    usable_bytes = spec.memory_gb * GB * utilisation * tp
    kv_bytes = max(0.0, usable_bytes - arch.weight_bytes)
    kv_tokens = math.floor(kv_bytes / kv_per_token)
    bases = calibration.bases(gpu_name)
    fits = arch.weight_bytes < usable_bytes
    latencies: dict[str, Any] = {
        "ttft_s": cost.prefill_s(model, input_tokens, 1), "prefill_s": prefill_s,
        "decode_step_s": cost.decode_step_s(model, batch, first_context),
        "decode_bound": cost.decode_bound(model, batch, first_context), "tpot_s": tpot_s,
        "e2e_s": prefill_s + (decode_s if output_tokens > 1 else 0.0),
        "tokens_per_s_per_user": 1.0 / tpot_s, "tokens_per_s": batch / tpot_s,
    }
    if not fits:  # a model that cannot be loaded has no latency: the roofline's figures would be fiction
        latencies = dict.fromkeys(latencies)
    return {
        "model": model, "arch": arch_name, "gpu": gpu_name, "tp": tp, "profile": calibration.name,
        "batch": batch, "input_tokens": input_tokens, "output_tokens": output_tokens, **latencies,
        "weight_bytes": arch.weight_bytes, "weight_bytes_per_gpu": arch.weight_bytes / tp,
        "weights_fit": fits, "usable_bytes_per_gpu": usable_bytes / tp,
        "smallest_tp_that_fits": next((n for n in (1, 2, 4, 8) if arch.weight_bytes < usable_bytes / tp * n), None),
        "switch_s": cost.switch_s(model), "gpu_memory_utilization": utilisation,
        "kv_bytes_per_token": kv_per_token, "kv_capacity_bytes": kv_bytes, "kv_capacity_tokens": kv_tokens,
        "max_concurrent_requests": kv_tokens // (input_tokens + output_tokens),
        "batch_fits": batch * (input_tokens + output_tokens) <= kv_tokens,
        "provenance": {term: calibration.status(term, gpu_name) for term in TERM_NAMES},
        "basis": bases, "measured_elsewhere_on": sorted({g for basis in ("datasheet ratio", "carried over")
                                                        for term in bases[basis]
                                                        for g in calibration.entry(term, gpu_name).gpus}),
    }


def _resolve(fleet: Fleet | None, model: str, gpu: str | None) -> tuple[Arch, str, int, str, GpuSpec, float]:
    """(arch, arch name, tp, gpu name, gpu spec, memory utilisation) of a fleet model or a catalogue arch."""
    names = [entry.name for entry in fleet.models] if fleet else []
    gpu_name = (gpu or (fleet.pool.gpu if fleet else "")).lower()
    known_gpus = sorted(set(GPUS) | set(fleet.gpus if fleet else {}))
    if gpu_name not in known_gpus:
        raise ValueError(f"unknown GPU {gpu or ''!r}; known: {', '.join(known_gpus)}")
    spec = fleet.gpu(gpu_name) if fleet else GPUS[gpu_name]
    utilisation = (fleet.pool if fleet else PoolSpec()).gpu_memory_utilization
    if fleet and model in names:
        entry = fleet.model(model)
        return entry.arch, entry.arch_name, entry.tp, gpu_name, spec, utilisation
    key = model.strip().lower()
    if key not in ARCHS:
        raise ValueError(f"unknown model {model!r}: not a fleet model ({', '.join(names) or 'no fleet'}) "
                         f"nor a catalogue arch ({', '.join(sorted(ARCHS))})")
    return Arch.model_validate(ARCHS[key]), key, 1, gpu_name, spec, utilisation


def render_estimate(report: dict[str, Any], width: int = 88) -> str:
    """`estimate_report`'s dict as a readable text table."""
    r = report
    ms = lambda s: f"{s * 1e3:,.2f} ms"  # noqa: E731
    gb = lambda b: f"{b / GB:,.2f} GB"  # noqa: E731
    basis = r["basis"]
    elsewhere = ", ".join(g.upper() for g in r["measured_elsewhere_on"]) or "another GPU"
    terms = lambda key: ", ".join(sorted(basis[key])) or "none"  # noqa: E731
    if not r["weights_fit"]:
        return _not_fitting(r, width)
    rows = [
        ("TTFT (one prompt, no queue)", ms(r["ttft_s"])),
        (f"prefill of the batch ({r['batch']} x {r['input_tokens']} tokens)", ms(r["prefill_s"])),
        ("first decode step", f"{ms(r['decode_step_s'])} ({r['decode_bound']} bound)"),
        (f"TPOT (mean over {max(r['output_tokens'] - 1, 1)} steps)", ms(r["tpot_s"])),
        ("end to end (batch prefill + decode)", f"{r['e2e_s']:,.3f} s"),
        ("tokens/s per user / aggregate", f"{r['tokens_per_s_per_user']:,.1f} / {r['tokens_per_s']:,.1f}"),
        ("weights (total / per GPU)", f"{gb(r['weight_bytes'])} / {gb(r['weight_bytes_per_gpu'])}"
                                      + ("" if r["weights_fit"] else "  (do NOT fit: raise --tp)")),
        ("switch in from pinned host memory", f"{r['switch_s']:.3f} s"),
        (f"KV cache left ({r['gpu_memory_utilization']:.0%} of memory)",
         f"{gb(r['kv_capacity_bytes'])} = {r['kv_capacity_tokens']:,} tokens ({r['kv_bytes_per_token'] / 1024:,.0f} KiB/token)"),
        (f"concurrent requests of {r['input_tokens'] + r['output_tokens']} tokens",
         f"{r['max_concurrent_requests']:,}" + ("" if r["batch_fits"] else f"  (batch {r['batch']} does NOT fit)")),
        (f"profile terms measured on {r['gpu'].upper()}", terms("measured")),
        (f"estimated from datasheet ratios (efficiencies measured on {elsewhere})", terms("datasheet ratio")),
        (f"carried over unchanged (times measured on {elsewhere})", terms("carried over")),
        ("assumed (measured on no GPU)", terms("assumed")),
    ]
    arch = f" ({r['arch']})" if r["arch"] and r["arch"] != r["model"] else ""
    table = Table(title=f"{r['model']}{arch} on {r['tp']} x {r['gpu'].upper()}, batch {r['batch']}, "
                        f"{r['input_tokens']} in / {r['output_tokens']} out, profile {r['profile']}")
    table.add_column("quantity")
    table.add_column("predicted")
    for name, value in rows:
        table.add_row(name, value)
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue()


def not_fitting_line(r: dict[str, Any]) -> str:
    """Why `r`'s model cannot run on its GPUs, and the TP size that would hold its weights."""
    gb = r["weight_bytes"] / GB
    usable = r["usable_bytes_per_gpu"] / GB
    fix = (f"try --tp {r['smallest_tp_that_fits']}" if r["smallest_tp_that_fits"]
           else "more than 8 GPUs' memory: it does not fit one node of these")
    return (f"{r['model']} does not fit {r['tp']} x {r['gpu'].upper()}: {gb:,.1f} GB of weights against "
            f"{usable * r['tp']:,.1f} GB usable ({usable:,.1f} GB per GPU at {r['gpu_memory_utilization']:.0%} of "
            f"memory); no latency is predicted ({fix})")


def _not_fitting(r: dict[str, Any], width: int) -> str:
    gb = lambda b: f"{b / GB:,.2f} GB"  # noqa: E731
    table = Table(title=f"{r['model']} on {r['tp']} x {r['gpu'].upper()}: does NOT fit")
    table.add_column("quantity")
    table.add_column("value")
    table.add_row("weights (total / per GPU)", f"{gb(r['weight_bytes'])} / {gb(r['weight_bytes_per_gpu'])}")
    table.add_row(f"usable per GPU ({r['gpu_memory_utilization']:.0%} of memory)", gb(r["usable_bytes_per_gpu"]))
    table.add_row("smallest TP that holds the weights", str(r["smallest_tp_that_fits"] or "over 8"))
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(table)
    console.print(not_fitting_line(r), soft_wrap=True)
    return buffer.getvalue()


def estimate_command(
    model: Annotated[str, typer.Option("--model", help="Fleet model name or catalogue arch (e.g. qwen2.5-7b).")],
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU type (e.g. h200); defaults to the fleet's pool GPU.")] = None,
    tp: Annotated[int | None, typer.Option("--tp", min=1, help="Tensor-parallel size (default: the fleet's, else 1).")] = None,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Requests decoded together.")] = 1,
    input_tokens: Annotated[int, typer.Option("--input", min=1, help="Prompt tokens per request.")] = 512,
    output_tokens: Annotated[int, typer.Option("--output", min=1, help="Output tokens per request.")] = 256,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    profile: Annotated[str, typer.Option("--profile", help="Calibration profile: a shipped name or a JSON file.")] = "default",
    fleet_path: Annotated[Path, typer.Option("--fleet", "-f", help="Fleet file to take models and GPUs from "
                                             "(models.yaml; without one here, --gpu and a catalogue arch).")] = DEFAULT_FLEET,
    force_profile: Annotated[bool, typer.Option("--force-profile", help="Use --profile even where it was measured "
                                                "on a CPU and the GPU is a catalogue GPU (refused otherwise).")] = False,
) -> None:
    """Predict latency, throughput and memory of one model on one GPU type (roofline cost model)."""
    from modelpool.config import FleetFileError, load_fleet
    from modelpool.simulate import profile_device_check

    try:
        # like the other commands, models.yaml by default; a missing default is no error (catalogue archs need none)
        fleet = None if fleet_path == DEFAULT_FLEET and not fleet_path.exists() else load_fleet(fleet_path)
        if fleet is None and gpu is None:
            raise ValueError(f"no --gpu and no fleet file to take it from ({fleet_path} not found here): "
                             f"pass --gpu TYPE (e.g. h20, h100, h200) or --fleet FILE")
        report = estimate_report(fleet, model, gpu, tp, batch, input_tokens, output_tokens, profile)
        mismatch = profile_device_check(load_profile(profile), report["gpu"], profile, force_profile)
    except (FleetFileError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if mismatch:
        typer.echo(mismatch, err=True)
    typer.echo(json.dumps(report, indent=2) if as_json else render_estimate(report).rstrip())
    if not report["weights_fit"]:
        raise typer.Exit(1)
