"""CUDA graphs for decode steps, captured ahead of serving (the capture itself is CUDA only).

A graph bakes in every address it touches, so one graph serves every model
of one shape (architecture and dtype) in one device slot: such models put
each weight at the same offset of the slot, read the same KV view and the
same per-shape tensors (`forward.SharedTensors`). The engine captures, when
it warms up, one graph per (shape, slot, batch bucket, block-table width)
from a fixed set (`GraphBuckets`, vLLM's way: padded batch sizes, a few
table widths), so nothing is captured on the request path; a step outside
the set runs eagerly and is counted as a miss.

Captures in one process are serialised with every other engine's calls
through `device.GATE`: `torch.cuda.graph` synchronises the device and
captures on a process-wide stream, so an engine on another thread that
launches work meanwhile breaks the capture (seen on the H200 with two
engines on one GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from pool.engines.device import device_copy
from pool.engines.forward import Decoder, DecodeInputs


# padded batch sizes decode graphs are captured for, up to the scheduler's default max_batch_size (vLLM captures
# up to 512): a step of more requests than the largest runs eagerly, its host launching every kernel of every
# layer (on the H200 at 22 req/s the decode instance's batches of 65-128 did, when graphs stopped at 64: that
# eager path took 2.6 of every 5 s of its process's host time)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)


def batch_sizes_up_to(max_batch: int) -> tuple[int, ...]:
    """`BATCH_SIZES` below `max_batch`, then `max_batch`: the graphs that cover every batch a scheduler of that
    max_batch_size can form (a pool's engines are given these)."""
    if max_batch < 1:
        raise ValueError(f"max_batch = {max_batch!r} must be >= 1")
    return tuple(s for s in BATCH_SIZES if s < max_batch) + (max_batch,)


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= n, or None when n is larger than all of them."""
    return next((s for s in sorted(sizes) if s >= n), None)


@dataclass(frozen=True, slots=True)
class GraphBuckets:
    """The padded batch sizes and block-table widths decode graphs are captured for."""

    batch_sizes: tuple[int, ...] = BATCH_SIZES
    block_widths: tuple[int, ...] = (16, 64, 256)

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "block_widths"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
                raise ValueError(f"GraphBuckets.{name} = {values!r}: give distinct sizes >= 1 in increasing order")

    def pick(self, batch: int, num_blocks: int) -> tuple[int, int] | None:
        """(padded batch, table width) a step of `batch` requests of up to `num_blocks` blocks replays, or None."""
        padded, width = bucket(batch, self.batch_sizes), bucket(num_blocks, self.block_widths)
        return None if padded is None or width is None else (padded, width)

    def shapes(self, max_blocks: int) -> list[tuple[int, int]]:
        """Every (batch, width) to capture for requests of at most `max_blocks` blocks (widths past the
        first that covers it are never picked)."""
        widths = [w for w in self.block_widths if w < max_blocks] + [bucket(max_blocks, self.block_widths)
                                                                      or self.block_widths[-1]]
        return [(b, w) for w in dict.fromkeys(widths) for b in self.batch_sizes]


NO_GRAPHS = {"graphs": 0, "graph_captures": 0, "graph_capture_s": 0.0, "graph_replays": 0, "graph_misses": 0}


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: DecodeInputs
    logits: torch.Tensor


class DecodeGraphs:
    """Captured decode graphs by key; `replay` returns None for a key never captured (run eagerly then)."""

    def __init__(self, warmup_steps: int = 2, max_batch: int = 64) -> None:
        self.warmup_steps = warmup_steps
        self.max_batch = max_batch  # the largest batch captured: each vocab's logits buffer has that many rows
        self.pool = torch.cuda.graph_pool_handle()
        # the warm-up steps before each capture run on one side stream: a fresh stream per capture (torch hands
        # out 32 in turn) would have cuBLAS make each its own workspace, kept for the process (~1 GB on the H200)
        self._side: torch.cuda.Stream | None = None
        self._graphs: dict[Hashable, _Captured] = {}
        # every graph writes its logits into one buffer per vocab size (rows: the batch): graphs replay one at
        # a time and each step's logits are sampled before the next replay, so one buffer serves them all
        self._logits: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.num_captures = 0
        self.capture_s = 0.0
        self.num_replays = 0
        self.num_misses = 0  # steps that found no graph and ran eagerly

    def capture_all(self, items: Iterable[tuple[Hashable, Callable[[], tuple[Decoder, DecodeInputs]]]]) -> int:
        """Capture every `(key, make)` not captured yet; `make()` gives the decoder and padded dummy inputs.
        Runs with every other engine of the process held off (`GATE.exclusive`); returns graphs captured."""
        from pool.engines.device import GATE

        count = 0
        with GATE.exclusive():
            for key, make in items:
                if key in self._graphs:
                    continue
                started = time.perf_counter()
                self._graphs[key] = self._capture(*make())
                self.capture_s += time.perf_counter() - started
                self.num_captures += 1
                count += 1
        return count

    def miss(self) -> None:
        """A step no captured shape covers (more requests, or a wider block table, than the buckets hold)."""
        self.num_misses += 1

    def replay(self, key: Hashable, inputs: DecodeInputs) -> torch.Tensor | None:
        """Logits for `inputs` (padded to the key's bucket) from the graph of `key`; None when there is none."""
        captured = self._graphs.get(key)
        if captured is None:
            self.miss()
            return None
        device_copy(captured.static.packed, inputs.packed)
        captured.graph.replay()
        self.num_replays += 1
        return captured.logits

    def _capture(self, decoder: Decoder, inputs: DecodeInputs) -> _Captured:
        # Warm-up steps write K/V for the dummy inputs into the scratch block, which no request owns.
        static = DecodeInputs(inputs.packed.clone(), inputs.batch, inputs.max_blocks)
        side = self._side = self._side or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_steps):
                decoder.decode(static)
        torch.cuda.current_stream().wait_stream(side)
        vocab = decoder.spec.vocab_size
        out = self._logits.get((vocab, static.packed.device))
        if out is None or out.shape[0] < inputs.batch:
            out = torch.empty(max(self.max_batch, inputs.batch), vocab, dtype=torch.float32, device=static.packed.device)
            self._logits[(vocab, static.packed.device)] = out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out[: inputs.batch].copy_(decoder.decode(static))
        return _Captured(graph, static, out[: inputs.batch])

    def figures(self) -> dict[str, float]:
        """What engine stats report (`NO_GRAPHS` where there are none)."""
        return {"graphs": len(self._graphs), "graph_captures": self.num_captures,
                "graph_capture_s": round(self.capture_s, 4), "graph_replays": self.num_replays,
                "graph_misses": self.num_misses}

    def clear(self) -> None:
        self._graphs.clear()
        self._logits.clear()

    def __len__(self) -> int:
        return len(self._graphs)
