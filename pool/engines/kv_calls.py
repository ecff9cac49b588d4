"""A torch engine's KV calls: between its device and host memory, out of the engine and into another.

`save`/`restore` move requests' KV blocks between the device and the host
tier (`KvStore`); `release` forgets requests wherever their KV is;
`export`/`import_` move requests between engines (`base.KvExport`): through
host memory, or, for a hand-off between engines on one GPU, staged in a
region of this engine's device memory (`handoff.StagingArena`) that the
importer copies from and this engine frees when it releases the request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from pool.engines.base import EngineError, KvCapacity, KvExport, StagedKv, Table, check_new, check_unique
from pool.engines.device import Streams
from pool.engines.handoff import StagingArena, staged_view
from pool.engines.kv import SlabPool
from pool.engines.kvstore import SeqKv, allocate_all, free_host, read_host, write_tokens
from pool.engines.residency import Residency
from pool.engines.sampling import OutputText
from pool.engines.step import Seq
from pool.engines.timings import StepTimings


class KvCalls:
    """The KV of one engine's requests (`seqs`) on the move; `handoff_bytes` of device memory for staging."""

    def __init__(self, seqs: Table[Seq], residency: Residency, host_kv: SlabPool, streams: Streams,
                 timings: StepTimings, handoff_bytes: int) -> None:
        self.seqs = seqs
        self.residency = residency
        self.host_kv = host_kv
        self.streams = streams
        self.timings = timings
        self.handoff_bytes = handoff_bytes
        self.arena: StagingArena | None = None  # made at the first staged export
        self._staged: dict[str, int] = {}  # request id -> offset of its staged KV in the arena, until released
        self._kv_report: tuple[Any, KvCapacity] | None = None  # capacity()'s answer for these models

    # ---- device <-> host --------------------------------------------------------------------------------------
    def save(self, request_ids: Sequence[str]) -> None:
        started, kv = time.perf_counter(), self.residency.kv_store()
        before = kv.bytes_d2h
        kv.save([self.seqs.require(rid).kv for rid in request_ids])
        self.timings.kv_call("save_kv", len(request_ids), kv.bytes_d2h - before, time.perf_counter() - started)

    def restore(self, request_ids: Sequence[str]) -> None:
        started, kv = time.perf_counter(), self.residency.kv_store()
        before = kv.bytes_h2d
        kv.restore([self.seqs.require(rid).kv for rid in request_ids])
        self.timings.kv_call("restore_kv", len(request_ids), kv.bytes_h2d - before, time.perf_counter() - started)

    def forget(self, rid: str) -> None:
        """Forget a request and free its KV, wherever it is (also KV staged for a hand-off); unknown: a no-op."""
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self._free_kv(seq.kv)
        offset = self._staged.pop(rid, None)
        if offset is not None and self.arena is not None:
            self.arena.free(offset)

    def _free_kv(self, kv: SeqKv) -> None:
        if self.residency.kv is not None:
            self.residency.kv.free(kv)
        else:  # imported and never run here: host blocks only, no device buffer needed
            free_host(self.host_kv, kv)

    # ---- out of the engine ---------------------------------------------------------------------------------------
    def export(self, request_ids: Sequence[str]) -> list[KvExport]:
        """Move requests out (see `KvExport`): KV read from host memory, or off the device (staged in device
        memory when the engine has a hand-off arena with room: `handoff_bytes`); then forget them."""
        check_unique("export_kv", request_ids)
        started = time.perf_counter()
        seqs = [self.seqs.require(rid) for rid in request_ids]
        exports = [self._export(seq) for seq in seqs]  # nothing changes until all are copied out
        waited, launched = 0.0, None
        if any(e.staged for e in exports):
            launched = time.perf_counter() - started
            # the gathers (on the compute stream) are complete before anyone reads the regions; not the whole
            # device: a weight prefetch in flight took this to 112 ms at p90 on the H200
            waited = self.streams.compute_done()
        for seq in seqs:
            del self.seqs[seq.request.request_id]
            self._free_kv(seq.kv)
        self._timing("export_kv", exports, started, waited, launched)
        return exports

    def _export(self, seq: Seq) -> KvExport:
        num_tokens = len(seq.tokens) - 1
        shape = seq.kv.shape
        dims = (shape.num_layers, 2, shape.num_kv_heads, num_tokens, shape.head_dim)
        kv: Any = self._stage(seq, dims) if seq.kv.on_device and self.handoff_bytes else None
        if kv is None:
            data = (self.residency.kv_store().read_device(seq.kv, num_tokens) if seq.kv.on_device
                    else read_host(self.host_kv, seq.kv, num_tokens))
            kv = data.reshape(-1).view(torch.uint8).numpy()
        return KvExport(
            request=replace(seq.request, prompt_token_ids=tuple(seq.tokens[: seq.num_prompt]),
                            output_token_ids=tuple(seq.tokens[seq.num_prompt :])),
            seed=seq.seed, num_tokens=num_tokens,
            kv=kv, kv_dtype=str(shape.dtype).removeprefix("torch."), kv_shape=dims,
            text=seq.text.text, text_emitted=seq.text.emitted,
            detok_offsets=(seq.text.prefix_offset, seq.text.read_offset),
        )

    def _stage(self, seq: Seq, dims: tuple[int, ...]) -> StagedKv | None:
        """Gather the request's device KV into a region of the hand-off arena; None when it has no room."""
        nbytes = int(torch.Size(dims).numel()) * seq.kv.shape.dtype.itemsize
        if self.arena is None:
            self.arena = StagingArena(self.handoff_bytes, self.residency.device)
        stale = self._staged.pop(seq.request.request_id, None)
        if stale is not None:  # staged before and never released (its importer was lost): this one replaces it
            self.arena.free(stale)
        offset = self.arena.alloc(nbytes)
        if offset is None:
            return None
        self.residency.kv_store().stage(seq.kv, dims[3], staged_view(self.arena.ref, offset, seq.kv.shape.dtype, dims))
        self._staged[seq.request.request_id] = offset
        return StagedKv(self.arena.ref, offset, nbytes)

    # ---- into the engine -------------------------------------------------------------------------------------------
    def import_(self, exports: Sequence[KvExport]) -> None:
        """Admit exported requests (all or none): KV from host memory into host blocks, as after `save_kv`;
        KV staged in device memory straight into device blocks, copied before this returns (the exporter may
        then free it: the caller releases the requests there)."""
        started, exports = time.perf_counter(), list(exports)
        check_new("import_kv", [e.request.request_id for e in exports], self.seqs)
        seqs = [self._imported(e) for e in exports]  # all checked before any block is taken
        staged = [(s, e) for s, e in zip(seqs, exports) if e.staged]
        hosted = [(s, e) for s, e in zip(seqs, exports) if not e.staged]
        counts = [s.kv.shape.blocks_for(e.num_tokens) for s, e in hosted]
        targets = allocate_all(self.host_kv, [s.kv for s, _ in hosted], counts)  # OutOfKvMemory: nothing taken
        waited, launched = 0.0, None
        if staged:
            try:
                self.residency.kv_store().admit_device([s.kv for s, _ in staged], [e.kv_tensor() for _, e in staged])
            except Exception:
                for (seq, _), blocks in zip(hosted, targets):
                    self.host_kv.free(seq.kv.shape, blocks)
                raise
            launched = time.perf_counter() - started
            waited = self.streams.compute_done()  # copied (on the compute stream): the exporter may reuse its regions
        for (seq, export), blocks in zip(hosted, targets):
            write_tokens(export.kv_tensor(), self.host_kv, seq.kv.shape, blocks)
            seq.kv.host_blocks = blocks
        for seq in seqs:
            self.seqs[seq.request.request_id] = seq
        self._timing("import_kv", exports, started, waited, launched)

    def _imported(self, export: KvExport) -> Seq:
        """A request from another engine, checked against this engine's model; KV not placed yet."""
        request = export.request
        rid, name = request.request_id, request.model
        models = self.residency.models
        if name not in models:
            raise EngineError(f"import_kv: request {rid!r} needs model {name!r}, which is not loaded in this engine "
                              f"(loaded: {sorted(models)})")
        model = models[name]
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
        return Seq(request=request, model=model, tokens=tokens, num_prompt=len(request.prompt_token_ids),
                   seed=export.seed, text=text, kv=SeqKv(shape, on_device=False))

    def _timing(self, method: str, exports: list[KvExport], started: float, waited: float,
                launched: float | None) -> None:
        """One KV call's timing (`waited`: of it for the compute stream, `launched`: of it before that wait);
        a call that moved staged KV is booked as `method(device)`."""
        name = f"{method}(device)" if any(e.staged for e in exports) else method
        self.timings.kv_call(name, len(exports), sum(e.kv_bytes for e in exports), time.perf_counter() - started,
                             waited, launched)

    # ---- what the device holds -------------------------------------------------------------------------------------
    def capacity(self, scratch_blocks: int) -> KvCapacity:
        """Tokens of each loaded model the device KV holds, after block and slab rounding and `scratch_blocks`
        kept back per shape, and the host KV store holds (makes the device buffer when it is not made yet: once
        every model is loaded)."""
        device, models = self.residency.kv_store().device, self.residency.models
        key = (tuple(models), scratch_blocks)
        if self._kv_report is None or self._kv_report[0] != key:
            shapes = [m.kv_shape for m in models.values()]
            self._kv_report = key, KvCapacity(
                tokens={m.name: device.usable_blocks(m.kv_shape, shapes, scratch_blocks) * m.kv_shape.block_size
                        for m in models.values()},
                block_tokens={m.name: m.kv_shape.block_size for m in models.values()},
                host_tokens={m.name: self.host_kv.usable_blocks(m.kv_shape, shapes) * m.kv_shape.block_size
                             for m in models.values()})
        return self._kv_report[1]

    def figures(self) -> dict[str, int]:
        return {"handoff_arena_bytes": self.arena.ref.nbytes if self.arena else 0,
                "handoff_staged_bytes": self.arena.used_bytes if self.arena else 0}

    def close(self) -> None:
        self.arena, self._staged, self._kv_report = None, {}, None
