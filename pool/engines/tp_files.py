"""The files a tensor-parallel instance's ranks meet through, and removing those a killed process left.

Rank 0's process names its rendezvous file (a `torch.distributed.FileStore`
in /dev/shm) after its pid and removes it when its engine closes. A process
killed first (a crash, a fault test, a hung instance's replacement) cannot:
earlier test runs left `modelpool-tp-*` files behind. The process that
started it removes them once it is gone (`pool.procs.stop_worker`); a Ray
actor has no such parent, so every TP instance that starts, and a pool that
stops, removes the files of processes that are gone (`sweep_dead`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


PREFIX = "modelpool-tp-"  # then rank 0's pid, '-', a unique part


def _folder() -> Path:
    return Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())


def store_stem(pid: int) -> str:
    """Where the rendezvous files of TP instances whose rank 0 runs in process `pid` start (in /dev/shm when
    there is one). `close()` removes its own; the process that started `pid` removes what a killed one left
    (`remove_stores`)."""
    return str(_folder() / f"{PREFIX}{pid}-")


def remove_stores(pid: int) -> int:
    """Remove the rendezvous files process `pid` left (it is gone: killed before its engines closed); how many."""
    stem = Path(store_stem(pid))
    return _remove(stem.parent.glob(stem.name + "*"))


def sweep_dead() -> int:
    """Remove the rendezvous files on this machine whose rank-0 process is gone; how many. A file of a live
    process (another pool's, or a pid reused since) is left alone."""
    def dead(path: Path) -> bool:
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        return pid.isdigit() and not _alive(int(pid))

    return _remove(path for path in _folder().glob(PREFIX + "*") if dead(path))


def _remove(paths: Iterable[Path]) -> int:
    removed = 0
    for path in paths:
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
