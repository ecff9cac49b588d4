"""Paged KV memory: fixed-size token blocks kept in slabs, one block shape per slab.

The same `SlabPool` runs both tiers. On the device its slabs tile the KV
region of the engine's buffer (a fixed number); in host memory they are
separate (pinned) tensors made on first need and kept for reuse (Aegaeon's
host KV cache: 1 GiB slabs, one block shape per slab), their size fixed at
the host pool's first need (`HostSlabPool`). A slab takes the shape
of the first block allocated in it and becomes free again when its last block
is freed, so models of different shapes share one region without fragmenting
it below slab granularity.

A block holds `[num_layers, 2 (k, v), num_kv_heads, block_size, head_dim]`: one
"row" of `block_size x head_dim` per (layer, k/v, head), and every block starts
on a row boundary of the region (slabs pad their start to it). So the device
KV of a shape is one `[rows, block_size, head_dim]` tensor, a request's keys of
one layer are a single `index_select` of rows, already in the
`[heads, tokens, head_dim]` order attention multiplies with.
Freed blocks that an in-flight copy still reads or writes are parked with
that copy's event and come back once it has completed.

What the pool can promise (`usable_blocks`): with one block shape, every
block of every slab. Blocks of several shapes share the slabs, and a slab
part-filled by one shape is lost to the others. Packed (each shape's slabs
full but its last), counting each request of shape i as `blocks / usable_i`,
any set of requests whose shares sum to at most 1 fits: with n_i blocks per
slab, S slabs and M shapes, usable_i = floor(n_i * (S - (M - 1) - sum_j
h_j / n_j)) where h_j are blocks held outside requests (a graph's scratch
block), because the slabs needed, sum_i ceil((k_i + h_i) / n_i), are then
fewer than S + 1. Frees can leave a shape more part-filled slabs than that
(new blocks fill them first, but another shape cannot use them), so with
several shapes an allocation can still find no slab: OutOfKvMemory, which
the pool treats as a refusal, not a failure.

Each slab also loses its tail past the last whole block of its shape, and
the region its tail past the last whole slab. `slab_bytes_for` sizes the
slabs of both tiers to the loaded models' blocks, by one rule: the slab that
lets the region promise the most to the shape it promises least. With blocks
of 1-2.4 MB (3-4B models) a slab of a few MiB held one or two: the mixed
fleet's 18.16 GB device region promised every shape 78% of itself (2.36 MB
slabs) and its 16 GB of host KV 56% (4 MiB slabs); sized by the rule, 99.3%
(33 MB slabs, a whole number of every block) and 98.1% (16 MiB slabs). A
slab of k blocks of the largest shape loses less than 1/k of itself to any
shape's tail.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pool.engines.base import OutOfKvMemory
from pool.engines.device import event_done, wait_event


@dataclass(frozen=True, slots=True)
class KvShape:
    """One model's block shape (models with equal shapes share slabs)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def row_bytes(self) -> int:
        """One head's keys (or values) of one layer for one block."""
        return self.block_size * self.head_dim * self.dtype.itemsize

    @property
    def rows_per_block(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads

    @property
    def block_bytes(self) -> int:
        return self.rows_per_block * self.row_bytes

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class BlockRef:
    slab: int
    index: int


@dataclass(slots=True)
class _Slab:
    storage: torch.Tensor
    shape: KvShape | None = None
    pad: int = 0  # bytes skipped so blocks start on a row boundary of the region
    free: list[int] = field(default_factory=list)
    num_used: int = 0


class SlabPool:
    """Blocks of several shapes carved out of equal-size slabs."""

    def __init__(self, slab_bytes: int, max_slabs: int, make_slab: Callable[[int], torch.Tensor],
                 slab_offset: Callable[[int], int] = lambda i: 0, zero_on_assign: bool = False) -> None:
        if slab_bytes <= 0 or max_slabs < 0:
            raise ValueError(f"slab_bytes = {slab_bytes}, max_slabs = {max_slabs}: need slab_bytes > 0, max_slabs >= 0")
        self.slab_bytes = slab_bytes
        self.max_slabs = max_slabs
        self._make_slab = make_slab
        self._slab_offset = slab_offset  # where slab i starts in its region (rows are aligned to the region)
        # Zero a slab when it takes a block shape: bytes of another shape (or dtype), or never written, can
        # read as NaN in the unused tail of a block, and decode attention multiplies masked values by 0.
        self._zero_on_assign = zero_on_assign
        self._slabs: list[_Slab] = []
        self._parked: list[tuple[Any, KvShape, list[BlockRef]]] = []
        # Indexes that keep allocation off a scan of every slab (a GPU's KV is ~30k slabs of 1 MiB, and a
        # decode step allocates for every request that crosses a block boundary): per shape, the slabs with
        # a free block and how many free blocks they hold; the made slabs without a shape, lowest first.
        self._partial: dict[KvShape, set[int]] = {}
        self._free_of: dict[KvShape, int] = {}
        self._used_of: dict[KvShape, int] = {}
        self._empty: list[int] = []  # a heap

    # ---- allocation ----
    def reserve(self, num_slabs: int) -> None:
        """Make up to `num_slabs` slabs now (host memory is slow to allocate and pin mid-swap)."""
        while len(self._slabs) < min(num_slabs, self.max_slabs):
            self._new_slab()

    def _new_slab(self) -> None:
        self._slabs.append(_Slab(self._make_slab(len(self._slabs))))
        heapq.heappush(self._empty, len(self._slabs) - 1)

    def allocate(self, shape: KvShape, num_blocks: int) -> list[BlockRef]:
        """`num_blocks` blocks of `shape`, all or none (raises OutOfKvMemory)."""
        if num_blocks <= 0:
            return []
        self._reclaim(block=False)
        if not self._has_room(shape, num_blocks):
            self._reclaim(block=True)
        if not self._has_room(shape, num_blocks):
            raise OutOfKvMemory(
                f"need {num_blocks} KV blocks of {shape.block_bytes} bytes; {self._capacity_for(shape)} free "
                f"({self.num_slabs} of {self.max_slabs} slabs of {self.slab_bytes} bytes in use or made)"
            )
        out: list[BlockRef] = []
        while len(out) < num_blocks:
            slab_id = self._slab_with_room(shape)
            slab = self._slabs[slab_id]
            take = min(num_blocks - len(out), len(slab.free))
            out.extend(BlockRef(slab_id, slab.free.pop()) for _ in range(take))
            slab.num_used += take
            self._free_of[shape] -= take
            self._used_of[shape] = self._used_of.get(shape, 0) + take
            if not slab.free:
                self._partial[shape].discard(slab_id)
        return out

    def free(self, shape: KvShape, blocks: Sequence[BlockRef], after: Any = None) -> None:
        """Return blocks; with `after` (a CUDA event) only once that copy has completed."""
        if after is not None and not event_done(after):
            self._parked.append((after, shape, list(blocks)))
            return
        for ref in blocks:
            slab = self._slabs[ref.slab]
            if slab.shape != shape:
                raise ValueError(f"block {ref} belongs to a slab of another shape")
            slab.free.append(ref.index)
            slab.num_used -= 1
            self._used_of[shape] -= 1
            if slab.num_used == 0:  # empty: any shape may take it
                self._free_of[shape] -= len(slab.free) - 1
                self._partial[shape].discard(ref.slab)
                slab.shape, slab.free, slab.pad = None, [], 0
                heapq.heappush(self._empty, ref.slab)
            else:
                self._free_of[shape] += 1
                self._partial[shape].add(ref.slab)

    def _reclaim(self, block: bool) -> None:
        parked, self._parked = self._parked, []
        for event, shape, blocks in parked:
            if block:
                wait_event(event)
            self.free(shape, blocks, after=event)

    def _pad(self, slab_id: int, shape: KvShape) -> int:
        return -self._slab_offset(slab_id) % shape.row_bytes

    def _blocks_in(self, slab_id: int, shape: KvShape) -> int:
        return max(0, self.slab_bytes - self._pad(slab_id, shape)) // shape.block_bytes

    def _room(self, shape: KvShape) -> Iterator[int]:
        """Free blocks for `shape`, slab by slab: partly used ones, empty ones, then slabs not made yet."""
        yield self._free_of.get(shape, 0)
        yield from (self._blocks_in(i, shape) for i in self._empty)
        yield from (self._blocks_in(i, shape) for i in range(len(self._slabs), self.max_slabs))

    def _has_room(self, shape: KvShape, num_blocks: int) -> bool:
        total = 0
        for free in self._room(shape):  # stops early: allocation is on every decode step's path
            total += free
            if total >= num_blocks:
                return True
        return False

    def usable_blocks(self, shape: KvShape, shapes: Sequence[KvShape], held: int = 0) -> int:
        """Blocks of `shape` requests can count on when blocks of all `shapes` (`shape` among them) share the
        pool, each shape also holding `held` blocks outside requests (see the module docstring)."""
        kinds = set(shapes) | {shape}
        if len(kinds) == 1:  # no other shape can strand a slab: every block there is
            return max(0, sum(self._blocks_in(i, shape) for i in range(self.max_slabs)) - held)
        per_slab = {s: min((self._blocks_in(i, s) for i in range(self.max_slabs)), default=0) for s in kinds}
        if any(n == 0 for n in per_slab.values()):
            return 0
        slabs = self.max_slabs - (len(kinds) - 1) - sum(held / n for n in per_slab.values())
        return max(0, int(per_slab[shape] * slabs + 1e-9))

    def _capacity_for(self, shape: KvShape) -> int:
        return sum(self._room(shape))

    def _slab_with_room(self, shape: KvShape) -> int:
        # Fill slabs of this shape first (the lowest), then reuse an empty slab (the lowest), then make one.
        partial = self._partial.get(shape)
        if partial:
            return min(partial)
        skipped, found = [], None
        while self._empty:  # an empty slab too small for this shape's padded block stays empty for the others
            i = heapq.heappop(self._empty)
            if self._blocks_in(i, shape):
                found = i
                break
            skipped.append(i)
        for i in skipped:
            heapq.heappush(self._empty, i)
        if found is not None:
            slab, count = self._slabs[found], self._blocks_in(found, shape)
            slab.shape, slab.pad, slab.free = shape, self._pad(found, shape), list(range(count - 1, -1, -1))
            self._partial.setdefault(shape, set()).add(found)
            self._free_of[shape] = self._free_of.get(shape, 0) + count
            if self._zero_on_assign:
                slab.storage.zero_()  # on the current stream: before any compute or swap-in that uses it
            return found
        if len(self._slabs) >= self.max_slabs:
            raise OutOfKvMemory(f"no slab can hold a block of {shape.block_bytes} bytes")
        self._new_slab()
        return self._slab_with_room(shape)

    # ---- access ----
    def block(self, shape: KvShape, ref: BlockRef) -> torch.Tensor:
        """The block's tensor `[L, 2, kv_heads, block_size, head_dim]` (a view)."""
        return self.span(shape, ref, 1).view(shape.dtype).view(shape.dims)

    def span(self, shape: KvShape, first: BlockRef, count: int) -> torch.Tensor:
        """The bytes of `count` blocks that follow each other in one slab, from `first`."""
        slab = self._slabs[first.slab]
        start = slab.pad + first.index * shape.block_bytes
        return slab.storage[start : start + count * shape.block_bytes]

    def first_row(self, shape: KvShape, ref: BlockRef) -> int:
        """The block's first row in the region's `[rows, block_size, head_dim]` view."""
        offset = self._slab_offset(ref.slab) + self._slabs[ref.slab].pad + ref.index * shape.block_bytes
        return offset // shape.row_bytes

    # ---- accounting ----
    @property
    def num_slabs(self) -> int:
        """Slabs made so far (kept for reuse even when empty)."""
        return len(self._slabs)

    def used_bytes(self) -> int:
        """Bytes of blocks in use: held, or freed behind a copy still in flight (those whose copy has landed
        are given back first, so the figure does not hang on when the pool next allocates)."""
        self._reclaim(block=False)
        return sum(n * shape.block_bytes for shape, n in self._used_of.items())

    def used_blocks(self, shape: KvShape | None = None) -> int:
        return sum(self._used_of.values()) if shape is None else self._used_of.get(shape, 0)

    def made_bytes(self) -> int:
        return len(self._slabs) * self.slab_bytes


SLAB_CANDIDATES = 64  # slab sizes slab_bytes_for weighs (from the smallest up)


def slab_share(slab_bytes: int, block_bytes: Sequence[int], region_bytes: int) -> float:
    """The least share of a region of `region_bytes` a pool of `slab_bytes` slabs can promise any of the block
    sizes (`SlabPool.usable_blocks` with no block held): the region's whole slabs less one per other size (kept
    for part-filled ones), each holding a whole number of blocks."""
    sizes = sorted({int(b) for b in block_bytes if b > 0})
    slabs = region_bytes // slab_bytes - (len(sizes) - 1)
    if not sizes or slabs <= 0:
        return 0.0
    return min(slab_bytes // b * b for b in sizes) * slabs / region_bytes


def slab_bytes_for(block_bytes: Sequence[int], at_least: int, region_bytes: int, doubling: bool = False) -> int:
    """The slab size, of at least `at_least` bytes, that lets a region of `region_bytes` promise the most to the
    block size it promises least (`slab_share`), the smallest where several tie; weighed among the first
    `SLAB_CANDIDATES` whole numbers of the largest block from `at_least` up (device slabs), or with `doubling`
    among `at_least` times a power of two (host slabs: torch's pinned allocator rounds each allocation up to a
    power of two, so a slab of another size would hold more memory than it serves).

    A slab that holds a whole number of every block size loses no tail and wins unless it is so large that the
    slabs kept for part-filled ones cost more. Else a block size of b loses less than b of each slab of s bytes:
    with k blocks of the largest size per slab, less than 1/k. The mixed fleet's blocks (2.36, 1.84, 0.59 and
    0.52 MB) have a common multiple of 14 of the largest (33 MB): on an 18.16 GB device region every shape is
    promised 99.3% of it (slabs of one 2.36 MB block, the old rule's, promised 78%); in 16 GB of host memory
    16 MiB slabs lose at most 1.6% of each to a tail and promise 98.1% (4 MiB ones lost 44%, promised 56%).
    Every scenario fleet's shapes are promised at least 98% of either tier (tests/pool/test_kv_capacity.py)."""
    sizes = sorted({int(b) for b in block_bytes if b > 0})
    if not sizes:
        return at_least
    if doubling:
        candidates = [at_least << k for k in range(SLAB_CANDIDATES)]
    else:
        first = -(-at_least // sizes[-1])
        candidates = [k * sizes[-1] for k in range(first, first + SLAB_CANDIDATES)]
    fits = [s for s in candidates if s <= region_bytes] or candidates[:1]
    return max(fits, key=lambda s: (slab_share(s, sizes, region_bytes), -s))


def device_pool(region: torch.Tensor, slab_bytes: int) -> SlabPool:
    """A pool whose slabs tile `region` (a byte tensor on the device)."""
    return SlabPool(slab_bytes, region.numel() // slab_bytes, lambda i: region[i * slab_bytes : (i + 1) * slab_bytes],
                    slab_offset=lambda i: i * slab_bytes, zero_on_assign=True)


class HostSlabPool(SlabPool):
    """Host slabs made on demand up to `max_bytes`, sized to the blocks they will hold at the pool's first need
    (`size`): `slab_bytes_for` the block sizes `block_bytes()` names then (the loaded models'), from `at_least`
    by doubling; the slabs of `reserve_bytes` are made then too (pinning memory mid-swap is slow)."""

    def __init__(self, at_least: int, max_bytes: int, pin: bool, block_bytes: Callable[[], Sequence[int]] = tuple,
                 reserve_bytes: int = 0) -> None:
        super().__init__(at_least, max_bytes // at_least,
                         lambda _: torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=pin))
        self._at_least, self._max_bytes, self._reserve_bytes = at_least, max_bytes, reserve_bytes
        self._block_bytes: Callable[[], Sequence[int]] | None = block_bytes

    def size(self) -> None:
        """Fix the slab size (the first call; later ones do nothing) and make the reserved slabs."""
        if self._block_bytes is None:
            return
        self.slab_bytes = slab_bytes_for(self._block_bytes(), self._at_least, self._max_bytes, doubling=True)
        self.max_slabs = self._max_bytes // self.slab_bytes
        self._block_bytes = None
        self.reserve(-(-self._reserve_bytes // self.slab_bytes))

    def reserve(self, num_slabs: int) -> None:
        self.size()
        super().reserve(num_slabs)

    def allocate(self, shape: KvShape, num_blocks: int) -> list[BlockRef]:
        self.size()
        return super().allocate(shape, num_blocks)

    def usable_blocks(self, shape: KvShape, shapes: Sequence[KvShape], held: int = 0) -> int:
        self.size()
        return super().usable_blocks(shape, shapes, held)


def host_pool(slab_bytes: int, max_bytes: int, pin: bool, block_bytes: Callable[[], Sequence[int]] = tuple,
              reserve_bytes: int = 0) -> HostSlabPool:
    """A pool of host slabs made on demand up to `max_bytes`, sized at its first need to the block sizes
    `block_bytes()` names then, from `slab_bytes` up (none: `slab_bytes`); see `HostSlabPool`."""
    return HostSlabPool(slab_bytes, max_bytes, pin, block_bytes, reserve_bytes)


def row_view(region: torch.Tensor, shape: KvShape) -> torch.Tensor:
    """The region as `[rows, block_size, head_dim]` of `shape`'s dtype (`first_row` indexes it).

    Rows in slabs of other shapes are garbage for this view; block tables never point there.
    """
    usable = region.numel() // shape.row_bytes * shape.row_bytes
    return region[:usable].view(shape.dtype).view(-1, shape.block_size, shape.head_dim)
