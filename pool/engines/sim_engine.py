"""The `sim` engine: the Engine protocol with tokens timed by a cost model and placeholder text.

For load tests and dry runs without hardware (`modelpool serve --engine sim`):
every call sleeps for what the cost model predicts (prefill, decode step,
switch, KV move; scaled by `time_scale`, 0 = no sleeping) and produces
tokens whose text is visibly fake - the first token of every request is
`[sim]`, the rest cycle through `PLACEHOLDER_WORDS`. It keeps the same
bookkeeping as a real engine (its models' slots by the instance model of
`scheduler.instance`, as the simulator's executor keeps them; each request's KV
on the device or in host memory, bytes moved), so the controller and the
scheduler cannot tell the difference; no KV bytes exist, an export carries
only token counts. It is never chosen unless asked for.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pool.engines.base import (EngineStats, FinishReason, GenRequest, KvCapacity, KvExport, OutOfKvMemory, Table,
                               TokenOut, check_admissible, check_new, check_on_device, check_resident, check_unique)
from pool.engines.stops import StopStrings
from scheduler import ModelSlots, instance

SIM_LABEL = "[sim]"
PLACEHOLDER_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")
_FIRST_WORD_ID = 16  # token ids: 3 = the label, 16.. = the words; 0..2 specials of the placeholder tokenizer


@dataclass(slots=True)
class _SimModel:
    name: str
    path: Path | None
    kv_bytes_per_token: int
    tokenizer: Any = None


@dataclass(slots=True, eq=False)
class _SimSeq:
    request: GenRequest
    num_prompt: int
    num_output: int
    text: str
    on_device: bool = True
    stops: StopStrings = field(default_factory=lambda: StopStrings(()))

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + self.num_output


class SimEngine:
    """Implements `pool.engines.base.Engine` without weights: `costs` (a scheduler CostModel) sets the pace."""

    timings = None  # it keeps none: its time is the cost model's

    def __init__(self, costs: Any, *, kv_bytes: int = 64 << 20, time_scale: float = 1.0,
                 kv_bytes_per_token: Mapping[str, int] | None = None) -> None:
        if time_scale < 0:
            raise ValueError(f"SimEngine.time_scale = {time_scale!r} must be >= 0")
        self.costs = costs
        self.kv_bytes = int(kv_bytes)
        self.time_scale = float(time_scale)
        self._kv_per_token = dict(kv_bytes_per_token or {})
        self._models: Table[_SimModel] = Table.of_models()
        self._seqs: Table[_SimSeq] = Table.of_requests()
        self.slots = ModelSlots()  # spare_ready_at in time.monotonic() seconds
        self.num_switches = self.num_weight_copies = 0
        self.switch_s = 0.0
        self.bytes_h2d = self.bytes_d2h = 0

    # ---- models --------------------------------------------------------------------------
    def load(self, model: str, path: Path | None = None) -> None:
        if model in self._models:
            return
        folder = Path(path) if path is not None and str(path) else None
        per_token = self._kv_per_token.get(model)
        if per_token is None:
            per_token = _kv_bytes_per_token(folder) if folder is not None else 0
        self._models[model] = _SimModel(model, folder, per_token)

    def models(self) -> list[str]:
        return list(self._models)

    def tokenizer(self, model: str) -> Any:
        """The folder's tokenizer when it has one (realistic prompt lengths), else `PlaceholderTokenizer`."""
        entry = self._models.require(model)
        if entry.tokenizer is None:
            entry.tokenizer = load_tokenizer_or_placeholder(entry.path)
        return entry.tokenizer

    @property
    def active(self) -> str | None:
        return self.slots.active

    def activate(self, model: str, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        """Make `model` active (`evict=False`: resident beside the others); returns the (cost-model) seconds."""
        self._models.require(model)
        if keep is None and self.slots.active == model and (not evict or self.slots.resident == {model}):
            return 0.0
        copy, wait_s = self.slots.switch(model, time.monotonic(), evict, keep)
        if copy:
            seconds = self.costs.switch_s(model)
            self._sleep(seconds)
            self.num_weight_copies += 1
        else:  # resident, or in the spare slot: what is left of the prefetch's copy
            if wait_s > 0:
                time.sleep(wait_s)
            seconds = wait_s / self.time_scale if self.time_scale else 0.0
        self.num_switches += 1
        self.switch_s += seconds
        return seconds

    def prefetch(self, model: str, keep: tuple[str, ...] | None = None) -> None:
        """The copy lands "in the background", `switch_s` (scaled) from now."""
        self._models.require(model)
        if self.slots.prefetch(model, time.monotonic() + self.costs.switch_s(model) * self.time_scale, keep):
            self.num_weight_copies += 1

    def deactivate(self, model: str) -> None:
        self.slots.deactivate(model)

    # ---- generation ------------------------------------------------------------------------
    def prefill(self, requests: Sequence[GenRequest]) -> list[TokenOut]:
        if not requests:
            return []
        check_new("prefill", [r.request_id for r in requests], self._seqs)
        seqs = [self._admit(r) for r in requests]
        self._need_device_kv(sum(self._kv_of(s, extra=1) for s in seqs))
        self._sleep(instance.prefill_s(self.costs, [(s.request.model, s.num_tokens) for s in seqs]))
        self._seqs.update((s.request.request_id, s) for s in seqs)
        return [self._emit(s) for s in seqs]

    def decode_step(self, request_ids: Sequence[str]) -> list[TokenOut]:
        check_unique("decode_step", request_ids)
        seqs = [self._runnable(rid) for rid in request_ids]
        if not seqs:
            return []
        self._need_device_kv(sum(self._per_token(s) for s in seqs))
        self._sleep(instance.decode_turn_s(self.costs, [(s.request.model, s.num_tokens) for s in seqs]))
        return [self._emit(s) for s in seqs]

    # ---- KV movement -----------------------------------------------------------------------
    def save_kv(self, request_ids: Sequence[str]) -> None:
        self._move(request_ids, to_device=False)

    def restore_kv(self, request_ids: Sequence[str]) -> None:
        self._move(request_ids, to_device=True)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._seqs.pop(rid, None)

    def export_kv(self, request_ids: Sequence[str]) -> list[KvExport]:
        import numpy as np

        check_unique("export_kv", request_ids)
        seqs = [self._seqs.require(rid) for rid in request_ids]
        on_device = [(s.request.model, s.num_tokens) for s in seqs if s.on_device]
        if on_device:  # read off the device: a move to the host, as save_kv
            self._sleep(instance.kv_move_s(self.costs, on_device))
        out = []
        for seq in seqs:
            req = seq.request
            produced = tuple(_word_id(k) for k in range(seq.num_output))
            request = GenRequest(req.request_id, req.model, tuple(req.prompt_token_ids), req.sampling, produced)
            # no KV bytes exist: the export carries counts only; the move is timed on import
            out.append(KvExport(request=request, seed=0, num_tokens=seq.num_tokens - 1, kv=np.zeros(0, np.uint8),
                                kv_dtype="sim", kv_shape=(0,), text=seq.text, text_emitted=len(seq.text)))
        for seq in seqs:
            del self._seqs[seq.request.request_id]
        return out

    def import_kv(self, exports: Sequence[KvExport]) -> None:
        check_new("import_kv", [e.request.request_id for e in exports], self._seqs)
        for export in exports:
            self._models.require(export.request.model)
        for export in exports:
            req = export.request
            num_output = len(req.output_token_ids)
            seq = _SimSeq(req, len(req.prompt_token_ids), num_output, export.text, on_device=False,
                          stops=StopStrings(req.sampling.stop))
            self._sleep(self.costs.kv_move_s(req.model, export.num_tokens))  # the host-to-host hop
            self._seqs[req.request_id] = seq

    def kv_capacity(self) -> KvCapacity:
        """Tokens of each model `kv_bytes` holds: KV is counted by the token, no blocks (a model of unknown
        size, 0 bytes a token, is capped at its bytes as if a token took one)."""
        return KvCapacity(tokens={m.name: self.kv_bytes // max(1, m.kv_bytes_per_token) for m in self._models.values()},
                          block_tokens={name: 1 for name in self._models})

    def warm_up(self, max_tokens: int | None = None) -> int:
        return 0  # nothing to capture

    def close(self) -> None:
        """Nothing to free: it holds no device memory."""

    def stats(self) -> EngineStats:
        device = sum(self._kv_of(s) for s in self._seqs.values() if s.on_device)
        host = sum(self._kv_of(s) for s in self._seqs.values() if not s.on_device)
        return EngineStats(device="sim", kv_device_bytes=self.kv_bytes, kv_device_used_bytes=device,
                           kv_capacity=self.kv_capacity(),
                           kv_host_bytes=host, kv_host_used_bytes=host, loaded_models=tuple(self._models),
                           active_model=self.slots.active, prefetched_model=self.slots.spare,
                           num_requests=len(self._seqs), bytes_h2d=self.bytes_h2d, bytes_d2h=self.bytes_d2h,
                           num_switches=self.num_switches, switch_s=self.switch_s,
                           num_weight_copies=self.num_weight_copies,
                           resident_models=tuple(sorted(self.slots.resident)),
                           extra={"engine": "sim", "time_scale": self.time_scale})

    # ---- internals ---------------------------------------------------------------------------
    def _sleep(self, seconds: float) -> None:
        if self.time_scale and seconds > 0:
            time.sleep(seconds * self.time_scale)

    def _per_token(self, seq: _SimSeq) -> int:
        return self._models[seq.request.model].kv_bytes_per_token

    def _kv_of(self, seq: _SimSeq, extra: int = 0) -> int:
        return self._per_token(seq) * (seq.num_tokens + extra)

    def _need_device_kv(self, more: int) -> None:
        used = sum(self._kv_of(s) for s in self._seqs.values() if s.on_device)
        if used + more > self.kv_bytes:
            raise OutOfKvMemory(f"sim engine: {used + more} bytes of device KV needed, {self.kv_bytes} exist")

    def _resident(self, model: str, what: str) -> None:
        check_resident(what, model, self.slots.resident, self.slots.active)

    def _admit(self, request: GenRequest) -> _SimSeq:
        self._models.require(request.model)
        self._resident(request.model, f"request {request.request_id}")
        check_admissible(request)
        produced = len(request.output_token_ids)
        text = "".join(_word_text(k) for k in range(produced))
        return _SimSeq(request, len(request.prompt_token_ids), produced, text, stops=StopStrings(request.sampling.stop))

    def _runnable(self, request_id: str) -> _SimSeq:
        seq = self._seqs.require(request_id)
        self._resident(seq.request.model, f"request {request_id}")
        check_on_device(request_id, seq.on_device)
        return seq

    def _move(self, request_ids: Sequence[str], *, to_device: bool) -> None:
        seqs = [self._seqs.require(rid) for rid in request_ids]
        moving = [s for s in seqs if s.on_device != to_device]
        if to_device:
            self._need_device_kv(sum(self._kv_of(s) for s in moving))
        nbytes = sum(self._kv_of(s) for s in moving)
        self._sleep(instance.kv_move_s(self.costs, [(s.request.model, s.num_tokens) for s in moving]))  # one move
        for seq in moving:
            seq.on_device = to_device
        if to_device:
            self.bytes_h2d += nbytes
        else:
            self.bytes_d2h += nbytes

    def _emit(self, seq: _SimSeq) -> TokenOut:
        index = seq.num_output
        seq.num_output += 1
        before = len(seq.text)
        seq.text += _word_text(index)
        params = seq.request.sampling
        reason: FinishReason | None = None
        at = seq.stops.find(seq.text, before) if seq.stops.longest else None
        if at is not None:
            seq.text, reason = seq.text[:at], "stop"
        if reason is None and seq.num_output >= params.max_tokens:
            reason = "length"
        out = TokenOut(seq.request.request_id, _word_id(index), seq.text[before:], reason is not None, reason)
        if reason is not None:
            self.release([seq.request.request_id])
        return out


def _word_id(index: int) -> int:
    return 3 if index == 0 else _FIRST_WORD_ID + (index - 1) % len(PLACEHOLDER_WORDS)


def _word_text(index: int) -> str:
    return SIM_LABEL if index == 0 else " " + PLACEHOLDER_WORDS[(index - 1) % len(PLACEHOLDER_WORDS)]


def _kv_bytes_per_token(folder: Path) -> int:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    from scheduler.fleet import Arch, arch_from_hf_config

    return Arch.model_validate(arch_from_hf_config(cfg)).kv_bytes_per_token


# ---- tokenizers ---------------------------------------------------------------------------------
def load_tokenizer_or_placeholder(folder: Path | None) -> Any:
    """The Hugging Face tokenizer in `folder`, or `PlaceholderTokenizer` when there is none."""
    if folder is not None and folder.is_dir() and any((folder / f).exists()
                                                      for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    return PlaceholderTokenizer()


class PlaceholderTokenizer:
    """Stands in for a model that has no tokenizer files (a catalogue architecture in a dry run).

    Words and punctuation become ids by a stable hash, about as many tokens as
    a BPE tokenizer gives for English; decoding gives placeholder words. The
    chat template is ChatML.
    """

    vocab_size = 32000
    eos_token_id = 2
    eos_token = "<|im_end|>"
    bos_token_id = None
    chat_template = "chatml (placeholder)"
    is_placeholder = True

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        import re

        return [3 + zlib.crc32(piece.encode()) % (self.vocab_size - 3) for piece in re.findall(r"\w+|[^\w\s]", text)]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(_word_text(k) for k in range(len(ids)))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> Any:
        text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text
