"""The swap-native PyTorch engine: many models, one device buffer, KV that moves to host and back.

Memory, as in the Aegaeon artifact: a process-wide pinned `HostWeightCache`
(one contiguous image per model), one device buffer per engine split by a
bump allocator into KV region | model region (two model slots' worth: the
models resident and the spare, placed by `slots.py` under the instance model
of `scheduler.instance`; several small models may be resident at once and a
step computes each one's batch), paged KV in slabs
on both tiers (`kv.py`), and four CUDA streams (compute, weights, swap-in,
swap-out) with per-request events so compute waits only for the KV it reads.
Requests are admitted by `prefill` (or `import_kv`) and freed by `release`,
`export_kv` or when they finish.

`TorchEngine` is the `Engine` facade over four collaborators, one per part:
`Residency` (weights and slots, `residency.py`), `KvCalls` (KV moves,
`kv_calls.py`), `GraphSet` (decode graphs and warm-up, `warmup.py`) and
`Stepper` (prefill and decode, `step.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pool.engines.base import EngineStats, GenRequest, KvCapacity, KvExport, Table, TokenOut
from pool.engines.device import Streams, held_device_bytes, input_stage_grown
from pool.engines.graphs import BATCH_SIZES, GraphBuckets
from pool.engines.handoff import ALIGN as HANDOFF_ALIGN
from pool.engines.handoff import close_orphans
from pool.engines.kv import host_pool
from pool.engines.kv_calls import KvCalls
from pool.engines.residency import Residency
from pool.engines.step import Seq, Stepper
from pool.engines.timings import StepTimings
from pool.engines.warmup import GraphSet
from pool.engines.weights import HostWeightCache, ModelImage, shared_weight_cache

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class TorchEngineConfig:
    """Sizes and switches of one engine; the defaults suit CPU tests.

    A dataclass rather than pydantic so the GPU benchmark runs on boxes that
    have only torch and transformers.
    """

    device: str = "cpu"  # torch device: 'cpu' or 'cuda[:n]'
    dtype: str | None = None  # weights/compute dtype ('bfloat16', 'float32'); None: the checkpoint's
    block_size: int = 16  # tokens per KV block
    kv_bytes: int = 64 * MiB  # the device KV region
    # device KV slab (one block shape each); None: at least 1 MiB, the whole number of the largest loaded model's
    # blocks that fits every loaded model's blocks best (pool.engines.kv.slab_bytes_for)
    device_slab_bytes: int | None = None
    # host KV slab (Aegaeon: 1 GiB): this times the power of two that fits the loaded models' blocks best
    # (pool.engines.kv.slab_bytes_for)
    host_slab_bytes: int = 4 * MiB
    max_host_kv_bytes: int = 1024 * MiB  # cap on host KV slabs
    host_kv_prealloc_bytes: int = 0  # host KV slabs made up front (pinning mid-swap costs ~0.3 s/GiB)
    max_model_bytes: int | None = None  # each model slot; None: the largest model loaded when first needed
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs captured by warm_up() (CUDA only)
    # warm_up() runs one prefill this long per model shape (the pool's max_prefill_tokens), onto a scratch block:
    # the caching allocator then holds blocks for any prefill the pool sends, so none allocates device memory
    # while serving (an allocation waits for the copies in flight: a weight prefetch, up to 0.3 s); 0: none
    warm_prefill_tokens: int = 0
    # pad each prefill's tokens to scheduler.padded_prefill_tokens (at most 12.5% more), so that its matrix shapes
    # repeat and warm_up runs them all: cuBLAS's kernel choice for a new shape cost ~10 ms a prefill on the H200;
    # None: on CUDA only (on CPU padding is only more work)
    pad_prefill: bool | None = None
    graph_batch_sizes: tuple[int, ...] = BATCH_SIZES  # padded batch sizes graphs are captured for (a pool's:
    # graphs.batch_sizes_up_to its max_batch_size)
    graph_block_widths: tuple[int, ...] = (16, 64, 256, 1024)  # block-table widths graphs are captured for
    tp: int = 1  # tensor-parallel ranks of the instance (> 1: `pool.engines.tp.TpEngine`, one process per rank)
    # device memory in which export_kv stages a hand-off's KV for an engine on the same GPU (pool.engines.handoff),
    # made at the first export; 0: hand-offs go through host memory
    handoff_bytes: int = 0
    # launch a greedy batch's next decode step before the host emits this one's tokens, so the device runs it
    # while the host samples, streams and is called again (see `decode_step`); None: on CUDA only (on CPU ops
    # run synchronously and nothing overlaps). A tensor-parallel rank never does.
    async_decode: bool | None = None
    # a directory naming the weights region this engine shares with the other engines on its device that are
    # given the same one (pool.engines.shared_weights): every loaded model once per device, at a fixed offset,
    # all resident at once if the plan says so; None: a model region of its own (two model slots)
    shared_weights: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"TorchEngineConfig.dtype = {self.dtype!r} is not a torch dtype")
        GraphBuckets(self.graph_batch_sizes, self.graph_block_widths)  # raises on a bad set
        for name in ("block_size", "device_slab_bytes", "host_slab_bytes", "tp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"TorchEngineConfig.{name} = {getattr(self, name)!r} must be >= 1")
        for name in ("kv_bytes", "max_host_kv_bytes", "host_kv_prealloc_bytes", "handoff_bytes", "warm_prefill_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"TorchEngineConfig.{name} = {getattr(self, name)!r} must be >= 0")
        if 0 < self.handoff_bytes < HANDOFF_ALIGN:  # else the first export fails making the arena (and the instance)
            raise ValueError(f"TorchEngineConfig.handoff_bytes = {self.handoff_bytes!r} must be 0 or >= {HANDOFF_ALIGN}")


def _discards_ahead(method: Callable[..., Any]) -> Callable[..., Any]:
    """Every engine call but decode_step first drops the decode step launched ahead (`Stepper.decode_step`)."""

    @functools.wraps(method)
    def call(self: TorchEngine, *args: Any, **kwargs: Any) -> Any:
        self.stepper.discard_ahead()
        return method(self, *args, **kwargs)

    return call


class TorchEngine:
    """Implements `pool.engines.base.Engine` on PyTorch (CPU or one CUDA device)."""

    def __init__(self, config: TorchEngineConfig | None = None, weight_cache: HostWeightCache | None = None,
                 rank: Any = None) -> None:
        self.config = cfg = config or TorchEngineConfig()
        self.rank = rank  # a tensor-parallel rank (`pool.engines.tp.TpRank`): its shard of every model; None: all
        self.device = torch.device(cfg.device)
        self.streams = Streams(self.device)
        self.timings = StepTimings(self.streams.cuda)
        # sized (and its reserved slabs made) at its first need: when the device buffer is made, once every
        # model is loaded, or a request is imported before that
        self.host_kv = host_pool(cfg.host_slab_bytes, cfg.max_host_kv_bytes, self.streams.cuda,
                                 lambda: [m.kv_shape.block_bytes for m in self.residency.models.values()],
                                 cfg.host_kv_prealloc_bytes)
        self.residency = Residency(cfg, self.device, self.streams, weight_cache or shared_weight_cache(),
                                   self.host_kv, rank)
        self.pads_prefill = self.streams.cuda if cfg.pad_prefill is None else cfg.pad_prefill
        self.graphs = GraphSet(cfg, self.streams, self.residency, self.pads_prefill, rank)
        self.seqs: Table[Seq] = Table.of_requests()
        self.kv_calls = KvCalls(self.seqs, self.residency, self.host_kv, self.streams, self.timings,
                                cfg.handoff_bytes)
        want_async = self.streams.cuda if cfg.async_decode is None else cfg.async_decode
        self.stepper = Stepper(self.seqs, self.residency, self.graphs, self.streams, self.timings,
                               self.kv_calls.forget, async_decode=want_async and rank is None,
                               pads_prefill=self.pads_prefill)

    # ---- switches a benchmark may flip between calls --------------------------------------------------------
    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs (on CUDA, not on a TP rank: its all-reduces are not captured yet)."""
        return self.graphs.enabled

    @use_cuda_graphs.setter
    def use_cuda_graphs(self, value: bool) -> None:
        self.graphs.enabled = value

    @property
    def fused(self) -> bool | None:
        """Fused Triton kernels (decode and prefill); None: wherever they run (CUDA)."""
        return self.residency.fused

    @fused.setter
    def fused(self, value: bool | None) -> None:
        self.residency.fused = value

    @property
    def async_decode(self) -> bool:
        """A greedy batch's next decode step is launched before this one's tokens are emitted (`step.py`)."""
        return self.stepper.async_decode

    @async_decode.setter
    def async_decode(self, value: bool) -> None:
        self.stepper.async_decode = value

    @property
    def weights(self) -> HostWeightCache:
        return self.residency.weights

    @property
    def warm_prefill_s(self) -> float:
        """Seconds warm_up spent in its prefills."""
        return self.graphs.warm_prefill_s

    # ---- models -------------------------------------------------------------------------
    def load(self, model: str, path: Path) -> None:
        self.residency.load(model, path)

    def add_image(self, image: ModelImage, tokenizer: Any = None, eos_ids: Iterable[int] = ()) -> None:
        """Register an image already in the host cache (benchmarks build random ones)."""
        self.residency.add_image(image, tokenizer, eos_ids)

    def models(self) -> list[str]:
        return list(self.residency.models)

    def tokenizer(self, model: str) -> Any:
        return self.residency.models.require(model).tokenizer

    def model_bytes(self, model: str) -> int:
        return self.residency.models.require(model).image.nbytes

    @_discards_ahead
    def activate(self, model: str, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        """Make `model` active (`evict=False`: resident beside those already resident; `keep`: the models that
        stay cached beside it, the plan's resident set); returns the seconds."""
        self.timings.other()
        return self.residency.activate(model, evict, keep)

    @_discards_ahead
    def prefetch(self, model: str, keep: tuple[str, ...] | None = None) -> None:
        self.timings.other()
        self.residency.prefetch(model, keep)

    def weights_pinned(self, model: str) -> bool:
        return self.residency.models.require(model).image.buffer.is_pinned()

    def weights_ready(self, model: str) -> bool:
        """True when `model`'s weights are wholly on the device (a prefetch has landed)."""
        return self.residency.ready_on_device(model)

    @_discards_ahead
    def deactivate(self, model: str) -> None:
        self.residency.deactivate(model)

    @_discards_ahead
    def drop_resident(self, model: str) -> None:
        """Forget the device copy of an inactive model, so its next `activate` copies it in again."""
        self.residency.drop(model)

    # ---- generation -----------------------------------------------------------------------
    @_discards_ahead
    def prefill(self, requests: Sequence[GenRequest]) -> list[TokenOut]:
        """Admit the requests (of resident models) and prefill each model's prompts; tokens in request order."""
        return self.stepper.prefill(requests)

    def decode_step(self, request_ids: Sequence[str]) -> list[TokenOut]:
        """One token for each request (of resident models, KV on the device): one forward per model's batch;
        takes the step launched ahead for these requests, if any (`Stepper.decode_step`)."""
        return self.stepper.decode_step(request_ids)

    @_discards_ahead
    def warm_up(self, max_tokens: int | None = None) -> int:
        """Capture the decode graphs for requests of up to `max_tokens` tokens, so that serving never captures;
        how many were captured (`GraphSet.warm_up`). Call it outside any other call of this engine."""
        return self.graphs.warm_up(max_tokens)

    # ---- KV movement ---------------------------------------------------------------------------
    @_discards_ahead
    def save_kv(self, request_ids: Sequence[str]) -> None:
        self.kv_calls.save(request_ids)

    @_discards_ahead
    def restore_kv(self, request_ids: Sequence[str]) -> None:
        self.kv_calls.restore(request_ids)

    @_discards_ahead
    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the requests and free their KV, wherever it is (also KV staged for a hand-off, once the
        importing engine has copied it); unknown ids are ignored."""
        self.timings.other()
        for rid in request_ids:
            self.kv_calls.forget(rid)

    @_discards_ahead
    def export_kv(self, request_ids: Sequence[str]) -> list[KvExport]:
        """Move requests out (see `KvExport` and `KvCalls.export`), then forget them."""
        return self.kv_calls.export(request_ids)

    @_discards_ahead
    def import_kv(self, exports: Sequence[KvExport]) -> None:
        """Admit exported requests, all or none (`KvCalls.import_`)."""
        self.kv_calls.import_(exports)

    def synchronize(self) -> None:
        self.streams.synchronize()

    def kv_capacity(self) -> KvCapacity:
        """Tokens of each loaded model the device KV holds, after block and slab rounding (makes the device
        buffer when it is not made yet: call it once every model is loaded)."""
        # a scratch block per shape for the graphs' padded rows and the warm-up prefill
        held = 1 if self.use_cuda_graphs or self.config.warm_prefill_tokens else 0
        slots = self.residency.ensure()
        return dataclasses.replace(self.kv_calls.capacity(held), weight_bytes=slots.region_bytes,
                                   model_bytes={m.name: m.image.nbytes for m in self.residency.models.values()})

    def stats(self) -> EngineStats:
        self.timings.other()
        close_orphans()  # arenas opened from dead exporters: their device memory goes now
        res, kv, host = self.residency, self.residency.kv, self.host_kv
        slots = res.slots
        return EngineStats(
            device=str(self.device),
            device_buffer_bytes=res.buffer.nbytes if res.buffer else 0,
            kv_device_bytes=kv.device.max_slabs * kv.device.slab_bytes if kv else 0,
            kv_capacity=self.kv_capacity() if kv else None,
            kv_device_used_bytes=kv.device.used_bytes() if kv else 0,
            kv_host_bytes=host.made_bytes(),
            kv_host_used_bytes=host.used_bytes(),
            host_weight_bytes=sum(m.image.nbytes for m in res.models.values()),
            loaded_models=tuple(res.models),
            active_model=slots.active_model if slots else None,
            prefetched_model=slots.prefetched if slots else None,
            resident_models=tuple(sorted(slots.resident)) if slots else (),
            num_requests=len(self.seqs),
            bytes_h2d=res.weight_bytes_h2d + (kv.bytes_h2d if kv else 0),
            bytes_d2h=kv.bytes_d2h if kv else 0,
            num_switches=res.num_switches,
            switch_s=res.switch_s,
            num_weight_copies=res.num_weight_copies,
            extra=self._extra_stats(),
        )

    def _extra_stats(self) -> dict[str, Any]:
        res, kv = self.residency, self.residency.kv
        return {"weight_bytes_h2d": res.weight_bytes_h2d, "device_slabs": kv.device.num_slabs if kv else 0,
                "host_slabs": self.host_kv.num_slabs, "weights_on_device": tuple(res.slots.placed) if res.slots else (),
                **self.graphs.figures(),
                "held_device_bytes": held_device_bytes(self.device),
                # allocations on the request path that can wait for the device (copies in flight included):
                # cudaMalloc retries after freeing cached blocks, pinned input buffers grown
                "alloc_retries": torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
                if self.streams.cuda else 0,
                "input_stage_grown": input_stage_grown(self.device),
                **self.kv_calls.figures(),
                "async_decode": self.async_decode, "decode_steps_ahead": self.stepper.num_steps_ahead,
                "decode_steps_discarded": self.stepper.num_steps_discarded,
                "timings": self.timings.summary()}

    @_discards_ahead
    def close(self) -> None:
        """Free the device buffer, graphs and decoders (a restarted instance needs the memory); the
        engine is unusable after. Host weights stay in the shared cache."""
        try:
            self.streams.synchronize()
        except RuntimeError:  # a failed kernel leaves the context broken; free what can be freed
            pass
        self.seqs.clear()
        self.graphs.clear()
        self.residency.close()
        self.kv_calls.close()
        if self.streams.cuda:
            torch.cuda.empty_cache()
