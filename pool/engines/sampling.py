"""Picking tokens and deciding when a request stops.

Sampling is a pure function of (logits, params, seed, output index): the
generator of token k of a seeded request is seeded from (seed, k), so a
request resumed from its produced tokens after losing its KV continues with
the same tokens it would have drawn, whatever batch it lands in.

`OutputText` detokenises incrementally (the prefix/read-offset method of
HF's TextStreamer and vLLM) and holds back any tail that could still grow
into a stop string, so a streamed delta never contains part of one.
Stop strings are matched by `stops.StopStrings`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from pool.engines.base import FinishReason, SamplingParams
from pool.engines.stops import StopStrings

_SEED_STRIDE = 1_000_003


def random_seed() -> int:
    return int.from_bytes(os.urandom(7), "little")


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
           histories: Sequence[Sequence[int]], output_counts: Sequence[int]) -> list[int]:
    """One token per row of `logits` ([B, vocab], float32)."""
    if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
        return logits.argmax(dim=-1).tolist()  # one sync for the common case
    return [
        _sample_row(logits[i], p, seeds[i], histories[i], output_counts[i]) for i, p in enumerate(params)
    ]


def _sample_row(row: torch.Tensor, p: SamplingParams, seed: int, history: Sequence[int], index: int) -> int:
    if p.repetition_penalty != 1.0 and history:
        ids = torch.tensor(sorted(set(history)), device=row.device)
        seen = row[ids]
        row = row.clone()
        row[ids] = torch.where(seen < 0, seen * p.repetition_penalty, seen / p.repetition_penalty)
    if p.greedy:
        return int(row.argmax())
    row = row / p.temperature
    if p.top_k and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        row = row.clone()
        row[order[drop]] = float("-inf")
    gen = torch.Generator(device=row.device).manual_seed((seed * _SEED_STRIDE + index) % (2**63))
    return int(torch.multinomial(row.softmax(-1), 1, generator=gen))


class OutputText:
    """The text of one request's output, grown token by token."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], produced: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust decode, without transformers' per-call Python (3x the Rust call: it ran twice
        # per token per request, the engine's largest host cost per decode step at batch 32); same text unless
        # the tokenizer cleans up spaces, which only the wrapper does.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._rust = backend.decode if backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False) else None
        self.stop = StopStrings(stop)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.prefix_offset = self.read_offset = 0
        self.stopped_at: int | None = None
        # A resumed request (its instance was lost) replays the tokens already streamed, one push and one
        # take_delta each as the engine did, so text, emitted length and offsets are exactly the uninterrupted
        # run's: decoding them at once would count text held back for an unfinished UTF-8 character as sent.
        # (A token that stopped the request is never among them: a stopped request does not resume.)
        for token_id in produced:
            self.push(token_id)
            self.take_delta(False)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids or self.tokenizer is None:  # benchmark models have no tokenizer: ids only
            return ""
        if self._rust is not None:
            return self._rust(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> bool:
        """Add a token's text; True when a stop string has appeared."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            old_len = len(self.text)
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return self._find_stop(old_len)
        return False

    def _find_stop(self, old_len: int) -> bool:
        if self.stopped_at is None and self.stop.longest:
            self.stopped_at = self.stop.find(self.text, old_len)
        return self.stopped_at is not None

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; unless finished, minus a tail that may begin a stop string."""
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        if not finished:
            end -= self.stop.held_back(self.text, end)
        delta = self.text[self.emitted : max(end, self.emitted)]
        self.emitted = max(end, self.emitted)
        return delta


def finish_reason(token_id: int, num_output: int, params: SamplingParams, eos_ids: frozenset[int],
                  stop_hit: bool) -> FinishReason | None:
    """Why a request ends on this token, if it does."""
    if stop_hit or token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_ids):
        return "stop"
    if num_output >= params.max_tokens:
        return "length"
    return None
