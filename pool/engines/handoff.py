"""P/D hand-offs through device memory: the prefill engine stages a request's KV in an arena of its own device
memory, the decode engine copies it from there into its blocks, and the prefill engine frees the region when
it hears the request is gone (`release`).

Through host memory a hand-off is a copy off the device, a shared-memory file written by one process and read
by the other, and a copy back: on the H200 the decode instance's `import_kv` took 31 ms at the median and
114 ms at p90 for 150 MB (10 req/s; the benchmark diary, git show 1476354:BENCHMARKS.md) while its batch
waited. Between two instances on one GPU the KV never needs to leave it: staged, it is one gather and one
scatter within device memory.

The arena is one allocation per staging engine, made at its first staged export. Another process opens it
once from its CUDA IPC handle (torch.multiprocessing's reductions: the handle, and the event that orders the
opener after the allocation); on CPU, where the tests run, the arena is a shared-memory file instead. Opened
arenas are cached per process; one whose owner process has died is closed at the opener's next stats
(`close_orphans`). A staged export (`pool.engines.base.StagedKv`) names the arena, an offset and a length: small and picklable,
carried by the controller like any export. Its region stays taken until the owner's `release` of the request;
a region never released is lost to staging, not to correctness (an arena with no room left stages nothing:
the export goes through host memory as before). The exporter finishes its gather before `export_kv` returns
and the importer its copy before `import_kv` returns, so the region is complete when read and free to reuse
once released.
"""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

from pool.engines.base import ArenaRef
from pool.engines.weights_keeper import alive

ALIGN = 512  # bytes; regions start aligned (vectorised copies)
_SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())

_OPEN: dict[str, tuple[int, torch.Tensor]] = {}  # arena key -> (owner pid, its bytes here): own and opened arenas
_OPEN_LOCK = threading.Lock()


class StagingArena:
    """The exporting engine's arena: `nbytes` of device memory and the regions taken in it (first fit)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes < ALIGN:
            raise ValueError(f"a staging arena of {nbytes} bytes is too small (at least {ALIGN})")
        key = uuid.uuid4().hex
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ipc, path = tuple(reduce_tensor(self.storage)[1]), None
        else:
            path = str(_SHM_DIR / f"modelpool-arena-{os.getpid()}-{key}")
            self.storage = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            weakref.finalize(self, _unlink, path)
            ipc = None
        self.ref = ArenaRef(os.getpid(), key, nbytes, str(device), ipc, path)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset, never adjacent
        self._taken: dict[int, int] = {}  # offset -> size
        with _OPEN_LOCK:
            _OPEN[key] = (os.getpid(), self.storage)
        weakref.finalize(self, _forget, key)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free region of `nbytes`, now taken; None when none is free."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, room) in enumerate(self._free):
            if room >= size:
                if room == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, room - size)
                self._taken[offset] = size
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._taken.pop(offset)
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, (offset, size))
        if i + 1 < len(free) and offset + size == free[i + 1][0]:  # merge with the next
            free[i] = (offset, size + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and the previous
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    @property
    def used_bytes(self) -> int:
        return sum(self._taken.values())


def open_arena(ref: ArenaRef) -> torch.Tensor:
    """The bytes of the arena `ref` names, in this process: its own, or opened (once) from another process's."""
    with _OPEN_LOCK:
        held = _OPEN.get(ref.key)
        if held is not None:
            return held[1]
        _close_orphans()
        if ref.ipc is not None:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            storage = rebuild_cuda_tensor(*ref.ipc)
        elif ref.path is not None:
            storage = torch.from_file(ref.path, shared=True, size=ref.nbytes, dtype=torch.uint8)
        else:
            raise ValueError(f"arena {ref.key} of process {ref.pid} has neither an IPC handle nor a file")
        _OPEN[ref.key] = (ref.pid, storage)
        return storage


def close_orphans() -> None:
    """Close the arenas opened from processes that have died (a lost or restarted prefill instance's), so their
    device memory goes before the successor makes its own: an engine calls it with its stats, every few
    seconds at most, long before a restarted instance has loaded its models."""
    with _OPEN_LOCK:
        _close_orphans()


def _close_orphans() -> None:
    for key, (pid, _) in list(_OPEN.items()):
        if pid != os.getpid() and not alive(pid):
            del _OPEN[key]


def staged_view(ref: ArenaRef, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`shape` of `dtype` at `offset` in the arena `ref` names (its owner's, or one opened from it)."""
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    if offset < 0 or offset + nbytes > ref.nbytes:
        raise ValueError(f"staged KV at {offset}+{nbytes} is outside arena {ref.key} ({ref.nbytes} bytes)")
    return open_arena(ref)[offset : offset + nbytes].view(dtype).view(shape)


def _forget(key: str) -> None:
    with _OPEN_LOCK:
        _OPEN.pop(key, None)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def opened_arenas() -> dict[str, Any]:
    """Arena key -> owner pid of every arena this process holds (its own and opened ones): for tests."""
    with _OPEN_LOCK:
        return {key: pid for key, (pid, _) in _OPEN.items()}
