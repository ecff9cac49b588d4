"""How engine processes that share a GPU run: side by side under a private CUDA MPS daemon, or time-sliced.

`serve --mps` starts a daemon (pool.mps) and refuses the option where it cannot serve this machine's GPUs;
by default one is started where instances of `--backend processes` share a GPU and a CUDA client can run
under it, else they are time-sliced; the banner's notes say which and why.
"""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING

import typer

from pool.mps import PIPE_ENV, MpsDaemon, MpsError

if TYPE_CHECKING:
    from modelpool.deploy import Deployment


def share_gpus(dep: Deployment, daemon: MpsDaemon | None, mps: bool | None, engine: str) -> MpsDaemon | None:
    """How instances on one GPU share it, in the banner's notes: the --mps daemon, one started where it helps
    (the default), or time slices; returns the daemon to stop at the end."""
    if daemon is not None:  # --mps
        dep.notes += mps_notes(dep, daemon)
    elif mps is None and engine != "sim":
        daemon, notes = auto_mps(dep)
        dep.notes += notes
    else:
        dep.notes += time_slicing_notes(dep, "--no-mps" if mps is False else "--mps runs them side by side")
    return daemon


def check_mps(daemon: MpsDaemon, num_gpus: int) -> None:
    """--mps: a daemon that cannot serve this machine's GPUs is stopped and the option refused."""
    try:
        if num_gpus == 0:
            raise MpsError("MPS shares a GPU: this machine has no CUDA GPU")
        daemon.check_client()
    except MpsError as exc:
        daemon.stop()
        raise typer.BadParameter(str(exc), param_hint="--mps") from None


def shared_gpus(dep: Deployment) -> dict[str, list[str]]:
    """Each GPU that two or more instances' engine processes share (--backend processes on CUDA): its instances."""
    if dep.device != "cuda" or dep.backend != "processes":
        return {}
    by_device: dict[str, list[str]] = {}
    for instance, device in dep.devices.items():
        by_device.setdefault(device, []).append(instance)
    return {device: ids for device, ids in by_device.items() if len(ids) > 1}


def time_slicing_notes(dep: Deployment, why: str) -> list[str]:
    """A note for each GPU whose instances run in processes CUDA time-slices (no MPS daemon), saying `why`."""
    return [f"{', '.join(ids)} share {device}, whose time CUDA slices between their processes (a prefill beside a "
            f"decoding process ran 1.8x its time alone on the H200); {why}"
            for device, ids in shared_gpus(dep).items()]


def start_mps(backend: str, engine: str) -> MpsDaemon:
    """A private MPS daemon for `--mps`, its client environment set in this process (the engine processes
    inherit it); stopped at exit at the latest."""
    if backend != "processes" or engine == "sim":
        raise typer.BadParameter("MPS is for the torch or vllm engine's processes of --backend processes (threads "
                                 "share one CUDA context already; Ray starts its actors elsewhere)", param_hint="--mps")
    daemon = MpsDaemon()
    try:
        os.environ.update(daemon.start())
    except MpsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--mps") from None
    atexit.register(daemon.stop)
    return daemon


def auto_mps(dep: Deployment) -> tuple[MpsDaemon | None, list[str]]:
    """serve's default (neither --mps nor --no-mps): a private MPS daemon where engine processes share a GPU, so
    they run side by side (a prefill 1.07x its time alone beside a decoder, 1.80x time-sliced: pool.mps);
    where none can be started, or a CUDA client cannot run under it, the instances are time-sliced and the notes
    say why. Set before the engine processes start, which inherit its environment (this process has used no CUDA
    context yet)."""
    shared = shared_gpus(dep)
    if not shared:
        return None, []
    daemon = MpsDaemon()
    try:
        env = daemon.start()
        daemon.check_client()  # a default must not break serve where MPS cannot run: then time-sliced, said why
    except MpsError as exc:
        daemon.stop()
        return None, time_slicing_notes(dep, f"no MPS daemon: {exc}")
    os.environ.update(env)
    atexit.register(daemon.stop)
    return daemon, mps_notes(dep, daemon)


def mps_notes(dep: Deployment, daemon: MpsDaemon) -> list[str]:
    """A note for each GPU whose instances' engine processes run side by side as clients of `daemon`."""
    return [f"{', '.join(ids)} share {device} side by side: their engine processes are clients of a "
            f"{'private ' if daemon.folder else ''}CUDA MPS daemon ({daemon.env.get(PIPE_ENV)}; --no-mps: time-sliced)"
            for device, ids in shared_gpus(dep).items()]
