"""One model's vLLM engine and the requests in it: which run in a step, which are held, and how they resume.

A request is *live* while vLLM has it unfinished, and *held* otherwise. A
step runs exactly the requests it names: every other live request is held
first (aborted in vLLM, whose prefix cache keeps its full KV blocks), and a
held request that is named again is re-added with prompt + output as its
prompt, so the resume re-reads cached blocks and recomputes only the rest.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pool.engines.base import EngineError, GenRequest, OutOfKvMemory, TokenOut
from pool.engines.sampling import OutputText, finish_reason
from pool.engines.vllm_engine.core import ChildCore, StepOut, VllmCore

logger = logging.getLogger(__name__)

MAX_IDLE_STEPS = 32  # steps in a row without a token for a waiting request: its KV does not fit
_SEED_STRIDE = 1_000_003


@dataclass(slots=True, eq=False)
class Seq:
    """One request as this backend tracks it."""

    request: GenRequest
    output: list[int]  # every produced token, those given at admission included
    text: OutputText
    seed: int | None  # None: greedy
    vllm_id: str | None = None  # the vLLM request now carrying it; None while held
    num_adds: int = 0
    resuming: bool = False  # re-added after a hold, no token yet
    finished: bool = False


@dataclass(slots=True)
class Counters:
    """What holds, resumes and switches cost (reported in `EngineStats.extra`)."""

    num_holds: int = 0
    num_resumes: int = 0
    resume_tokens: int = 0  # prompt + output tokens re-added by resumes
    resume_cached_tokens: int = 0  # of those, served by the prefix cache
    resume_step_s: float = 0.0  # time of the steps that carried a resume
    sleep_s: float = 0.0
    wake_s: float = 0.0
    engine_start_s: float = 0.0
    num_exports: int = 0
    num_imports: int = 0
    import_dropped_kv_tokens: int = 0  # imported KV not used (vLLM recomputes it on resume)


class ModelEngine:
    """One model's vLLM engine (`VllmCore` here or `ChildCore` in a child process) and its live requests."""

    def __init__(self, name: str, path: Path, core: VllmCore | ChildCore, tokenizer: Any, eos_ids: frozenset[int],
                 counters: Counters) -> None:
        self.name, self.path, self.core, self.info = name, path, core, core.info
        self.tokenizer, self.eos_ids, self.counters = tokenizer, eos_ids, counters
        self.live: dict[str, Seq] = {}  # vllm_id -> request, unfinished in vLLM
        self.awake = True

    def run(self, seqs: list[Seq]) -> list[TokenOut]:
        """Run exactly `seqs` until each has produced one new token (normally one engine step)."""
        wanted = {id(s) for s in seqs}
        self.hold([s for s in self.live.values() if id(s) not in wanted])
        resumed = self._add([s for s in seqs if s.vllm_id is None])
        outs: dict[int, TokenOut] = {}
        idle, cached, resume_s = 0, 0, 0.0
        while len(outs) < len(seqs):
            start = time.perf_counter()
            results = self.core.step()
            step_s = time.perf_counter() - start
            firsts = [self._take(r, outs) for r in results]
            if any(first is not None for first in firsts):
                idle = 0
            else:
                idle += 1
            if any(firsts):
                resume_s += step_s
                cached += sum(r.num_cached_tokens for r, first in zip(results, firsts) if first)
            if len(outs) < len(seqs):  # those with their token must not advance in the next step
                self.hold([s for s in seqs if id(s) in outs and not s.finished])
            if idle > MAX_IDLE_STEPS:
                raise OutOfKvMemory(f"{self.name}: {len(seqs) - len(outs)} of {len(seqs)} requests got no token in "
                                    f"{idle} engine steps; the KV cache ({self.info.kv_cache_bytes} bytes) is too "
                                    "small for this batch")
        if resumed:
            self.counters.resume_cached_tokens += cached
            self.counters.resume_step_s += resume_s
            logger.debug("%s: resumed %d requests, %d tokens re-added, %d from the prefix cache, steps %.2f ms",
                         self.name, len(resumed), sum(resumed), cached, resume_s * 1e3)
        return [outs[id(s)] for s in seqs]

    def hold(self, seqs: list[Seq]) -> None:
        """Take the requests out of vLLM; they resume from prompt + output when run again."""
        ids = [s.vllm_id for s in seqs if s.vllm_id is not None]
        if not ids:
            return
        for vllm_id in ids:
            self.live.pop(vllm_id).vllm_id = None
        self.core.abort(ids)
        self.counters.num_holds += len(ids)
        log = logger.debug if self.counters.num_holds > len(ids) else logger.info
        log("%s: held %d requests: aborted in vLLM, its prefix cache keeps their full KV blocks; they resume "
            "from prompt + output when a step names them again", self.name, len(ids))

    def forget(self, seq: Seq) -> None:
        if seq.vllm_id is not None:
            self.live.pop(seq.vllm_id, None)
            self.core.abort([seq.vllm_id])
            seq.vllm_id = None

    def sleep(self) -> None:
        """Level-1 sleep (CUDA): hold every live request first, since sleep discards the KV cache."""
        if self.awake:
            self.hold(list(self.live.values()))
            self.counters.sleep_s += self.core.sleep()
            self.awake = False

    def wake(self) -> None:
        if not self.awake:
            self.counters.wake_s += self.core.wake_up()
            self.awake = True

    def _add(self, seqs: list[Seq]) -> list[int]:
        """Hand the requests to vLLM with prompt + output as the prompt; return the lengths of the resumed ones."""
        items, resumed = [], []
        for seq in seqs:
            r, p = seq.request, seq.request.sampling
            seq.vllm_id = f"{r.request_id}@{seq.num_adds}"
            seq.num_adds += 1
            seq.resuming = seq.num_adds > 1
            n = len(seq.output)
            # A resumed sampled request restarts vLLM's generator: derive its seed from (seed, tokens so far).
            seed = None if seq.seed is None else (seq.seed if n == 0 else (seq.seed * _SEED_STRIDE + n) % 2**63)
            params = dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seed,
                          max_tokens=p.max_tokens - n, stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
                          repetition_penalty=p.repetition_penalty)
            items.append((seq.vllm_id, [*r.prompt_token_ids, *seq.output], params))
            self.live[seq.vllm_id] = seq
            if seq.resuming:
                resumed.append(len(items[-1][1]))
        if items:
            self.core.add(items)
        self.counters.num_resumes += len(resumed)
        self.counters.resume_tokens += sum(resumed)
        return resumed

    def _take(self, result: StepOut, outs: dict[int, TokenOut]) -> bool | None:
        """Take one vLLM output: None without a token, else whether it is a resumed request's first token."""
        seq = self.live.get(result.vllm_id)
        if seq is None:
            return None
        if not result.token_ids:  # vLLM ended it without a token (an abort of its own): leave it held
            if result.finished:
                self.live.pop(result.vllm_id)
                seq.vllm_id = None
            return None
        if len(result.token_ids) != 1 or id(seq) in outs:
            raise EngineError(f"{self.name}: request {seq.request.request_id} got {len(result.token_ids)} tokens in "
                              "one step (speculative decoding is not supported)")
        first, seq.resuming = seq.resuming, False
        outs[id(seq)] = self._emit(seq, result)
        return first

    def _emit(self, seq: Seq, result: StepOut) -> TokenOut:
        token_id = result.token_ids[0]
        p = seq.request.sampling
        seq.output.append(token_id)
        stop_token = token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_ids)
        stop_hit = False if stop_token else seq.text.push(token_id)
        reason = finish_reason(token_id, len(seq.output), p, self.eos_ids, stop_hit)
        if reason is None and result.finished:  # a limit of vLLM's own (e.g. max_model_len)
            reason = "length" if result.finish_reason == "length" else "stop"
        if result.finished:
            self.live.pop(result.vllm_id, None)
            seq.vllm_id = None
        if reason is not None:
            seq.finished = True
            self.forget(seq)  # a stop string: vLLM does not know it stopped
        return TokenOut(seq.request.request_id, token_id, seq.text.take_delta(reason is not None), reason is not None,
                        reason)
