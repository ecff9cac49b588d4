"""The keeper of a device's shared weights region (`pool.engines.shared_weights`): the one process that owns it.

Started by the first engine that opens the region, it allocates the region and publishes how to map it
(on CUDA the allocation's IPC handle, on CPU a shared-memory file), then holds it until no process that
maps it has been alive for `grace_s`. It runs no model code, so no engine's crash frees weights another
engine reads. Standard library only, but for torch on CUDA: it starts in well under a second on CPU.

    python -m pool.engines.weights_keeper --dir D --device cuda:0 --nbytes N [--grace-s S]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KEEPER_GRACE_S = 30.0  # the keeper outlives its last engine this long (a lone instance's restart reloads its models)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def device_tag(device: str) -> str:
    """'cuda:0' -> 'cuda0', 'cpu' -> 'cpu': the region's files are named by it."""
    return device.replace(":", "")


class Files:
    """The files of one device's region under the share directory."""

    def __init__(self, share_dir: Path, device: str) -> None:
        tag = device_tag(str(device))
        self.dir = share_dir
        self.lock = share_dir / f"{tag}.lock"
        self.table = share_dir / f"{tag}.json"  # keeper pid, layout, generation, copies
        self.handle = share_dir / f"{tag}.handle"  # how to map the region (written by the keeper)
        self.region = share_dir / f"{tag}.region"  # the region's bytes on CPU
        self.holders = share_dir / f"{tag}.holders"  # a file per process that maps the region, named by pid
        self.log = share_dir / f"{tag}.keeper.log"

    @contextmanager
    def locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.lock, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def read_table(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.table.read_text()))
        except (FileNotFoundError, ValueError):
            return None

    def write_table(self, table: Mapping[str, Any]) -> None:
        tmp = self.table.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(table))
        tmp.replace(self.table)

    def live_holders(self) -> list[int]:
        """Pids of the processes that map the region and are alive; marks of dead ones are removed."""
        out = []
        for mark in self.holders.glob("*") if self.holders.is_dir() else ():
            pid = int(mark.name) if mark.name.isdigit() else -1
            if pid > 0 and alive(pid):
                out.append(pid)
            else:
                mark.unlink(missing_ok=True)
        return out


# ---- the keeper process ---------------------------------------------------------------------------------------
def _publish(files: Files, device: str, nbytes: int) -> Any:
    """Allocate the region and write how to map it; returns what must stay alive."""
    if device.startswith("cuda"):
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.set_device(device)
        storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        published: dict[str, Any] = {"kind": "cuda", "ipc": tuple(reduce_tensor(storage)[1]), "nbytes": nbytes}
    else:
        with open(files.region, "wb") as handle:
            handle.truncate(nbytes)
        storage = None
        published = {"kind": "cpu", "path": str(files.region), "nbytes": nbytes}
    tmp = files.handle.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(published))
    tmp.replace(files.handle)
    return storage


def keep(share_dir: Path, device: str, nbytes: int, grace_s: float,
         sleep: Callable[[float], None] = time.sleep) -> None:
    """The keeper's life: publish the region, then hold it until no process that maps it has been alive for
    `grace_s`; then, under the lock, remove its files (a later engine starts a fresh region)."""
    files = Files(share_dir, device)
    storage = _publish(files, device, nbytes)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    last_seen = time.monotonic()
    while not stop.is_set():
        sleep(min(0.2, grace_s / 4))
        if files.live_holders():
            last_seen = time.monotonic()
            continue
        if time.monotonic() - last_seen < grace_s:
            continue
        with files.locked():
            if files.live_holders():
                continue
            table = files.read_table()
            if table is not None and int(table["keeper"]) == os.getpid():
                files.table.unlink(missing_ok=True)
            break
    with files.locked():
        for done in (files.handle, files.region, files.log):
            done.unlink(missing_ok=True)
        _remove_empty(files.holders)
    files.lock.unlink(missing_ok=True)
    _remove_empty(files.dir)  # the last device's keeper leaves nothing behind
    del storage


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Hold one device's shared weights region (started by engines).")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--grace-s", type=float, default=KEEPER_GRACE_S)
    args = parser.parse_args(argv)
    keep(args.dir, args.device, args.nbytes, args.grace_s)


if __name__ == "__main__":
    main()
