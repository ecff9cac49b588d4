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
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pool.engines.base import (EngineError, EngineStats, GenRequest, KvCapacity, KvExport, OutOfKvMemory, StagedKv,
                               Table, TokenOut, check_admissible, check_new, check_on_device, check_resident,
                               check_unique)
from pool.engines.device import (DeviceBuffer, Streams, align_up, held_device_bytes, input_stage_grown, to_device,
                                 wait_event)
from pool.engines.forward import Decoder, DecodeInputs, SharedTensors
from pool.engines.graphs import BATCH_SIZES, NO_GRAPHS, GraphBuckets
from pool.engines.handoff import ALIGN as HANDOFF_ALIGN
from pool.engines.handoff import StagingArena, close_orphans, staged_view
from pool.engines.kv import KvShape, host_pool, slab_bytes_for
from pool.engines.kvstore import (KvStore, SeqKv, allocate_all, decode_inputs, free_host, prefill_inputs,
                                  prefill_token_buckets, read_host, write_tokens)
from pool.engines.sampling import OutputText, finish_reason, random_seed, sample
from pool.engines.slots import ModelSlots
from pool.engines.timings import StepTimings
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
    # device KV slab (one block shape each); None: at least 1 MiB, a whole number of every loaded model's blocks
    device_slab_bytes: int | None = None
    host_slab_bytes: int = 4 * MiB  # host KV slab (Aegaeon: 1 GiB)
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


@dataclass(slots=True)
class _Model:
    name: str
    image: ModelImage
    kv_shape: KvShape
    tokenizer: Any
    eos_ids: frozenset[int]


@dataclass(slots=True, eq=False)
class _Seq:
    request: GenRequest
    model: _Model
    tokens: list[int]  # prompt + output; after each step the last one has no KV yet
    num_prompt: int
    seed: int
    text: OutputText
    kv: SeqKv
    greedy: bool = field(init=False)  # its token is the argmax (nothing read from the host's history)
    max_len: int = field(init=False)  # prompt + max_tokens: it ends with this many tokens at the latest

    def __post_init__(self) -> None:
        p = self.request.sampling
        self.greedy = p.greedy and p.repetition_penalty == 1.0
        self.max_len = self.num_prompt + p.max_tokens

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass(slots=True)
class _Launched:
    """One model's batch of a decode step, queued on the device; its token ids are on their way to the host."""

    seqs: list[_Seq]
    device_ids: torch.Tensor | None  # [B] the greedy ids on the device (what the step after feeds); None: sampled
    host_ids: torch.Tensor | list[int]  # their host copy (lands at `ready`), or the sampled ids
    ready: Any  # CUDA event after the copy to the host; None on CPU
    forward: Any  # the forward timer (`StepTimings.forward_end`); None: untimed


@dataclass(slots=True)
class _Ahead:
    """The decode step launched before the last one's tokens were emitted, for the same batch."""

    key: tuple  # (request ids, graphs on, fused): a decode_step with this key takes it
    steps: list[_Launched]
    blocks_before: list[tuple[SeqKv, int]]  # device blocks of each request before it grew for this step


def _discards_ahead(method: Callable[..., Any]) -> Callable[..., Any]:
    """Every engine call but decode_step first drops the decode step launched ahead (`TorchEngine.decode_step`)."""

    @functools.wraps(method)
    def call(self: TorchEngine, *args: Any, **kwargs: Any) -> Any:
        self._discard_ahead()
        return method(self, *args, **kwargs)

    return call


class TorchEngine:
    """Implements `pool.engines.base.Engine` on PyTorch (CPU or one CUDA device)."""

    def __init__(self, config: TorchEngineConfig | None = None, weight_cache: HostWeightCache | None = None,
                 rank: Any = None) -> None:
        self.config = config or TorchEngineConfig()
        self.rank = rank  # a tensor-parallel rank (`pool.engines.tp.TpRank`): its shard of every model; None: all
        self.device = torch.device(self.config.device)
        self.dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
        self.weights = weight_cache or shared_weight_cache()
        self.streams = Streams(self.device)
        self._models: Table[_Model] = Table.of_models()
        self._seqs: Table[_Seq] = Table.of_requests()
        self._buffer: DeviceBuffer | None = None
        self._slots: ModelSlots | None = None
        self._kv: KvStore | None = None
        self._kv_report: tuple[Any, KvCapacity] | None = None  # kv_capacity()'s answer for these models
        self._host_kv = host_pool(self.config.host_slab_bytes, self.config.max_host_kv_bytes, self.streams.cuda)
        self._host_kv.reserve(-(-self.config.host_kv_prealloc_bytes // self.config.host_slab_bytes))
        self._arena: StagingArena | None = None  # made at the first staged export
        self._staged: dict[str, int] = {}  # request id -> offset of its staged KV in the arena, until released
        self._decoders: dict[tuple[str, int, bool | None], Decoder] = {}
        self._shared: dict[tuple[Any, torch.dtype, int], SharedTensors] = {}  # (spec, dtype, slot) -> tensors
        self._graphs: Any = None
        self.buckets = GraphBuckets(self.config.graph_batch_sizes, self.config.graph_block_widths)
        # may be switched off later; a TP rank decodes eagerly (its all-reduces are not captured in graphs yet)
        self.use_cuda_graphs = self.streams.cuda and self.config.cuda_graphs and rank is None
        self.fused: bool | None = None  # fused Triton kernels (decode and prefill); None: wherever they run (CUDA)
        if self.use_cuda_graphs:
            from pool.engines.graphs import DecodeGraphs

            self._graphs = DecodeGraphs(max_batch=self.buckets.batch_sizes[-1])
        want_async = self.streams.cuda if self.config.async_decode is None else self.config.async_decode
        self.async_decode = want_async and rank is None  # may be switched off later, as use_cuda_graphs
        self.pads_prefill = self.streams.cuda if self.config.pad_prefill is None else self.config.pad_prefill
        self.warm_prefill_s = 0.0  # seconds warm_up spent in its prefills
        self._ahead: _Ahead | None = None
        self.num_steps_ahead = self.num_steps_discarded = 0
        self.weight_bytes_h2d = self.num_switches = self.num_weight_copies = 0
        self.switch_s = 0.0
        self.timings = StepTimings(self.streams.cuda)

    # ---- models -------------------------------------------------------------------------
    def load(self, model: str, path: Path) -> None:
        if model in self._models:
            return
        from transformers import AutoTokenizer

        shard = (0, 1) if self.rank is None else (self.rank.rank, self.rank.size)
        image = self.weights.load(model, Path(path), self.dtype, shard)
        self.add_image(image, AutoTokenizer.from_pretrained(path), _eos_ids(Path(path)))

    def add_image(self, image: ModelImage, tokenizer: Any = None, eos_ids: Iterable[int] = ()) -> None:
        """Register an image already in the host cache (benchmarks build random ones)."""
        spec = image.spec
        shape = KvShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.config.block_size, image.dtype)
        eos = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self._models[image.name] = _Model(image.name, image, shape, tokenizer, frozenset(eos))

    def models(self) -> list[str]:
        return list(self._models)

    def tokenizer(self, model: str) -> Any:
        return self._models.require(model).tokenizer

    def model_bytes(self, model: str) -> int:
        return self._models.require(model).image.nbytes

    @_discards_ahead
    def activate(self, model: str, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        """Make `model` active (`evict=False`: resident beside those already resident; `keep`: the models that
        stay cached beside it, the plan's resident set); returns the seconds."""
        self.timings.other()
        image = self._models.require(model).image
        slots = self._ensure_buffer()
        if keep is None and slots.active_model == model and (not evict or slots.resident == {model}):
            return 0.0
        seconds = slots.activate(image, evict, keep)
        self.num_switches += 1
        self.switch_s += seconds
        return seconds

    @_discards_ahead
    def prefetch(self, model: str, keep: tuple[str, ...] | None = None) -> None:
        self.timings.other()
        self._ensure_buffer().prefetch(self._models.require(model).image, keep)

    def weights_pinned(self, model: str) -> bool:
        return self._models.require(model).image.buffer.is_pinned()

    def weights_ready(self, model: str) -> bool:
        """True when `model`'s weights are wholly on the device (a prefetch has landed)."""
        return self._slots is not None and self._slots.ready_on_device(model)

    @_discards_ahead
    def deactivate(self, model: str) -> None:
        if self._slots is not None:
            self._slots.deactivate(model)

    @_discards_ahead
    def drop_resident(self, model: str) -> None:
        """Forget the device copy of an inactive model, so its next `activate` copies it in again."""
        if self._slots is not None:
            self._slots.drop(model)

    # ---- generation -----------------------------------------------------------------------
    @_discards_ahead
    def prefill(self, requests: Sequence[GenRequest]) -> list[TokenOut]:
        """Admit the requests (of resident models) and prefill each model's prompts; tokens in request order."""
        started = time.perf_counter()
        check_new("prefill", [r.request_id for r in requests], self._seqs)
        seqs = [self._admit(r) for r in requests]
        if not seqs:
            return []
        kv = self._kv_store()
        kv.grow([s.kv for s in seqs], [len(s.tokens) for s in seqs])
        self._seqs.update((s.request.request_id, s) for s in seqs)
        outs: dict[str, TokenOut] = {}
        for group in _by_model(seqs):
            pad_row = kv.scratch(group[0].model.kv_shape) if self.pads_prefill else None
            inputs = prefill_inputs([s.tokens for s in group], [s.kv for s in group], self.device, pad_row)
            logits = self._decoder(group[0].model).prefill(inputs)
            outs.update((o.request_id, o) for o in self._emit(group, self._sample(group, logits)))
            self.timings.prefill(group[0].model.name, sum(len(s.tokens) for s in group) - len(group), len(group),
                                 time.perf_counter() - started)
            started = time.perf_counter()
        return [outs[s.request.request_id] for s in seqs]

    def decode_step(self, request_ids: Sequence[str]) -> list[TokenOut]:
        """One token for each request (of resident models, KV on the device): one forward per model's batch.

        Async decode (vLLM v1's async scheduling): once this step is queued, the next step of the same batch
        is queued behind it, fed the sampled ids on the device, before the host waits for this step's ids and
        emits them, so the device computes it while the host streams tokens and is called again. The next
        call for the same request ids takes that step; any other call discards it (`_discard_ahead`): it wrote
        only KV past the requests' lengths, with the values the next step writes again.
        """
        entered_at = time.perf_counter()
        key = self._batch_key(request_ids)
        if self._ahead is not None and self._ahead.key != key:
            self._discard_ahead()
        check_unique("decode_step", request_ids)
        seqs = [self._runnable(rid) for rid in request_ids]
        if not seqs:
            return []
        kv, kvs = self._kv_store(), [s.kv for s in seqs]
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            steps = ahead.steps
        else:
            kv.grow(kvs, [len(s.tokens) for s in seqs])  # room for the token fed now
            kv.before_compute(kvs)
            steps = [self._launch(kv, group) for group in _by_model(seqs)]
        going = self._ahead_rows(seqs)
        if going:
            self._launch_ahead(kv, going, steps)
        outs: dict[str, TokenOut] = {}
        forward: float | None = 0.0
        for step in steps:
            ids = _host_ids(step)
            # a CUDA forward is a pair of events, complete once the batch's tokens were read: seconds now
            forward = None if forward is None or step.forward is None else forward + self.timings.seconds(step.forward)
            outs.update((o.request_id, o) for o in self._emit(step.seqs, ids))
        self.timings.decode(tuple(request_ids), entered_at, forward, ahead is not None,
                            "+".join(sorted({s.model.name for s in seqs})))
        return [outs[rid] for rid in request_ids]

    def _batch_key(self, request_ids: Sequence[str]) -> tuple:
        """What a step launched ahead is for: a decode_step with this key takes it (`_Ahead.key`)."""
        return tuple(request_ids), self.use_cuda_graphs, self.fused

    def _ahead_rows(self, seqs: list[_Seq]) -> list[_Seq]:
        """The requests whose next step can be launched now: greedy rows only (sampling reads the host's
        history), less any that ends with this step's token by its length - the batch the next call brings
        then, in this order (the scheduler goes on with the rest of the turn: on the H200 at 22 req/s, 634 of
        the decode instance's 736 turns began so); none where a row samples."""
        if not self.async_decode or not all(s.greedy for s in seqs):
            return []
        return [s for s in seqs if len(s.tokens) + 1 < s.max_len]

    def _launch_ahead(self, kv: KvStore, going: list[_Seq], steps: list[_Launched]) -> None:
        """Queue the step after `steps` for the requests `going` on: positions + 1, fed their ids on the
        device (the rows of those going on, where a request ends with this step: a step of its own batch,
        the same as a call for that batch would launch)."""
        kvs = [s.kv for s in going]
        before = [(k, len(k.blocks)) for k in kvs]
        try:
            kv.grow(kvs, [len(s.tokens) + 1 for s in going])  # the next token's block
        except OutOfKvMemory:
            return  # no room ahead: the next call runs it as before
        keep = {id(s) for s in going}
        launched = []
        for step in steps:
            rows = [i for i, s in enumerate(step.seqs) if id(s) in keep]
            if not rows:
                continue
            fed = step.device_ids  # greedy rows: their ids are on the device
            assert fed is not None
            if len(rows) < len(step.seqs):  # a gather on the device (its row numbers read by a kernel)
                fed = fed[to_device(np.asarray(rows, dtype=np.int64), self.device)]
            launched.append(self._launch(kv, [step.seqs[i] for i in rows], fed))
        self._ahead = _Ahead(self._batch_key([s.request.request_id for s in going]), launched, before)
        self.num_steps_ahead += 1

    def _discard_ahead(self) -> None:
        """Drop the step launched ahead (every call but the decode_step that takes it comes here first) and
        give back the blocks it grew. Device work queued later on the compute stream, or on a copy stream
        (they wait for queued compute), comes after its KV writes, so the blocks are free for reuse now."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        self.num_steps_discarded += 1
        for seq_kv, num_blocks in ahead.blocks_before:
            if seq_kv.on_device and self._kv is not None:
                self._kv.trim(seq_kv, num_blocks)

    def _launch(self, kv: KvStore, seqs: list[_Seq], fed: torch.Tensor | None = None) -> _Launched:
        """Queue one decode step of one model's requests (replayed from a CUDA graph when one was captured
        for it) and its greedy ids' copy to the host. `fed`: the ids (on the device) of the step queued just
        before, which the requests' token lists do not hold yet; the step then runs one position further."""
        kvs = [s.kv for s in seqs]
        model, batch = seqs[0].model, len(seqs)
        decoder = self._decoder(model)
        ahead = 0 if fed is None else 1
        last = [0] * batch if fed is not None else [s.tokens[-1] for s in seqs]
        positions = [len(s.tokens) - 1 + ahead for s in seqs]
        max_blocks = max(len(k.blocks) for k in kvs)
        graphs: Any = self._graphs if self.use_cuda_graphs else None  # DecodeGraphs (CUDA only) or None
        picked = self.buckets.pick(batch, max_blocks) if graphs is not None else None
        if graphs is not None and picked is None:
            graphs.miss()  # outside every captured shape: eager, and counted
        logits, forward = None, None
        if picked is not None:
            padded, width = picked
            inputs = decode_inputs(last, kvs, positions, self.device, padded, width, kv.scratch(model.kv_shape))
            if fed is not None:
                inputs.row("token_ids")[:batch].copy_(fed)
            timer = self.timings.forward_begin()
            logits = graphs.replay(self._graph_key(model, decoder, padded, width, self._offset(model)), inputs)
            if logits is not None:
                logits, forward = logits[:batch], self.timings.forward_end(timer)
        if logits is None:
            inputs = decode_inputs(last, kvs, positions, self.device, batch, max_blocks)
            if fed is not None:
                inputs.row("token_ids").copy_(fed)
            timer = self.timings.forward_begin()
            logits = decoder.decode(inputs)
            forward = self.timings.forward_end(timer) if not self.streams.cuda else None  # eager CUDA: untimed
        if not all(s.greedy for s in seqs):
            return _Launched(seqs, None, self._sample(seqs, logits), None, forward)
        device_ids = logits.argmax(dim=-1)  # greedy, as `sample` picks, left on the device for the next step
        host_ids = device_ids.to("cpu", non_blocking=True)  # into pinned memory on CUDA
        return _Launched(seqs, device_ids, host_ids, self.streams.record(self.streams.compute), forward)

    # ---- CUDA graphs --------------------------------------------------------------------------
    @_discards_ahead
    def warm_up(self, max_tokens: int | None = None) -> int:
        """Capture the decode graphs of every loaded model's shape in both its places, for requests of
        up to `max_tokens` tokens (None: the widest table set), so that serving never captures; returns
        how many were captured (0 on CPU or with graphs off). Call it outside any other call of this engine.
        First, with `config.warm_prefill_tokens`, one prefill that long per shape (see the config)."""
        self._warm_prefill()
        if self._graphs is None or not self.use_cuda_graphs or not self._models:
            return 0
        slots = self._ensure_buffer()
        kv = self._kv_store()
        max_blocks = (self.buckets.block_widths[-1] if max_tokens is None
                      else -(-max_tokens // self.config.block_size))
        todo = []
        shapes = {(m.image.spec, m.image.dtype): m for m in self._models.values()}
        for model in shapes.values():
            for offset in slots.places_of(model.image.nbytes):
                decoder = self._slot_decoder(model, offset)
                for padded, width in self.buckets.shapes(max_blocks):
                    todo.append((self._graph_key(model, decoder, padded, width, offset),
                                 lambda d=decoder, b=padded, w=width, m=model: (d, self._dummy_inputs(m, b, w, kv))))
        with torch.no_grad():
            return self._graphs.capture_all(todo)

    def _warm_prefill(self) -> None:
        """A prefill of `config.warm_prefill_tokens` tokens of each loaded shape in its first place, every K/V
        written to the shape's scratch block (the weights there need not be loaded: only the allocations and the
        kernel choices count); with padded prefills, one at each padded length up to it, longest first."""
        limit = self.config.warm_prefill_tokens
        if limit <= 0 or not self._models:
            return
        slots, kv = self._ensure_buffer(), self._kv_store()
        shapes = {(m.image.spec, m.image.dtype): m for m in self._models.values()}
        lengths = prefill_token_buckets(limit)[::-1] if self.pads_prefill else [limit]
        started = time.perf_counter()
        with torch.no_grad():
            for model in shapes.values():
                decoder = self._slot_decoder(model, slots.places_of(model.image.nbytes)[0])
                row = kv.scratch(model.kv_shape)
                pad_row = row if self.pads_prefill else None
                for n in lengths:
                    scratch = SeqKv(model.kv_shape, rows=[row] * -(-n // model.kv_shape.block_size))  # all scratch
                    decoder.prefill(prefill_inputs([[0] * n], [scratch], self.device, pad_row))
        self.streams.synchronize()
        self.warm_prefill_s = time.perf_counter() - started

    def _graph_key(self, model: _Model, decoder: Decoder, padded: int, width: int, offset: int) -> tuple:
        return (model.image.spec, model.image.dtype, offset, decoder.fused, padded, width)

    def _offset(self, model: _Model) -> int:
        return self._ensure_buffer().placement(model.name).offset

    def _dummy_inputs(self, model: _Model, batch: int, width: int, kv: KvStore) -> DecodeInputs:
        """Decode inputs of `batch` rows that read and write only the scratch block (for a capture)."""
        scratch = kv.scratch(model.kv_shape)
        rows = {"token_ids": [0] * batch, "positions": [0] * batch, "write_row": [scratch] * batch,
                "write_offset": [0] * batch, "lengths": [1] * batch}
        return DecodeInputs.pack(rows, [[scratch] * width] * batch, self.device)

    # ---- KV movement ---------------------------------------------------------------------------
    @_discards_ahead
    def save_kv(self, request_ids: Sequence[str]) -> None:
        started, kv = time.perf_counter(), self._kv_store()
        before = kv.bytes_d2h
        kv.save([self._seqs.require(rid).kv for rid in request_ids])
        self.timings.kv_call("save_kv", len(request_ids), kv.bytes_d2h - before, time.perf_counter() - started)

    @_discards_ahead
    def restore_kv(self, request_ids: Sequence[str]) -> None:
        started, kv = time.perf_counter(), self._kv_store()
        before = kv.bytes_h2d
        kv.restore([self._seqs.require(rid).kv for rid in request_ids])
        self.timings.kv_call("restore_kv", len(request_ids), kv.bytes_h2d - before, time.perf_counter() - started)

    @_discards_ahead
    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the requests and free their KV, wherever it is (also KV staged for a hand-off, once the
        importing engine has copied it); unknown ids are ignored."""
        self.timings.other()
        for rid in request_ids:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            self._free_kv(seq.kv)
        offset = self._staged.pop(rid, None)
        if offset is not None and self._arena is not None:
            self._arena.free(offset)

    @_discards_ahead
    def export_kv(self, request_ids: Sequence[str]) -> list[KvExport]:
        """Move requests out (see `KvExport`): KV read from host memory, or off the device (staged in device
        memory when the engine has a hand-off arena with room: `handoff_bytes`); then forget them."""
        check_unique("export_kv", request_ids)
        started = time.perf_counter()
        seqs = [self._seqs.require(rid) for rid in request_ids]
        exports = [self._export(seq) for seq in seqs]  # nothing changes until all are copied out
        waited, launched = 0.0, None
        if any(e.staged for e in exports):
            launched = time.perf_counter() - started
            # the gathers (on the compute stream) are complete before anyone reads the regions; not the whole
            # device: a weight prefetch in flight took this to 112 ms at p90 on the H200
            waited = self.streams.compute_done()
        for seq in seqs:
            del self._seqs[seq.request.request_id]
            self._free_kv(seq.kv)
        self._kv_timing("export_kv", exports, started, waited, launched)
        return exports

    @_discards_ahead
    def import_kv(self, exports: Sequence[KvExport]) -> None:
        """Admit exported requests (all or none): KV from host memory into host blocks, as after `save_kv`;
        KV staged in device memory straight into device blocks, copied before this returns (the exporter may
        then free it: the caller releases the requests there)."""
        started, exports = time.perf_counter(), list(exports)
        check_new("import_kv", [e.request.request_id for e in exports], self._seqs)
        seqs = [self._imported(e) for e in exports]  # all checked before any block is taken
        staged = [(s, e) for s, e in zip(seqs, exports) if e.staged]
        hosted = [(s, e) for s, e in zip(seqs, exports) if not e.staged]
        counts = [s.kv.shape.blocks_for(e.num_tokens) for s, e in hosted]
        targets = allocate_all(self._host_kv, [s.kv for s, _ in hosted], counts)  # OutOfKvMemory: nothing taken
        waited, launched = 0.0, None
        if staged:
            try:
                self._kv_store().admit_device([s.kv for s, _ in staged], [e.kv_tensor() for _, e in staged])
            except Exception:
                for (seq, _), blocks in zip(hosted, targets):
                    self._host_kv.free(seq.kv.shape, blocks)
                raise
            launched = time.perf_counter() - started
            waited = self.streams.compute_done()  # copied (on the compute stream): the exporter may reuse its regions
        for (seq, export), blocks in zip(hosted, targets):
            write_tokens(export.kv_tensor(), self._host_kv, seq.kv.shape, blocks)
            seq.kv.host_blocks = blocks
        for seq in seqs:
            self._seqs[seq.request.request_id] = seq
        self._kv_timing("import_kv", exports, started, waited, launched)

    def _kv_timing(self, method: str, exports: list[KvExport], started: float, waited: float,
                   launched: float | None) -> None:
        """One KV call's timing (`waited`: of it for the compute stream, `launched`: of it before that wait);
        a call that moved staged KV is booked as `method(device)`."""
        name = f"{method}(device)" if any(e.staged for e in exports) else method
        self.timings.kv_call(name, len(exports), sum(e.kv_bytes for e in exports), time.perf_counter() - started,
                             waited, launched)

    def synchronize(self) -> None:
        self.streams.synchronize()

    def kv_capacity(self) -> KvCapacity:
        """Tokens of each loaded model the device KV holds, after block and slab rounding (makes the device
        buffer when it is not made yet: call it once every model is loaded)."""
        device = self._kv_store().device
        # a scratch block per shape for the graphs' padded rows and the warm-up prefill
        held = 1 if self.use_cuda_graphs or self.config.warm_prefill_tokens else 0
        key = (tuple(self._models), held)
        if self._kv_report is None or self._kv_report[0] != key:
            shapes = [m.kv_shape for m in self._models.values()]
            self._kv_report = key, KvCapacity(
                tokens={m.name: device.usable_blocks(m.kv_shape, shapes, held) * m.kv_shape.block_size
                        for m in self._models.values()},
                block_tokens={m.name: m.kv_shape.block_size for m in self._models.values()})
        return self._kv_report[1]

    def stats(self) -> EngineStats:
        self.timings.other()
        close_orphans()  # arenas opened from dead exporters: their device memory goes now
        slots, kv, host = self._slots, self._kv, self._host_kv
        return EngineStats(
            device=str(self.device),
            device_buffer_bytes=self._buffer.nbytes if self._buffer else 0,
            kv_device_bytes=kv.device.max_slabs * kv.device.slab_bytes if kv else 0,
            kv_capacity=self.kv_capacity() if kv else None,
            kv_device_used_bytes=kv.device.used_bytes() if kv else 0,
            kv_host_bytes=host.made_bytes(),
            kv_host_used_bytes=host.used_bytes(),
            host_weight_bytes=sum(m.image.nbytes for m in self._models.values()),
            loaded_models=tuple(self._models),
            active_model=slots.active_model if slots else None,
            prefetched_model=slots.prefetched if slots else None,
            resident_models=tuple(sorted(slots.resident)) if slots else (),
            num_requests=len(self._seqs),
            bytes_h2d=self.weight_bytes_h2d + (kv.bytes_h2d if kv else 0),
            bytes_d2h=kv.bytes_d2h if kv else 0,
            num_switches=self.num_switches,
            switch_s=self.switch_s,
            num_weight_copies=self.num_weight_copies,
            extra={"weight_bytes_h2d": self.weight_bytes_h2d, "device_slabs": kv.device.num_slabs if kv else 0,
                   "host_slabs": host.num_slabs, "weights_on_device": tuple(slots.placed) if slots else (),
                   **(self._graphs.figures() if self._graphs is not None else NO_GRAPHS),
                   "held_device_bytes": held_device_bytes(self.device),
                   # allocations on the request path that can wait for the device (copies in flight included):
                   # cudaMalloc retries after freeing cached blocks, pinned input buffers grown
                   "alloc_retries": torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
                   if self.streams.cuda else 0,
                   "input_stage_grown": input_stage_grown(self.device),
                   "handoff_arena_bytes": self._arena.ref.nbytes if self._arena else 0,
                   "handoff_staged_bytes": self._arena.used_bytes if self._arena else 0,
                   "async_decode": self.async_decode, "decode_steps_ahead": self.num_steps_ahead,
                   "decode_steps_discarded": self.num_steps_discarded,
                   "timings": self.timings.summary()},
        )

    @_discards_ahead
    def close(self) -> None:
        """Free the device buffer, graphs and decoders (a restarted instance needs the memory); the
        engine is unusable after. Host weights stay in the shared cache."""
        try:
            self.streams.synchronize()
        except RuntimeError:  # a failed kernel leaves the context broken; free what can be freed
            pass
        self._seqs.clear()
        if self._graphs is not None:
            self._graphs.clear()
        for shared in self._shared.values():
            shared.owner = None  # decoder <-> shared tensors: no cycle left for the collector
        self._decoders.clear()
        self._shared.clear()
        self._buffer = self._slots = self._kv = None
        self._arena, self._staged = None, {}
        self._kv_report = None
        if self.streams.cuda:
            torch.cuda.empty_cache()

    # ---- internals -------------------------------------------------------------------------------
    def _ensure_buffer(self) -> ModelSlots:
        """The device buffer, made on first need: KV region | model region (two model slots' worth)."""
        if self._slots is None:
            cfg = self.config
            slot = align_up(cfg.max_model_bytes or max((m.image.nbytes for m in self._models.values()), default=0))
            self._buffer = DeviceBuffer({"kv": cfg.kv_bytes, "models": 2 * slot}, self.device)
            self._slots = ModelSlots(self._buffer.region("models"), self.streams, on_copy=self._count_weight_copy)
            slab = cfg.device_slab_bytes or slab_bytes_for([m.kv_shape.block_bytes for m in self._models.values()], MiB)
            self._kv = KvStore(self._buffer.region("kv"), slab, self._host_kv, self.streams)
        return self._slots

    def _kv_store(self) -> KvStore:
        self._ensure_buffer()
        return self._kv  # type: ignore[return-value]

    def _free_kv(self, kv: SeqKv) -> None:
        if self._kv is not None:
            self._kv.free(kv)
        else:  # imported and never run here: host blocks only, no device buffer needed
            free_host(self._host_kv, kv)

    def _export(self, seq: _Seq) -> KvExport:
        num_tokens = len(seq.tokens) - 1
        shape = seq.kv.shape
        dims = (shape.num_layers, 2, shape.num_kv_heads, num_tokens, shape.head_dim)
        kv: Any = self._stage(seq, dims) if seq.kv.on_device and self.config.handoff_bytes else None
        if kv is None:
            data = (self._kv_store().read_device(seq.kv, num_tokens) if seq.kv.on_device
                    else read_host(self._host_kv, seq.kv, num_tokens))
            kv = data.reshape(-1).view(torch.uint8).numpy()
        return KvExport(
            request=replace(seq.request, prompt_token_ids=tuple(seq.tokens[: seq.num_prompt]),
                            output_token_ids=tuple(seq.tokens[seq.num_prompt :])),
            seed=seq.seed, num_tokens=num_tokens,
            kv=kv, kv_dtype=str(shape.dtype).removeprefix("torch."), kv_shape=dims,
            text=seq.text.text, text_emitted=seq.text.emitted,
            detok_offsets=(seq.text.prefix_offset, seq.text.read_offset),
        )

    def _stage(self, seq: _Seq, dims: tuple[int, ...]) -> StagedKv | None:
        """Gather the request's device KV into a region of the hand-off arena; None when it has no room."""
        nbytes = int(torch.Size(dims).numel()) * seq.kv.shape.dtype.itemsize
        if self._arena is None:
            self._arena = StagingArena(self.config.handoff_bytes, self.device)
        stale = self._staged.pop(seq.request.request_id, None)
        if stale is not None:  # staged before and never released (its importer was lost): this one replaces it
            self._arena.free(stale)
        offset = self._arena.alloc(nbytes)
        if offset is None:
            return None
        self._kv_store().stage(seq.kv, dims[3], staged_view(self._arena.ref, offset, seq.kv.shape.dtype, dims))
        self._staged[seq.request.request_id] = offset
        return StagedKv(self._arena.ref, offset, nbytes)

    def _imported(self, export: KvExport) -> _Seq:
        """A request from another engine, checked against this engine's model; KV not placed yet."""
        request = export.request
        rid, name = request.request_id, request.model
        if name not in self._models:
            raise EngineError(f"import_kv: request {rid!r} needs model {name!r}, which is not loaded in this engine "
                              f"(loaded: {sorted(self._models)})")
        model = self._models[name]
        shape = model.kv_shape
        output = tuple(request.output_token_ids)
        tokens = [*request.prompt_token_ids, *output]
        want = (shape.num_layers, 2, shape.num_kv_heads, export.num_tokens, shape.head_dim)
        dtype = str(shape.dtype).removeprefix("torch.")
        if tuple(export.kv_shape) != want or export.kv_dtype != dtype:
            raise EngineError(f"import_kv: request {rid!r}: KV of shape {tuple(export.kv_shape)} {export.kv_dtype} "
                              f"does not fit model {name!r} here ({want} {dtype})")
        if export.num_tokens != len(tokens) - 1 or not request.prompt_token_ids:
            raise EngineError(f"import_kv: request {rid!r}: KV of {export.num_tokens} tokens for "
                              f"{len(request.prompt_token_ids)} prompt + {len(output)} output tokens")
        if export.kv_bytes != export.num_tokens * shape.rows_per_block * shape.head_dim * shape.dtype.itemsize:
            raise EngineError(f"import_kv: request {rid!r}: {export.kv_bytes} KV bytes do not match its shape")
        text = OutputText(model.tokenizer, request.sampling.stop)
        text.ids, text.text, text.emitted = list(output), export.text, export.text_emitted
        text.prefix_offset, text.read_offset = export.detok_offsets
        return _Seq(request=request, model=model, tokens=tokens, num_prompt=len(request.prompt_token_ids),
                    seed=export.seed, text=text, kv=SeqKv(shape, on_device=False))

    def _count_weight_copy(self, nbytes: int) -> None:
        self.weight_bytes_h2d += nbytes
        self.num_weight_copies += 1

    def _admit(self, request: GenRequest) -> _Seq:
        model = self._models.require(request.model)
        rid, params = request.request_id, request.sampling
        self._resident(request.model, f"request {rid}")
        check_admissible(request)
        window = model.image.spec.sliding_window
        if window is not None and len(request.prompt_token_ids) + params.max_tokens > window:
            raise EngineError(f"request {rid}: {model.name!r} uses sliding-window attention ({window} tokens), "
                              "which this engine does not implement; keep prompt + max_tokens within it")
        return _Seq(request=request, model=model, tokens=[*request.prompt_token_ids, *request.output_token_ids],
                    num_prompt=len(request.prompt_token_ids),
                    seed=random_seed() if params.seed is None else params.seed,
                    text=OutputText(model.tokenizer, params.stop, request.output_token_ids), kv=SeqKv(model.kv_shape))

    def _runnable(self, request_id: str) -> _Seq:
        seq = self._seqs.require(request_id)
        self._resident(seq.model.name, f"request {request_id}")
        check_on_device(request_id, seq.kv.on_device)
        return seq

    def _resident(self, model: str, what: str) -> None:
        slots = self._ensure_buffer()
        check_resident(what, model, slots.resident, slots.active_model)

    def _decoder(self, model: _Model) -> Decoder:
        """The forward pass of the resident `model`, bound to where its weights are."""
        where = self._ensure_buffer().placement(model.name)
        decoder = self._slot_decoder(model, where.offset)
        decoder.bind(where.load)
        return decoder

    def _slot_decoder(self, model: _Model, offset: int) -> Decoder:
        """The forward pass of `model` as if its weights sat at `offset` of the model region (they need not
        be there yet)."""
        key = (model.name, offset, self.fused)
        if key not in self._decoders:
            slots = self._ensure_buffer()
            image = model.image
            shared_key = (image.spec, image.dtype, offset)
            if shared_key not in self._shared:
                self._shared[shared_key] = SharedTensors(image.spec, image.dtype, self.device)
            self._decoders[key] = Decoder(image.spec, image.views(slots.region[offset: offset + image.nbytes]),
                                          self._kv_store().view(model.kv_shape), fused=self.fused,
                                          shared=self._shared[shared_key],
                                          comm=None if self.rank is None else self.rank.comm)
        return self._decoders[key]

    @staticmethod
    def _sample(seqs: list[_Seq], logits: torch.Tensor) -> list[int]:
        return sample(logits, [s.request.sampling for s in seqs], [s.seed for s in seqs], [s.tokens for s in seqs],
                      [s.num_output for s in seqs])

    def _emit(self, seqs: list[_Seq], token_ids: list[int]) -> list[TokenOut]:
        """Append one token to each request, extend its text, and finish (and free) it when it stops."""
        out = []
        for seq, token_id in zip(seqs, token_ids):
            p = seq.request.sampling
            seq.tokens.append(token_id)
            stop_token = token_id in p.stop_token_ids or (not p.ignore_eos and token_id in seq.model.eos_ids)
            stop_hit = False if stop_token else seq.text.push(token_id)
            reason = finish_reason(token_id, seq.num_output, p, seq.model.eos_ids, stop_hit)
            out.append(TokenOut(seq.request.request_id, token_id, seq.text.take_delta(reason is not None),
                                reason is not None, reason))
            if reason is not None:
                self._finish(seq.request.request_id)
        return out

    def _finish(self, rid: str) -> None:
        """A request ended with this step's token: forget it and free its KV. The step launched ahead for the
        rest of its batch stays; one that holds this request too (it ended by a stop token or string, which
        the launch could not foresee) is dropped."""
        if self._ahead is not None and rid in self._ahead.key[0]:
            self._discard_ahead()
        self._forget(rid)


def _host_ids(step: _Launched) -> list[int]:
    """The step's token ids on the host, once its copy has landed."""
    if isinstance(step.host_ids, list):
        return step.host_ids
    wait_event(step.ready)
    return step.host_ids.tolist()


def _by_model(seqs: list[_Seq]) -> list[list[_Seq]]:
    """The requests grouped by model, models in order of first appearance (one group, usually)."""
    groups: dict[str, list[_Seq]] = {}
    for seq in seqs:
        groups.setdefault(seq.model.name, []).append(seq)
    return list(groups.values())


def _eos_ids(path: Path) -> set[int]:
    try:
        value = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {int(value)}
