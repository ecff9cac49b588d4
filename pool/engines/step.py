"""A torch engine's generation: admitting requests, prefill and decode steps, and the tokens they emit.

Each model's batch is one forward pass (several models may be resident and
stepped in one call). A finished request is forgotten at once (its KV freed).
Async decode (vLLM v1's async scheduling): once a greedy batch's step is
queued, the next step of the same batch is queued behind it, fed the sampled
ids on the device, before the host waits for this step's ids and emits them
(`decode_step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pool.engines.base import (EngineError, GenRequest, OutOfKvMemory, Table, TokenOut, check_admissible, check_new,
                               check_on_device, check_unique)
from pool.engines.device import Streams, to_device, wait_event
from pool.engines.kvstore import KvStore, SeqKv, decode_inputs, prefill_inputs
from pool.engines.residency import LoadedModel, Residency
from pool.engines.sampling import OutputText, finish_reason, random_seed, sample
from pool.engines.timings import StepTimings
from pool.engines.warmup import GraphSet


@dataclass(slots=True, eq=False)
class Seq:
    """A request in the engine: its tokens, sampler seed, output text and KV blocks."""

    request: GenRequest
    model: LoadedModel
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
class Launched:
    """One model's batch of a decode step, queued on the device; its token ids are on their way to the host."""

    seqs: list[Seq]
    device_ids: torch.Tensor | None  # [B] the greedy ids on the device (what the step after feeds); None: sampled
    host_ids: torch.Tensor | list[int]  # their host copy (lands at `ready`), or the sampled ids
    ready: Any  # CUDA event after the copy to the host; None on CPU
    forward: Any  # the forward timer (`StepTimings.forward_end`); None: untimed


@dataclass(slots=True)
class Ahead:
    """The decode step launched before the last one's tokens were emitted, for the same batch."""

    key: tuple  # (request ids, graphs on, fused): a decode_step with this key takes it
    steps: list[Launched]
    blocks_before: list[tuple[SeqKv, int]]  # device blocks of each request before it grew for this step


class Stepper:
    """Prefill and decode of one engine's requests (`seqs`), with the step launched ahead; `forget` frees a
    finished request (its KV, wherever it is)."""

    def __init__(self, seqs: Table[Seq], residency: Residency, graphs: GraphSet, streams: Streams,
                 timings: StepTimings, forget: Callable[[str], None], *, async_decode: bool,
                 pads_prefill: bool) -> None:
        self.seqs = seqs
        self.residency = residency
        self.graphs = graphs
        self.streams = streams
        self.device = residency.device
        self.timings = timings
        self._forget = forget
        self.async_decode = async_decode  # may be switched off later, as graphs.enabled
        self.pads_prefill = pads_prefill
        self._ahead: Ahead | None = None
        self.num_steps_ahead = self.num_steps_discarded = 0
        # a step launched ahead was discarded since the last prefill or decode call (both wait for the device):
        # the device runs it before the next call's work, inside that call's time if the call is a prefill
        self.discarded = False

    # ---- admission --------------------------------------------------------------------------------------
    def admit(self, request: GenRequest) -> Seq:
        model = self.residency.models.require(request.model)
        rid, params = request.request_id, request.sampling
        self.residency.require_resident(request.model, f"request {rid}")
        check_admissible(request)
        window = model.image.spec.sliding_window
        if window is not None and len(request.prompt_token_ids) + params.max_tokens > window:
            raise EngineError(f"request {rid}: {model.name!r} uses sliding-window attention ({window} tokens), "
                              "which this engine does not implement; keep prompt + max_tokens within it")
        return Seq(request=request, model=model, tokens=[*request.prompt_token_ids, *request.output_token_ids],
                   num_prompt=len(request.prompt_token_ids),
                   seed=random_seed() if params.seed is None else params.seed,
                   text=OutputText(model.tokenizer, params.stop, request.output_token_ids), kv=SeqKv(model.kv_shape))

    def runnable(self, request_id: str) -> Seq:
        seq = self.seqs.require(request_id)
        self.residency.require_resident(seq.model.name, f"request {request_id}")
        check_on_device(request_id, seq.kv.on_device)
        return seq

    # ---- prefill ----------------------------------------------------------------------------------------------
    def prefill(self, requests: Sequence[GenRequest]) -> list[TokenOut]:
        """Admit the requests (of resident models) and prefill each model's prompts; tokens in request order."""
        started = time.perf_counter()
        check_new("prefill", [r.request_id for r in requests], self.seqs)
        seqs = [self.admit(r) for r in requests]
        if not seqs:
            return []
        kv = self.residency.kv_store()
        kv.grow([s.kv for s in seqs], [len(s.tokens) for s in seqs])
        self.seqs.update((s.request.request_id, s) for s in seqs)
        outs: dict[str, TokenOut] = {}
        for group in _by_model(seqs):
            pad_row = kv.scratch(group[0].model.kv_shape) if self.pads_prefill else None
            inputs = prefill_inputs([s.tokens for s in group], [s.kv for s in group], self.device, pad_row)
            logits = self.residency.decoder(group[0].model).prefill(inputs)
            outs.update((o.request_id, o) for o in self.emit(group, self.sample(group, logits)))
            self.timings.prefill(group[0].model.name, sum(len(s.tokens) for s in group) - len(group), len(group),
                                 time.perf_counter() - started, self.discarded)
            self.discarded = False  # (a second model's prefill in the call comes after the first's)
            started = time.perf_counter()
        return [outs[s.request.request_id] for s in seqs]

    # ---- decode -----------------------------------------------------------------------------------------------
    def decode_step(self, request_ids: Sequence[str]) -> list[TokenOut]:
        """One token for each request (of resident models, KV on the device): one forward per model's batch.

        Async decode: once this step is queued, the next step of the same batch is queued behind it, fed the
        sampled ids on the device, before the host waits for this step's ids and emits them, so the device
        computes it while the host streams tokens and is called again. The next call for the same request ids
        takes that step; any other call discards it (`discard_ahead`): it wrote only KV past the requests'
        lengths, with the values the next step writes again.
        """
        entered_at = time.perf_counter()
        key = self._batch_key(request_ids)
        if self._ahead is not None and self._ahead.key != key:
            self.discard_ahead()
        check_unique("decode_step", request_ids)
        seqs = [self.runnable(rid) for rid in request_ids]
        if not seqs:
            return []
        kv, kvs = self.residency.kv_store(), [s.kv for s in seqs]
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
            outs.update((o.request_id, o) for o in self.emit(step.seqs, ids))
        self.timings.decode(tuple(request_ids), entered_at, forward, ahead is not None,
                            "+".join(sorted({s.model.name for s in seqs})))
        self.discarded = False
        return [outs[rid] for rid in request_ids]

    def _batch_key(self, request_ids: Sequence[str]) -> tuple:
        """What a step launched ahead is for: a decode_step with this key takes it (`Ahead.key`)."""
        return tuple(request_ids), self.graphs.enabled, self.residency.fused

    def _ahead_rows(self, seqs: list[Seq]) -> list[Seq]:
        """The requests whose next step can be launched now: greedy rows only (sampling reads the host's
        history), less any that ends with this step's token by its length - the batch the next call brings
        then, in this order (the scheduler goes on with the rest of the turn: on the H200 at 22 req/s, 634 of
        the decode instance's 736 turns began so); none where a row samples."""
        if not self.async_decode or not all(s.greedy for s in seqs):
            return []
        return [s for s in seqs if len(s.tokens) + 1 < s.max_len]

    def _launch_ahead(self, kv: KvStore, going: list[Seq], steps: list[Launched]) -> None:
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
        self._ahead = Ahead(self._batch_key([s.request.request_id for s in going]), launched, before)
        self.num_steps_ahead += 1

    def discard_ahead(self) -> None:
        """Drop the step launched ahead (every engine call but the decode_step that takes it comes here first)
        and give back the blocks it grew. Device work queued later on the compute stream, or on a copy stream
        (they wait for queued compute), comes after its KV writes, so the blocks are free for reuse now."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        self.discarded = True
        self.num_steps_discarded += 1
        kv = self.residency.kv
        for seq_kv, num_blocks in ahead.blocks_before:
            if seq_kv.on_device and kv is not None:
                kv.trim(seq_kv, num_blocks)

    def _launch(self, kv: KvStore, seqs: list[Seq], fed: torch.Tensor | None = None) -> Launched:
        """Queue one decode step of one model's requests (replayed from a CUDA graph when one was captured
        for it) and its greedy ids' copy to the host. `fed`: the ids (on the device) of the step queued just
        before, which the requests' token lists do not hold yet; the step then runs one position further."""
        kvs = [s.kv for s in seqs]
        model, batch = seqs[0].model, len(seqs)
        decoder = self.residency.decoder(model)
        ahead = 0 if fed is None else 1
        last = [0] * batch if fed is not None else [s.tokens[-1] for s in seqs]
        positions = [len(s.tokens) - 1 + ahead for s in seqs]
        max_blocks = max(len(k.blocks) for k in kvs)
        picked = self.graphs.pick(batch, max_blocks)
        logits, forward = None, None
        if picked is not None:
            padded, width = picked
            inputs = decode_inputs(last, kvs, positions, self.device, padded, width, kv.scratch(model.kv_shape))
            if fed is not None:
                inputs.row("token_ids")[:batch].copy_(fed)
            timer = self.timings.forward_begin()
            logits = self.graphs.replay(model, decoder, padded, width, inputs)
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
            return Launched(seqs, None, self.sample(seqs, logits), None, forward)
        device_ids = logits.argmax(dim=-1)  # greedy, as `sample` picks, left on the device for the next step
        host_ids = device_ids.to("cpu", non_blocking=True)  # into pinned memory on CUDA
        return Launched(seqs, device_ids, host_ids, self.streams.record(self.streams.compute), forward)

    # ---- tokens -----------------------------------------------------------------------------------------------
    @staticmethod
    def sample(seqs: list[Seq], logits: torch.Tensor) -> list[int]:
        return sample(logits, [s.request.sampling for s in seqs], [s.seed for s in seqs], [s.tokens for s in seqs],
                      [s.num_output for s in seqs])

    def emit(self, seqs: list[Seq], token_ids: list[int]) -> list[TokenOut]:
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
            self.discard_ahead()
        self._forget(rid)


def _host_ids(step: Launched) -> list[int]:
    """The step's token ids on the host, once its copy has landed."""
    if isinstance(step.host_ids, list):
        return step.host_ids
    wait_event(step.ready)
    return step.host_ids.tolist()


def _by_model(seqs: list[Seq]) -> list[list[Seq]]:
    """The requests grouped by model, models in order of first appearance (one group, usually)."""
    groups: dict[str, list[Seq]] = {}
    for seq in seqs:
        groups.setdefault(seq.model.name, []).append(seq)
    return list(groups.values())
