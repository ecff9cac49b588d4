"""Each request's KV blocks on the device and in host memory, and the copies between them.

Swap-out runs on its own stream after the compute queued so far; the device
blocks it reads go back to the pool parked on its event, so nothing reuses
them before the copy has read them. Swap-in runs on another stream, after
that request's swap-out event and after queued compute (its new blocks may
still be read by it); it leaves an event on the request that the next
compute step waits on, so compute waits only for the requests it runs.

A request leaving the engine (`export_kv`) takes its KV out as one token-major
CPU tensor, `[layers, 2, kv_heads, tokens, head_dim]`, read from the host
blocks once its swap-out has landed, or off the device after the compute that
wrote it; an arriving one is written into fresh host blocks (`write_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pool.engines.device import Streams, to_device, wait_event
from pool.engines.forward import _ROWS, DecodeInputs, PrefillInputs
from pool.engines.kv import BlockRef, KvShape, SlabPool, device_pool, row_view
from scheduler import padded_prefill_tokens


@dataclass(slots=True, eq=False)
class SeqKv:
    """Where one request's KV is."""

    shape: KvShape
    blocks: list[BlockRef] = field(default_factory=list)  # on the device
    rows: list[int] = field(default_factory=list)  # each device block's first row in the KV row view
    host_blocks: list[BlockRef] = field(default_factory=list)
    on_device: bool = True
    ready: Any = None  # CUDA event of its last copy; compute or the next copy waits on it

    def slot_of(self, position: int) -> tuple[int, int]:
        """(first row of its block, offset in the block) of a token position."""
        return self.rows[position // self.shape.block_size], position % self.shape.block_size


class KvStore:
    def __init__(self, region: torch.Tensor, device_slab_bytes: int, host: SlabPool, streams: Streams) -> None:
        self.region = region
        self.device = device_pool(region, device_slab_bytes)
        self.host = host
        self.streams = streams
        self.bytes_h2d = self.bytes_d2h = 0
        self._views: dict[KvShape, torch.Tensor] = {}
        self._scratch: dict[KvShape, BlockRef] = {}

    def view(self, shape: KvShape) -> torch.Tensor:
        """The device KV of `shape` as `[rows, block_size, head_dim]`."""
        if shape not in self._views:
            self._views[shape] = row_view(self.region, shape)
        return self._views[shape]

    def scratch(self, shape: KvShape) -> int:
        """First row of a block no request owns: padded rows of a CUDA graph write there."""
        if shape not in self._scratch:
            self._scratch[shape] = self.device.allocate(shape, 1)[0]
        return self.device.first_row(shape, self._scratch[shape])

    def _place(self, kv: SeqKv, blocks: list[BlockRef]) -> None:
        kv.blocks.extend(blocks)
        kv.rows.extend(self.device.first_row(kv.shape, ref) for ref in blocks)

    def grow(self, kvs: Sequence[SeqKv], num_tokens: Sequence[int]) -> None:
        """Give each request device blocks for `num_tokens` tokens (all requests or none)."""
        grown: list[tuple[SeqKv, int]] = []
        try:
            for kv, tokens in zip(kvs, num_tokens):
                need = kv.shape.blocks_for(tokens) - len(kv.blocks)
                if need > 0:
                    self._place(kv, self.device.allocate(kv.shape, need))
                    grown.append((kv, need))
        except Exception:
            for kv, n in grown:
                self.trim(kv, len(kv.blocks) - n)
            raise

    def trim(self, kv: SeqKv, num_blocks: int) -> None:
        """Give back a request's device blocks past its first `num_blocks`."""
        if len(kv.blocks) > num_blocks:
            self.device.free(kv.shape, kv.blocks[num_blocks:], after=kv.ready)
            del kv.blocks[num_blocks:], kv.rows[num_blocks:]

    def save(self, kvs: Sequence[SeqKv]) -> None:
        """Device -> host for requests whose KV is on the device (all or none)."""
        kvs = [kv for kv in kvs if kv.on_device]
        targets = allocate_all(self.host, kvs, [len(kv.blocks) for kv in kvs])
        stream = self.streams.swap_out
        self.streams.after_compute(stream)
        for kv, host_blocks in zip(kvs, targets):
            with self.streams.on(stream):
                self.bytes_d2h += copy_blocks(self.device, kv.blocks, self.host, host_blocks, kv.shape)
            kv.ready = self.streams.record(stream)
            self.device.free(kv.shape, kv.blocks, after=kv.ready)
            kv.blocks, kv.rows, kv.host_blocks, kv.on_device = [], [], host_blocks, False

    def restore(self, kvs: Sequence[SeqKv]) -> None:
        """Host -> device for requests whose KV is in host memory (all or none)."""
        kvs = [kv for kv in kvs if not kv.on_device]
        targets = allocate_all(self.device, kvs, [len(kv.host_blocks) for kv in kvs])
        stream = self.streams.swap_in
        self.streams.after_compute(stream)
        for kv, device_blocks in zip(kvs, targets):
            if stream is not None and kv.ready is not None:
                stream.wait_event(kv.ready)  # its swap-out must have landed
            with self.streams.on(stream):
                self.bytes_h2d += copy_blocks(self.host, kv.host_blocks, self.device, device_blocks, kv.shape)
            kv.ready = self.streams.record(stream)
            self.host.free(kv.shape, kv.host_blocks, after=kv.ready)
            kv.host_blocks, kv.on_device = [], True
            self._place(kv, device_blocks)

    def before_compute(self, kvs: Sequence[SeqKv]) -> None:
        """Compute waits for the swap-ins of exactly these requests."""
        for kv in kvs:
            self.streams.compute_waits(kv.ready)
            kv.ready = None

    def free(self, kv: SeqKv) -> None:
        self.device.free(kv.shape, kv.blocks, after=kv.ready)
        free_host(self.host, kv)
        kv.blocks, kv.rows = [], []

    def read_device(self, kv: SeqKv, num_tokens: int) -> torch.Tensor:
        """A CPU copy of the first `num_tokens` tokens' KV of a request whose KV is on the device."""
        self.before_compute([kv])  # after its swap-in; compute that wrote it is queued on this stream already
        with torch.no_grad():
            tokens = read_tokens(self.device, kv.shape, kv.blocks, num_tokens)  # gathered on the device
            # into pinned memory from torch's caching host allocator: reused blocks, one DMA, no page faults
            # (a fresh pageable tensor faulted in every page at ~2.6 GB/s: the larger part of a hand-off's export)
            out = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=tokens.is_cuda)
            out.copy_(tokens)
        self.bytes_d2h += out.nbytes
        return out


    def stage(self, kv: SeqKv, num_tokens: int, out: torch.Tensor) -> None:
        """Gather the first `num_tokens` tokens' KV of a request on the device into `out` (a device tensor of
        `[L, 2, kv_heads, num_tokens, head_dim]`, in a staging arena), after the compute that wrote it."""
        self.before_compute([kv])
        with torch.no_grad():
            read_blocks(self.view(kv.shape), kv.shape, kv.rows, num_tokens, out=out)

    def admit_device(self, kvs: Sequence[SeqKv], sources: Sequence[torch.Tensor]) -> None:
        """Place requests arriving with their KV in device memory (`sources[i]`: `[L, 2, kv_heads, tokens,
        head_dim]`, staged by another engine) straight into device blocks (all or none); the copies are queued
        on the compute stream."""
        counts = [kv.shape.blocks_for(src.shape[3]) for kv, src in zip(kvs, sources)]
        targets = allocate_all(self.device, kvs, counts)  # OutOfKvMemory: nothing taken
        with torch.no_grad():
            for kv, src, blocks in zip(kvs, sources, targets):
                kv.on_device, kv.host_blocks = True, []
                self._place(kv, blocks)
                write_blocks(src, self.view(kv.shape), kv.shape, kv.rows)


def read_host(pool: SlabPool, kv: SeqKv, num_tokens: int) -> torch.Tensor:
    """A copy of the first `num_tokens` tokens' KV of a request whose KV is in host memory."""
    wait_event(kv.ready)  # its swap-out has landed
    kv.ready = None
    return read_tokens(pool, kv.shape, kv.host_blocks, num_tokens)


def free_host(pool: SlabPool, kv: SeqKv) -> None:
    pool.free(kv.shape, kv.host_blocks, after=kv.ready)
    kv.host_blocks = []


def read_tokens(pool: SlabPool, shape: KvShape, blocks: Sequence[BlockRef], num_tokens: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The first `num_tokens` tokens of `blocks` as one `[L, 2, kv_heads, num_tokens, head_dim]` tensor: a new
    one, or written into `out`."""
    if not 0 <= num_tokens <= len(blocks) * shape.block_size:
        raise ValueError(f"{num_tokens} tokens do not fit in {len(blocks)} blocks of {shape.block_size}")
    used = shape.blocks_for(num_tokens)
    if used == 0:
        empty = torch.empty(shape.num_layers, 2, shape.num_kv_heads, 0, shape.head_dim, dtype=shape.dtype)
        return empty if out is None else out
    last = num_tokens - (used - 1) * shape.block_size
    parts = [pool.block(shape, ref) for ref in blocks[: used - 1]]
    parts.append(pool.block(shape, blocks[used - 1])[:, :, :, :last])
    return torch.cat(parts, dim=3) if out is None else torch.cat(parts, dim=3, out=out)


def write_tokens(kv: torch.Tensor, pool: SlabPool, shape: KvShape, blocks: Sequence[BlockRef]) -> None:
    """Write a `[L, 2, kv_heads, tokens, head_dim]` tensor into `blocks`, block by block.

    The unused tail of the last block is zeroed: decode attention masks the
    scores past a request's length but still multiplies their (zero) weights
    with those values, and a fresh slab's bytes may read as NaN.
    """
    size = shape.block_size
    for i, ref in enumerate(blocks):
        chunk = kv[:, :, :, i * size : (i + 1) * size]
        block = pool.block(shape, ref)
        block[:, :, :, : chunk.shape[3]].copy_(chunk)
        block[:, :, :, chunk.shape[3] :].zero_()


def read_blocks(rows: torch.Tensor, shape: KvShape, first_rows: Sequence[int], num_tokens: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The first `num_tokens` tokens of the blocks starting at `first_rows` of `rows` (the device KV as `[rows,
    block_size, head_dim]`) as one `[L, 2, kv_heads, num_tokens, head_dim]` tensor: a new one, or written into
    `out`. `write_blocks` the other way: every whole block in one indexed gather, then the last block's tokens.
    A staged hand-off's gather on the GPU: ~8 launches where `read_tokens` makes a view per block (128 for a
    2k-token prompt; on this project's CPU 0.51 ms of host time against 0.06 ms, at a shape small enough that
    the bytes cost nothing). Not for CPU tensors of real size: there the indexed gather and the second copy
    move the bytes twice, slower than `read_tokens`' one cat (2.0 ms against 13 ms for 2k tokens of a 0.5B)."""
    size, dim, per_block = shape.block_size, shape.head_dim, shape.rows_per_block
    used = shape.blocks_for(num_tokens)
    if not 0 <= num_tokens <= len(first_rows) * size:
        raise ValueError(f"{num_tokens} tokens do not fit in {len(first_rows)} blocks of {size}")
    dims = (shape.num_layers, 2, shape.num_kv_heads)
    if out is None:
        out = torch.empty(*dims, num_tokens, dim, dtype=rows.dtype, device=rows.device)
    whole = num_tokens // size
    if whole:
        out[:, :, :, : whole * size].copy_(rows[_block_rows(first_rows[:whole], per_block, rows.device)]
                                           .view(*dims, whole * size, dim))
    if whole < used:
        rest = num_tokens - whole * size
        last = rows[first_rows[whole] : first_rows[whole] + per_block, :rest]  # a block's rows follow each other
        out[:, :, :, whole * size :].copy_(last.reshape(*dims, rest, dim))
    return out


def write_blocks(kv: torch.Tensor, rows: torch.Tensor, shape: KvShape, first_rows: Sequence[int]) -> None:
    """Write a `[L, 2, kv_heads, tokens, head_dim]` tensor into the blocks starting at `first_rows` (as many as
    its tokens fill) of `rows`, the device KV as `[rows, block_size, head_dim]` (`row_view`): every whole block
    in one indexed copy, read in place as row-major (one kernel however the blocks lie: decode's growth scatters
    them, and a copy per run of adjacent blocks took a hand-off's import to 0.87 s on the H200), then the last,
    partial block's tokens and zeros (see `write_tokens`)."""
    size, tokens, dim = shape.block_size, kv.shape[3], shape.head_dim
    if len(first_rows) != shape.blocks_for(tokens):
        raise ValueError(f"{tokens} tokens fill {shape.blocks_for(tokens)} blocks of {size}, not {len(first_rows)}")
    per_block, whole = shape.rows_per_block, tokens // size
    if whole:
        index = _block_rows(first_rows[:whole], per_block, rows.device)
        rows.index_put_((index,), kv[:, :, :, : whole * size].reshape(per_block, whole, size, dim))
    if whole < len(first_rows):
        rest = tokens - whole * size
        last = rows[first_rows[whole] : first_rows[whole] + per_block]  # a block's rows follow each other
        last[:, :rest].copy_(kv[:, :, :, whole * size :].reshape(per_block, rest, dim))
        last[:, rest:].zero_()


def _block_rows(first_rows: Sequence[int], per_block: int, device: torch.device) -> torch.Tensor:
    """Every row of the blocks starting at `first_rows`, `[rows a block, blocks]`: a block's rows follow each
    other (read_blocks and write_blocks index the row view with it)."""
    firsts = to_device(np.asarray(first_rows, dtype=np.int64), device)
    return firsts[None, :] + torch.arange(per_block, device=device)[:, None]


def allocate_all(pool: SlabPool, kvs: Sequence[SeqKv], counts: Sequence[int]) -> list[list[BlockRef]]:
    """`counts[i]` blocks of `kvs[i]`'s shape for every request, or none (OutOfKvMemory)."""
    out: list[list[BlockRef]] = []
    try:
        for kv, n in zip(kvs, counts):
            out.append(pool.allocate(kv.shape, n))
    except Exception:
        for kv, blocks in zip(kvs, out):
            pool.free(kv.shape, blocks)
        raise
    return out


def copy_blocks(src: SlabPool, src_blocks: list[BlockRef], dst: SlabPool, dst_blocks: list[BlockRef],
                shape: KvShape) -> int:
    """Copy blocks pairwise, one copy per run of blocks adjacent on both sides; returns bytes."""
    total = 0
    for i, run in adjacent_runs(src_blocks, dst_blocks):
        dst.span(shape, dst_blocks[i], run).copy_(src.span(shape, src_blocks[i], run), non_blocking=True)
        total += run * shape.block_bytes
    return total


def adjacent_runs(*block_lists: Sequence[BlockRef]) -> Iterator[tuple[int, int]]:
    """(start, length) of each run of positions whose blocks follow each other in one slab in every list."""
    count, i = len(block_lists[0]), 0
    while i < count:
        run = 1
        while i + run < count and all(_adjacent(b[i + run - 1], b[i + run]) for b in block_lists):
            run += 1
        yield i, run
        i += run


def _adjacent(a: BlockRef, b: BlockRef) -> bool:
    return a.slab == b.slab and b.index == a.index + 1


# ---- step inputs: token positions -> KV addresses ----------------------------------------------
def prefill_token_buckets(limit: int) -> list[int]:
    """Every padded token count (`padded_prefill_tokens`) of a prefill of 1 to `limit` tokens, ascending."""
    out, n = [], 1
    while n <= limit:
        out.append(padded_prefill_tokens(n))
        n = out[-1] + 1
    return out


def prefill_inputs(token_lists: Sequence[list[int]], kvs: Sequence[SeqKv], device: torch.device,
                   pad_row: int | None = None) -> PrefillInputs:
    """All tokens of all requests, each written to its own slot: five rows of one array, one upload to the device
    (`device.to_device`; four copies from pageable memory each waited for the compute stream, and queued on the
    copy engine behind a weight prefetch: a prefill right after one took twice as long on the H200).

    With `pad_row` (a scratch block's first row) the tokens are padded to `padded_prefill_tokens`: the padding
    is token 0 at position 0, its K/V written to that block, and no request's attention reads it."""
    lens = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    real, size = int(lens.sum()), kvs[0].shape.block_size
    n = real if pad_row is None else padded_prefill_tokens(real)
    packed = np.zeros(4 * n + len(lens), dtype=np.int64)
    ids, positions, write_row, write_offset = (packed[i * n : (i + 1) * n] for i in range(4))
    ids[:real] = [t for tokens in token_lists for t in tokens]
    starts = np.cumsum(lens) - lens
    positions[:real] = np.arange(real) - np.repeat(starts, lens)
    rows = np.concatenate([np.asarray(kv.rows, dtype=np.int64) for kv in kvs])
    blocks = np.fromiter((len(kv.rows) for kv in kvs), dtype=np.int64, count=len(kvs))
    first_block = np.repeat(np.cumsum(blocks) - blocks, lens)
    write_row[:real] = rows[first_block + positions[:real] // size]
    write_row[real:] = 0 if pad_row is None else pad_row
    write_offset[:real] = positions[:real] % size
    packed[4 * n :] = starts + lens - 1
    on_device = to_device(packed, device)
    return PrefillInputs(token_ids=on_device[:n], positions=on_device[n : 2 * n], write_row=on_device[2 * n : 3 * n],
                         write_offset=on_device[3 * n : 4 * n], seq_lens=lens.tolist(), ends=on_device[4 * n :])


def decode_inputs(last_tokens: Sequence[int], kvs: Sequence[SeqKv], positions: Sequence[int], device: torch.device,
                  batch: int, max_blocks: int, pad_row: int | None = None) -> DecodeInputs:
    """One token per request at `positions`, padded to `batch` rows (aimed at `pad_row`) and `max_blocks` columns.

    Built in one numpy array (this runs on every step, on the host), read onto the device by a kernel
    (`device.to_device`): no copy to wait for the queued steps or for a weight prefetch on the copy engine.
    """
    n, size = len(kvs), kvs[0].shape.block_size
    pad = kvs[0].rows[0] if pad_row is None else pad_row
    packed = np.zeros(len(_ROWS) * batch + batch * max_blocks, dtype=np.int64)
    rows = packed[: len(_ROWS) * batch].reshape(len(_ROWS), batch)  # token_ids, positions, write_row, offset, lengths
    table = packed[len(_ROWS) * batch :].reshape(batch, max_blocks)
    pos = np.asarray(positions, dtype=np.int64)
    rows[0, :n] = last_tokens
    rows[1, :n] = pos
    rows[2, :n] = [kv.rows[p // size] for kv, p in zip(kvs, positions)]
    rows[2, n:] = pad
    rows[3, :n] = pos % size
    rows[4] = rows[1] + 1
    table[n:] = pad
    for i, kv in enumerate(kvs):
        table[i, : len(kv.rows)] = kv.rows
        table[i, len(kv.rows) :] = kv.rows[0]
    return DecodeInputs(to_device(packed, device), batch, max_blocks)
