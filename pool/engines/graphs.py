"""CUDA graphs for decode steps (CUDA only; the engine never builds this on CPU).

A graph is captured per (model, device slot, batch bucket, block-table
bucket): the weights of a model always sit at the same offsets inside a slot
and the KV view never moves, so a graph stays valid whenever that model is
back in that slot. Inputs are copied into the graph's static tensors; rows
past the real batch point at a scratch block that no request owns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from pool.engines.forward import Decoder, DecodeInputs


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= n, or None when n is larger than all of them."""
    return next((s for s in sorted(sizes) if s >= n), None)


def blocks_bucket(n: int, minimum: int = 4) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: DecodeInputs
    logits: torch.Tensor


class DecodeGraphs:
    """Captures lazily and replays; least recently used graphs beyond `max_graphs` are dropped."""

    def __init__(self, max_graphs: int = 64, warmup_steps: int = 2) -> None:
        self.max_graphs = max_graphs
        self.warmup_steps = warmup_steps
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self.num_captures = 0

    def run(self, key: Hashable, decoder: Decoder, inputs: DecodeInputs) -> torch.Tensor:
        """Logits for `inputs` (already padded to a bucket), replaying a graph captured on first use."""
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(decoder, inputs)
            self._graphs[key] = captured
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        captured.static.packed.copy_(inputs.packed, non_blocking=True)
        captured.graph.replay()
        return captured.logits

    def _capture(self, decoder: Decoder, inputs: DecodeInputs) -> _Captured:
        # Static inputs start as the caller's (padded) inputs; warm-up steps write K/V
        # for them, which is harmless: the same values are written again on replay.
        static = DecodeInputs(inputs.packed.clone(), inputs.batch, inputs.max_blocks)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_steps):
                decoder.decode(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = decoder.decode(static)
        self.num_captures += 1
        return _Captured(graph, static, logits)

    def clear(self) -> None:
        self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)
