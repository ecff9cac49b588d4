"""This machine's GPUs: how many the pool may use, what catalogue GPU the first one is, whether a fleet's fits.

Read once at `serve` start-up, before anything is placed: the count (Ray's cluster resources, or torch's
devices without Ray), the catalogue key the demo fleet's cost model counts with, and the check that a fleet
file's `pool: gpu:` is no larger than GPU 0 (the memory plan is cut from it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer


def count_gpus(backend: str, address: str | None) -> int:
    """GPUs the pool may place instances on: the Ray cluster's (the one serve joined or started), else this
    machine's as torch sees them (0 without torch)."""
    if backend == "ray":
        import ray

        return int(ray.cluster_resources().get("GPU", 0))
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def gpu_key(given: str | None, device_name: Callable[[], str] | None = None) -> str:
    """The catalogue GPU the demo's cost model counts with: `given` (--gpu), else the one named like this
    machine's GPU 0 (`device_name`, default torch's). A GPU the catalogue does not know is an error naming
    it and the known ones: costing it as some other GPU would mis-time every plan without a word."""
    from scheduler.catalog import GPUS

    known = ", ".join(GPUS)
    if given is not None:
        if given.lower() not in GPUS:
            raise typer.BadParameter(f"unknown GPU type {given!r}; known: {known}", param_hint="--gpu")
        return given.lower()
    try:
        name = (device_name or cuda_device_name)()
    except Exception as exc:
        raise typer.BadParameter(f"cannot read this machine's GPU name ({exc!r}); give the GPU type to cost the "
                                 f"demo with: --gpu KEY (known: {known})", param_hint="--gpu") from None
    lowered = name.lower()
    for key in ("h200", "h20", "h800", "h100", "a100"):
        if key in lowered:
            return "a100-80gb" if key == "a100" else key
    raise typer.BadParameter(f"GPU {name!r} is not in the catalogue (known: {known}); give --gpu KEY to cost the "
                             "demo as one of them, or serve a fleet file whose `gpus:` describes it",
                             param_hint="--gpu")


def check_gpu_memory(gpu: str, memory_gb: float, fleet_path: Path,
                     device: Callable[[], tuple[str, int] | None] | None = None) -> None:
    """Refuse a fleet whose `pool: gpu:` has more memory than this machine's GPU 0 (`device`: its name and
    total bytes, None where this process sees no CUDA device): the memory plan (weights, KV, arenas) is cut
    from the fleet's GPU, and on a smaller card the engines would run out of memory part-way through start-up
    (a fleet for an h200 on an H100 did: the weights keeper's region no longer fit)."""
    found = (device or cuda_device)()
    if found is None:
        return
    name, total = found
    if memory_gb * 1e9 > total * 1.02:
        try:
            hint = f"set `pool: gpu:` to this GPU's type ({gpu_key(None, lambda: name)!r})"
        except typer.BadParameter:
            hint = "describe this GPU in the fleet's `gpus:`"
        raise typer.BadParameter(f"{fleet_path}: pool.gpu is {gpu!r} ({memory_gb:g} GB), but this machine's GPU 0 "
                                 f"is {name} with {total / 1e9:.1f} GB: the memory plan would not fit it; {hint}",
                                 param_hint="--fleet")


def cuda_device() -> tuple[str, int] | None:
    """GPU 0's name and total memory in bytes; None where this process sees no CUDA device (or has no torch)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(0)), int(torch.cuda.get_device_properties(0).total_memory)


def cuda_device_name() -> str:
    """GPU 0's name as torch reports it (e.g. "NVIDIA H100 80GB HBM3")."""
    import torch

    return str(torch.cuda.get_device_name(0))
