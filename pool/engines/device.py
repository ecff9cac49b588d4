"""The one device buffer and its bump allocator, plus CUDA stream/event helpers.

An engine takes all its device memory once, up front (Aegaeon's layout:
KV region | model slot | model slot), so switching models never calls the
caching allocator and never fragments. On CPU the "device" buffer is a plain
tensor and every stream or event helper degrades to synchronous no-ops, so
the same code paths run in tests.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ALIGN_BYTES = 256
REGISTER_MIN_BYTES = 256 << 20


def align_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    return (nbytes + align - 1) // align * align


@dataclass(frozen=True, slots=True)
class Region:
    """Bytes [offset, offset + nbytes) of a buffer."""

    name: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def overlaps(self, other: Region) -> bool:
        return self.offset < other.end and other.offset < self.end


class BumpAllocator:
    """Hands out aligned, non-overlapping regions from the front of a fixed capacity."""

    def __init__(self, capacity_bytes: int, align: int = ALIGN_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes = {capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.align = align
        self._top = 0
        self._regions: list[Region] = []

    def alloc(self, name: str, nbytes: int) -> Region:
        if nbytes < 0:
            raise ValueError(f"region {name!r}: nbytes = {nbytes} must be >= 0")
        offset = align_up(self._top, self.align)
        if offset + nbytes > self.capacity_bytes:
            raise MemoryError(
                f"region {name!r} of {nbytes} bytes does not fit: {self.capacity_bytes - offset} of "
                f"{self.capacity_bytes} bytes left"
            )
        region = Region(name, offset, nbytes)
        self._top = offset + nbytes
        self._regions.append(region)
        return region

    def mark(self) -> int:
        return len(self._regions)

    def reset(self, mark: int = 0) -> None:
        """Forget every region allocated after `mark()` returned `mark` (all of them by default)."""
        del self._regions[mark:]
        self._top = self._regions[-1].end if self._regions else 0

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    @property
    def used_bytes(self) -> int:
        return self._top

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._top


_HELD: Counter[str] = Counter()  # device -> bytes of the DeviceBuffers alive in this process
_HELD_LOCK = threading.Lock()


def held_device_bytes(device: str | torch.device | None = None) -> int:
    """Bytes of engine device buffers alive in this process (on `device`, or on all)."""
    with _HELD_LOCK:
        return _HELD[str(device)] if device is not None else sum(_HELD.values())


def _release(key: str, nbytes: int) -> None:
    with _HELD_LOCK:
        _HELD[key] -= nbytes


class DeviceBuffer:
    """One byte tensor on the device, carved into named regions; counted in `held_device_bytes` until freed."""

    def __init__(self, layout: dict[str, int], device: torch.device) -> None:
        self.allocator = BumpAllocator(sum(align_up(n) for n in layout.values()))
        self.regions = {name: self.allocator.alloc(name, nbytes) for name, nbytes in layout.items()}
        self.storage = torch.empty(self.allocator.capacity_bytes, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            self.storage.zero_()  # fault the pages in now, not inside the first switch
        key = str(self.storage.device)
        with _HELD_LOCK:
            _HELD[key] += self.nbytes
        # counted until the memory itself goes: the storage outlives this tensor while any view of it is alive
        weakref.finalize(self.storage.untyped_storage(), _release, key, self.nbytes)

    def region(self, name: str) -> torch.Tensor:
        r = self.regions[name]
        return self.storage[r.offset : r.end]

    @property
    def nbytes(self) -> int:
        return self.allocator.capacity_bytes


def pinned_empty(nbytes: int, pin: bool, owner: object | None = None) -> torch.Tensor:
    """A host byte buffer, page-locked when `pin`.

    Large buffers are page-locked with cudaHostRegister: torch's pinned
    allocator rounds every size up to a power of two (a 27.5 GiB model would
    hold 32 GiB). The registration ends when `owner` (else the tensor) is
    collected; torch's pinned allocator is the fallback.
    """
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    if nbytes >= REGISTER_MIN_BYTES:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        try:
            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) == 0:
                weakref.finalize(owner if owner is not None else buffer, cudart.cudaHostUnregister, buffer.data_ptr())
                return buffer
        except (AttributeError, RuntimeError):
            pass
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


# ---- one process, several engines ------------------------------------------------------
class DeviceGate:
    """Engine calls share the device; a CUDA-graph capture needs it alone (shared/exclusive lock).

    `torch.cuda.graph` synchronises the device and captures on a process-wide
    stream: another engine of the same process that launches work during a
    capture breaks it. Each engine call holds the gate shared (the threads
    backend does it for every call), a capture holds it exclusive; a waiting
    capture goes before new calls.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


GATE = DeviceGate()


# ---- streams and events ----------------------------------------------------------
class Streams:
    """Compute, weight-prefetch, swap-in and swap-out streams; all None on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute: Any = torch.cuda.current_stream(device)
            self.weights: Any = torch.cuda.Stream(device)
            self.swap_in: Any = torch.cuda.Stream(device)
            self.swap_out: Any = torch.cuda.Stream(device)
        else:
            self.compute = self.weights = self.swap_in = self.swap_out = None

    def on(self, stream: Any) -> Any:
        """Context manager running work on `stream` (no-op on CPU)."""
        return torch.cuda.stream(stream) if stream is not None else _NULL

    def after_compute(self, stream: Any) -> None:
        """`stream` waits for all compute queued so far (memory it reuses may still be read)."""
        if stream is not None:
            stream.wait_stream(self.compute)

    def record(self, stream: Any) -> Any:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def compute_waits(self, event: Any) -> None:
        if event is not None:
            self.compute.wait_event(event)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def compute_done(self) -> float:
        """Wait for the compute stream only (not for weight prefetches or KV swaps in flight on the others);
        returns the seconds waited."""
        if not self.cuda:
            return 0.0
        started = time.perf_counter()
        self.compute.synchronize()
        return time.perf_counter() - started


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _NullContext()


def event_done(event: Any) -> bool:
    return event is None or bool(event.query())


def wait_event(event: Any) -> None:
    if event is not None:
        event.synchronize()


# ---- step inputs, without the copy engine --------------------------------------------------
class _Mapped:
    """What `torch.as_tensor` reads a device array from: the CUDA array interface."""

    def __init__(self, pinned: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(pinned.shape), "typestr": "<i8",
                                         "data": (pinned.data_ptr(), False), "version": 3}


def mapped_view(pinned: torch.Tensor, device: torch.device | str = "cuda") -> torch.Tensor:
    """A pinned int64 host tensor seen as a CUDA tensor at the same address (unified addressing maps
    page-locked memory into the device's address space): a kernel reading it reads host memory over PCIe."""
    return torch.as_tensor(_Mapped(pinned), device=device)


class InputStage:
    """A step's inputs (token ids, positions, KV rows, block tables: a few KB) go to the device through a
    kernel that reads them from pinned host memory, not through a host-to-device copy.

    The GPU's host-to-device copy engine runs one copy at a time: a step's input copy queued behind a weight
    prefetch (0.06-0.28 s for a whole model) waits for all of it - on the H200 the decode step after a
    prefetch took 100 ms on average instead of 5. Copying weights in pieces with work between them lets the
    small copy in after a piece, but halves the weight copy's rate while another process computes on the GPU
    (the work between pieces waits for the GPU's time slice; benchmarks/gpu_copy_hol.py). A kernel's read of
    mapped memory never enters the copy engine: 0.04 ms during a whole weight copy that keeps its full rate.

    Each upload takes the next of `slots` pinned buffers (one mapped view each), waits for that buffer's
    last kernel (long done: `slots` uploads ago), writes the values and queues the read on the current
    stream. Where the platform does not map pinned memory, uploads fall back to a copy from pinned memory.

    The buffers are pinned up front, each for `capacity` values (1 MiB: a prefill of 8192 tokens needs
    ~33k, a decode step of 64 requests over 1024 blocks ~66k): pinning host memory (cudaHostAlloc) can wait
    for the device, a weight copy in flight included - on the H200, buffers grown while serving left
    prefills waiting 0.3-0.5 s for the 7B prefetch queued just before them. `grown` counts the buffers an
    upload had to grow after that (each such upload pinned memory on the request path).
    """

    def __init__(self, device: torch.device, slots: int = 32, capacity: int = 1 << 17) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._pinned: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * slots
        self._mapped: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * slots  # mapped views, made with each buffer
        self._done: list[Any] = [None] * slots
        self._next = 0
        self.mapped = self._check_mapped(capacity)
        if self.mapped:
            for i in range(1, slots):  # the check made the first
                self._grow(i, capacity)
        self.grown = 0

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """`values` (int64) as a new tensor on the device, ordered on the current stream."""
        if not self.mapped:
            return torch.from_numpy(values).pin_memory().to(self.device, non_blocking=True)
        n = len(values)
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        with self._lock:
            i, self._next = self._next, (self._next + 1) % len(self._pinned)
            wait_event(self._done[i])
            if self._pinned[i].numel() < n:
                self._grow(i, n)
                self.grown += 1
            self._pinned[i].numpy()[:n] = values
            device_copy(out, self._mapped[i][:n])  # a kernel: reads host memory, no copy engine
            self._done[i] = torch.cuda.Event()
            self._done[i].record()
        return out

    def _grow(self, i: int, n: int) -> None:
        size = 1 << max(12, (n - 1).bit_length())
        self._pinned[i] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self._mapped[i] = mapped_view(self._pinned[i], self.device)

    def _check_mapped(self, capacity: int) -> bool:
        """Whether a kernel reads this platform's pinned memory right (one round trip, at start, through the
        first buffer, made for `capacity` values)."""
        try:
            self._grow(0, max(1024, capacity))
            probe = np.arange(1024, dtype=np.int64) * 7 + 3
            self._pinned[0].numpy()[:1024] = probe
            out = torch.empty(1024, dtype=torch.int64, device=self.device)
            device_copy(out, self._mapped[0][:1024])
            return bool(np.array_equal(out.cpu().numpy(), probe))
        except (RuntimeError, TypeError, ValueError):
            return False


_STAGES: dict[torch.device, InputStage] = {}
_STAGES_LOCK = threading.Lock()


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A step's int64 inputs on `device`: as they are on CPU; on CUDA through the device's `InputStage`."""
    if device.type != "cuda":
        return torch.from_numpy(values)
    device = _indexed(device)
    with _STAGES_LOCK:
        if device not in _STAGES:
            _STAGES[device] = InputStage(device)
        stage = _STAGES[device]
    return stage.upload(values)


def input_stage_grown(device: torch.device) -> int:
    """Pinned input buffers grown while serving on `device` (see `InputStage`); 0 where none was made."""
    if device.type != "cuda":
        return 0
    with _STAGES_LOCK:
        stage = _STAGES.get(_indexed(device))
    return stage.grown if stage is not None else 0


def _indexed(device: torch.device) -> torch.device:
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def device_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src within one device by a kernel on CUDA (a device-to-device memcpy may queue on the copy engine
    behind a weight copy)."""
    if dst.is_cuda:
        torch.add(src, 0, out=dst)
    else:
        dst.copy_(src)
