"""A torch engine's decode graphs and its warm-up: which steps replay a graph, and capturing them all ahead.

`warm_up` captures, before serving, a graph per loaded model shape, slot
place, batch bucket and block-table width (`graphs.GraphBuckets`), and first
runs a prefill per shape as long as the pool's longest (the allocator then
holds the blocks every later prefill needs). A decode step whose shape was
captured replays its graph (`pick` + `replay`); any other runs eagerly and
counts as a miss.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from pool.engines.forward import Decoder, DecodeInputs
from pool.engines.graphs import NO_GRAPHS, GraphBuckets
from pool.engines.kvstore import KvStore, SeqKv, prefill_inputs, prefill_token_buckets
from pool.engines.residency import LoadedModel, Residency

if TYPE_CHECKING:
    from pool.engines.device import Streams
    from pool.engines.torch_engine import TorchEngineConfig


class GraphSet:
    """The decode graphs of one engine (CUDA only; a tensor-parallel rank decodes eagerly) and its warm-up."""

    def __init__(self, config: TorchEngineConfig, streams: Streams, residency: Residency, pads_prefill: bool,
                 rank: Any = None) -> None:
        self.config = config
        self.device = residency.device
        self.streams = streams
        self.residency = residency
        self.pads_prefill = pads_prefill
        self.buckets = GraphBuckets(config.graph_batch_sizes, config.graph_block_widths)
        # may be switched off later; a TP rank decodes eagerly (its all-reduces are not captured in graphs yet)
        self.enabled = streams.cuda and config.cuda_graphs and rank is None
        self.graphs: Any = None  # DecodeGraphs (CUDA only) or None
        if self.enabled:
            from pool.engines.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(max_batch=self.buckets.batch_sizes[-1])
        self.warm_prefill_s = 0.0  # seconds warm_up spent in its prefills

    # ---- serving: replay --------------------------------------------------------------------------------
    def pick(self, batch: int, max_blocks: int) -> tuple[int, int] | None:
        """The captured (padded batch, table width) a step of `batch` rows and `max_blocks` blocks replays;
        None: it runs eagerly (counted as a miss where graphs are on)."""
        if not self.enabled or self.graphs is None:
            return None
        picked = self.buckets.pick(batch, max_blocks)
        if picked is None:
            self.graphs.miss()  # outside every captured shape: eager, and counted
        return picked

    def replay(self, model: LoadedModel, decoder: Decoder, padded: int, width: int,
               inputs: DecodeInputs) -> torch.Tensor | None:
        """The logits of a step replayed from its graph; None when none was captured for it."""
        return self.graphs.replay(self.key(model, decoder, padded, width, self.residency.offset(model)), inputs)

    @staticmethod
    def key(model: LoadedModel, decoder: Decoder, padded: int, width: int, offset: int) -> tuple:
        return (model.image.spec, model.image.dtype, offset, decoder.fused, padded, width)

    # ---- warm-up: capture -----------------------------------------------------------------------------------
    def warm_up(self, max_tokens: int | None = None) -> int:
        """Capture the decode graphs of every loaded model's shape in both its places (in a shared weights
        region: of every model in its one place), for requests of
        up to `max_tokens` tokens (None: the widest table set); how many were captured (0 on CPU or with
        graphs off). First, with `config.warm_prefill_tokens`, one prefill that long per shape."""
        self._warm_prefill()
        residency = self.residency
        if self.graphs is None or not self.enabled or not residency.models:
            return 0
        slots, kv = residency.ensure(), residency.kv_store()
        max_blocks = (self.buckets.block_widths[-1] if max_tokens is None
                      else -(-max_tokens // self.config.block_size))
        todo, device = [], self.device
        for image, offset in slots.graph_places([m.image for m in residency.models.values()]):
            model = residency.models[image.name]
            decoder = residency.slot_decoder(model, offset)
            for padded, width in self.buckets.shapes(max_blocks):
                todo.append((self.key(model, decoder, padded, width, offset),
                             lambda d=decoder, b=padded, w=width, m=model: (d, _dummy_inputs(m, b, w, kv, device))))
        with torch.no_grad():
            return self.graphs.capture_all(todo)

    def _warm_prefill(self) -> None:
        """A prefill of `config.warm_prefill_tokens` tokens of each loaded shape in its first place, every K/V
        written to the shape's scratch block (the weights there need not be loaded: only the allocations and the
        kernel choices count); with padded prefills, one at each padded length up to it, longest first."""
        limit, residency = self.config.warm_prefill_tokens, self.residency
        if limit <= 0 or not residency.models:
            return
        slots, kv = residency.ensure(), residency.kv_store()
        lengths = prefill_token_buckets(limit)[::-1] if self.pads_prefill else [limit]
        started = time.perf_counter()
        with torch.no_grad():
            firsts: dict[tuple, tuple[LoadedModel, int]] = {}  # each shape in its first place
            for image, offset in slots.graph_places([m.image for m in residency.models.values()]):
                firsts.setdefault((image.spec, image.dtype), (residency.models[image.name], offset))
            for model, offset in firsts.values():
                decoder = residency.slot_decoder(model, offset)
                row = kv.scratch(model.kv_shape)
                pad_row = row if self.pads_prefill else None
                for n in lengths:
                    scratch = SeqKv(model.kv_shape, rows=[row] * -(-n // model.kv_shape.block_size))  # all scratch
                    decoder.prefill(prefill_inputs([[0] * n], [scratch], self.device, pad_row))
        self.streams.synchronize()
        self.warm_prefill_s = time.perf_counter() - started

    def figures(self) -> dict[str, Any]:
        return self.graphs.figures() if self.graphs is not None else dict(NO_GRAPHS)

    def clear(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()


def _dummy_inputs(model: LoadedModel, batch: int, width: int, kv: KvStore, device: torch.device) -> DecodeInputs:
    """Decode inputs of `batch` rows that read and write only the scratch block (for a capture)."""
    scratch = kv.scratch(model.kv_shape)
    rows = {"token_ids": [0] * batch, "positions": [0] * batch, "write_row": [scratch] * batch,
            "write_offset": [0] * batch, "lengths": [1] * batch}
    return DecodeInputs.pack(rows, [[scratch] * width] * batch, device)
