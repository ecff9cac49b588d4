"""The slab pool's indexes choose exactly the blocks the plain rule names, at any number of slabs.

The rule (pool/engines/kv.py): a block of a shape comes from the lowest slab of
that shape with a free block, else the lowest empty slab that can hold one,
else a slab made next. The pool keeps indexes so a decode step does not scan
every slab; a reference written as that scan checks them.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pool.engines.base import OutOfKvMemory
from pool.engines.kv import KvShape, SlabPool, device_pool, host_pool

SHAPES = (KvShape(2, 2, 8, 4, torch.float32), KvShape(3, 1, 16, 4, torch.float16))


class ScanPool:
    """The rule as a scan over every slab (what SlabPool did before its indexes)."""

    def __init__(self, pool: SlabPool) -> None:
        self.pool = pool  # for _blocks_in / _pad only: where a slab's blocks start
        self.shape: list[KvShape | None] = []
        self.free: list[list[int]] = []
        self.used: list[int] = []

    def room(self, shape: KvShape) -> int:
        made = sum(len(f) for s, f in zip(self.shape, self.free) if s == shape)
        made += sum(self.pool._blocks_in(i, shape) for i, s in enumerate(self.shape) if s is None)
        return made + sum(self.pool._blocks_in(i, shape) for i in range(len(self.shape), self.pool.max_slabs))

    def allocate(self, shape: KvShape, n: int) -> list[tuple[int, int]] | None:
        if self.room(shape) < n:
            return None
        out = []
        while len(out) < n:
            i = next((i for i, s in enumerate(self.shape) if s == shape and self.free[i]), None)
            if i is None:
                i = next((i for i, s in enumerate(self.shape) if s is None and self.pool._blocks_in(i, shape)), None)
            if i is None:
                self.shape.append(None), self.free.append([]), self.used.append(0)
                continue
            if self.shape[i] is None:
                self.shape[i], self.free[i] = shape, list(range(self.pool._blocks_in(i, shape) - 1, -1, -1))
            take = min(n - len(out), len(self.free[i]))
            out += [(i, self.free[i].pop()) for _ in range(take)]
            self.used[i] += take
        return out

    def free_blocks(self, refs: list[tuple[int, int]]) -> None:
        for i, index in refs:
            self.free[i].append(index)
            self.used[i] -= 1
            if self.used[i] == 0:
                self.shape[i], self.free[i] = None, []


def _check(pool: SlabPool, ops) -> None:
    scan = ScanPool(pool)
    live: list[tuple[KvShape, list]] = []
    for do_alloc, which, n in ops:
        if do_alloc or not live:
            shape = SHAPES[which]
            expected = scan.allocate(shape, n)
            try:
                got = pool.allocate(shape, n)
            except OutOfKvMemory:
                assert expected is None, f"the pool refused {n} blocks the rule places at {expected}"
                continue
            assert expected is not None, "the pool placed blocks the rule has no room for"
            assert [(b.slab, b.index) for b in got] == expected
            live.append((shape, got))
        else:
            shape, blocks = live.pop(n % len(live))
            pool.free(shape, blocks)
            scan.free_blocks([(b.slab, b.index) for b in blocks])
        for shape in SHAPES:
            assert pool._capacity_for(shape) == scan.room(shape)
            assert pool.used_blocks(shape) == sum(len(blocks) for s, blocks in live if s == shape)
        assert pool.num_slabs == len(scan.shape)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 1), st.integers(1, 7)), max_size=60))
def test_device_pool_picks_the_blocks_the_rule_names(ops):
    slab_bytes = 3 * SHAPES[0].block_bytes + 100  # not a multiple of any row: slabs pad their start
    _check(device_pool(torch.zeros(6 * slab_bytes, dtype=torch.uint8), slab_bytes), ops)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 1), st.integers(1, 7)), max_size=60))
def test_host_pool_makes_slabs_only_when_made_ones_are_full(ops):
    _check(host_pool(2 * SHAPES[1].block_bytes, 5 * 2 * SHAPES[1].block_bytes, pin=False), ops)


class _CountingList(list):
    """A list that counts the items iterated over."""

    seen = 0

    def __iter__(self):
        for item in super().__iter__():
            _CountingList.seen += 1
            yield item


def test_allocation_does_not_scan_every_slab():
    """30k slabs (a GPU's KV in 1 MiB slabs), all full but the last: a block comes without a walk over them."""
    shape = SHAPES[0]
    pool = SlabPool(2 * shape.block_bytes, 30_000, lambda i: torch.empty(0, dtype=torch.uint8))  # never touched
    held = pool.allocate(shape, 60_000)
    pool.free(shape, held[-1:])  # one free block, in the last slab
    pool._slabs = _CountingList(pool._slabs)
    _CountingList.seen = 0
    for _ in range(100):
        pool.free(shape, pool.allocate(shape, 1))
    assert _CountingList.seen == 0, f"{_CountingList.seen} slabs walked over for 100 one-block allocations"
    assert pool.used_blocks(shape) == 60_000 - 1
