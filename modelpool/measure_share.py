"""How two instances on one device slow each other: the share microbenchmark of `modelpool calibrate`.

serve places a prefill and a decode instance on a GPU, each in an engine process of its own (clients of a
private MPS daemon there, pool.mps). Such processes, each a TorchEngine of one shape on random weights, one
thread each as serve's engine processes run, are timed here - a decoding and a prefilling one per shape given
(calibrate gives the smallest and the largest): each decoder's steps alone, each prefiller's prompts alone, then
every decoder beside every prefiller, one pair at a time - the decoder stepping without pause while the
prefiller runs its prompts back to back - at a long and a short prompt length. A prefill's time beside the
decoder over its time alone, and a decode step's beside the prefiller over its time alone, are the pair's
slowdowns: the profile's share grid (sims.gpu_share.ShareTable), and for the largest shape beside itself the
terms `share_prefill_slowdown` and `share_decode_slowdown`. Under MPS the two differ a lot (a prefill's GEMMs
take the SMs from the decode steps far more than the other way round; a large model's and a long prompt's
more than a small one's), time-sliced they are near 2, on a CPU with a core each near 1. Then decode beside
decode, as a prefill instance runs a hand-off's first decode steps while the decode instance beside it decodes:
each prefilling process decodes a batch of its own (its steps timed alone first), and every decoder steps beside
every such second decoder, both without pause - each one's steps over its steps alone is its slowdown beside the
other's decode steps (the profile's `decode_pairs`, sims.gpu_share.DecodeShareTable). Decode steps, alone and
beside, run as a served decode instance runs them: back to back with no sync between them (`_Bench.steps`).
Step and prefill intervals come from time.monotonic (one clock for every process of the machine).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.fleet import Arch
from sims.profiles.measurements import DecodeSharePoints, SharePoints

SPIN_STEPS = 400  # decode steps the decoder runs on one batch before it takes a fresh one (its KV headroom)


@dataclass(frozen=True)
class ShareSetup:
    """What the two processes run: one shape, the prompt lengths for the prefiller (`prefill_tokens`, and
    `short_tokens` where > 0: a short prompt's GEMMs leave more SMs to a decode beside it, and take fewer from
    it), a batch and context for the decoder, how many of each are timed alone and beside."""

    shape: str
    arch: Arch
    device: str
    prefill_tokens: int
    decode_batch: int
    decode_context: int
    prefills: int
    steps: int
    seed: int = 0
    short_tokens: int = 0

    @property
    def lengths(self) -> tuple[int, ...]:
        return (self.prefill_tokens, self.short_tokens) if self.short_tokens else (self.prefill_tokens,)

    @classmethod
    def default(cls, shape: str, arch: Arch, device: str, quick: bool, seed: int = 0) -> ShareSetup:
        if device.startswith("cuda"):
            return cls(shape, arch, device, 2048, 16, 512, 6 if quick else 12, 20 if quick else 40, seed, 256)
        return cls(shape, arch, device, 64 if quick else 256, 4, 64, 6 if quick else 10, 12 if quick else 30, seed,
                   16 if quick else 64)


def measure_share(setups: Sequence[ShareSetup], mps_env: dict[str, str] | None = None,
                  timeout_s: float = 900.0) -> tuple[list[SharePoints], list[DecodeSharePoints]]:
    """Time, for every pair of `setups`' shapes (a decoder of one beside a prefiller of the other, the same shape
    first) and each prompt length (the long one first), the two processes alone and side by side (`mps_env`: the
    client environment of an MPS daemon, when the device is a GPU serve would share under MPS); then, for every
    pair in the same order, the decoder beside the prefilling process of the other shape decoding too (both
    sides timed). A process per role and shape, all built at once; each pair is timed with the others idle."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each, as serve's engine processes
    env = dict(mps_env or {})
    workers: dict[tuple[str, str], tuple[Any, Any]] = {}
    try:
        for setup in setups:
            for role in ("decode", "prefill"):
                parent, child = ctx.Pipe()
                process = ctx.Process(target=_worker, args=(role, child, setup, env),
                                      name=f"modelpool-share-{role}-{setup.shape}", daemon=True)
                process.start()
                child.close()
                workers[role, setup.shape] = (process, parent)
        for (role, shape), (_, conn) in workers.items():
            _expect(conn, "ready", timeout_s, f"{role} ({shape})")
        decode_alone, prefill_alone = {}, {}
        for setup in setups:
            dec, pre = workers["decode", setup.shape][1], workers["prefill", setup.shape][1]
            dec.send(("alone", setup.steps))
            decode_alone[setup.shape] = _durations(_expect(dec, "done", timeout_s, "decode"))
            for tokens in setup.lengths:
                pre.send(("run", (setup.prefills, tokens)))
                prefill_alone[setup.shape, tokens] = _durations(_expect(pre, "done", timeout_s, "prefill"))
        pairs = [(s, s) for s in setups] + [(d, p) for d in setups for p in setups if d is not p]
        share = [_beside(d, p, tokens, workers["decode", d.shape][1], workers["prefill", p.shape][1],
                         decode_alone[d.shape], prefill_alone[p.shape, tokens], env, timeout_s)
                 for tokens in setups[0].lengths for d, p in pairs]
        peer_alone = {}  # the prefilling processes decode now: after their prefills, a batch of their own
        for setup in setups:
            peer = workers["prefill", setup.shape][1]
            _fresh(peer, timeout_s, "second decode")
            peer.send(("alone", setup.steps))
            peer_alone[setup.shape] = _durations(_expect(peer, "done", timeout_s, "second decode"))
        decode_share = [_decode_beside(d, p, workers["decode", d.shape][1], workers["prefill", p.shape][1],
                                       decode_alone[d.shape], peer_alone[p.shape], env, timeout_s) for d, p in pairs]
        for setup in setups:  # their batches released: the KV back to the prefills they are for
            peer = workers["prefill", setup.shape][1]
            peer.send(("release", 0))
            _expect(peer, "done", timeout_s, "second decode")
        return share, decode_share
    finally:
        for process, conn in workers.values():
            try:
                conn.send(("exit", 0))
            except (BrokenPipeError, OSError):
                pass
            process.join(30)
            if process.is_alive():
                process.kill()


def _beside(decoder: ShareSetup, prefiller: ShareSetup, tokens: int, dec: Any, pre: Any, decode_alone: list[float],
            prefill_alone: list[float], env: dict[str, str], timeout_s: float) -> SharePoints:
    """The decoder stepping without pause while the prefiller runs its prompts of `tokens` back to back."""
    for prefills in (prefiller.prefills, 4 * prefiller.prefills):  # again, longer, if too few steps fell inside
        dec.send(("spin", 0))
        _expect(dec, "spinning", timeout_s, "decode")
        pre.send(("run", (prefills, tokens)))
        beside = _expect(pre, "done", timeout_s, "prefill")
        dec.send(("stop", 0))
        steps = _expect(dec, "done", timeout_s, "decode")
        inside = _durations(_within(steps, beside[0][0], beside[-1][1]))
        if len(inside) >= 3:
            break
    else:
        raise RuntimeError(f"the decoder ({decoder.shape}) ran {len(inside)} whole steps during {prefills} "
                           f"prefills of {tokens} tokens ({prefiller.shape}): too few to time (a "
                           "longer prompt would do)")
    return SharePoints(shape=decoder.shape, prefill_shape=prefiller.shape, prefill_tokens=tokens,
                       decode_batch=decoder.decode_batch, mps=bool(env), prefill_alone_s=prefill_alone,
                       prefill_beside_s=_durations(beside), decode_alone_s=decode_alone, decode_beside_s=inside)


def _decode_beside(decoder: ShareSetup, peer: ShareSetup, dec: Any, other: Any, decode_alone: list[float],
                   peer_alone: list[float], env: dict[str, str], timeout_s: float) -> DecodeSharePoints:
    """The decoder stepping without pause while the second process (the prefilling one of `peer`'s shape) runs
    its decode steps back to back: each one's steps that fell wholly inside the other's stepping."""
    for steps in (peer.steps, 4 * peer.steps):  # again, longer, if too few of the decoder's steps fell inside
        _fresh(dec, timeout_s, "decode")  # both with the headroom of a fresh batch: no batch admitted (a prefill)
        _fresh(other, timeout_s, "second decode")  # while the other steps beside it
        dec.send(("spin", 0))
        _expect(dec, "spinning", timeout_s, "decode")
        other.send(("alone", steps))
        beside = _expect(other, "done", timeout_s, "second decode")
        dec.send(("stop", 0))
        spun = _expect(dec, "done", timeout_s, "decode")
        inside = _durations(_within(spun, beside[0][0], beside[-1][1]))
        peer_inside = _durations(_within(beside, spun[0][0], spun[-1][1]))
        if min(len(inside), len(peer_inside)) >= 3:
            break
    else:
        raise RuntimeError(f"the decoder ({decoder.shape}) ran {len(inside)} whole steps during {steps} decode steps "
                           f"of a second process ({peer.shape}), which ran {len(peer_inside)} whole steps inside "
                           "the decoder's: too few to time (more steps would do)")
    return DecodeSharePoints(shape=decoder.shape, peer_shape=peer.shape, decode_batch=decoder.decode_batch,
                             peer_batch=peer.decode_batch, mps=bool(env), alone_s=decode_alone, beside_s=inside,
                             peer_alone_s=peer_alone, peer_beside_s=peer_inside)


def _fresh(conn: Any, timeout_s: float, role: str) -> None:
    conn.send(("fresh", 0))
    _expect(conn, "done", timeout_s, role)


def _within(intervals: list[tuple[float, float]], begin: float, end: float) -> list[tuple[float, float]]:
    return [(s, e) for s, e in intervals if s >= begin and e <= end]


def _durations(intervals: list[tuple[float, float]]) -> list[float]:
    return [round(end - start, 7) for start, end in intervals]


def _expect(conn: Any, what: str, timeout_s: float, role: str) -> Any:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"the {role} process of the share benchmark said nothing for {timeout_s:g} s")
    try:
        said, value = conn.recv()
    except EOFError:
        raise RuntimeError(f"the {role} process of the share benchmark exited") from None
    if said == "error":
        raise RuntimeError(f"the {role} process of the share benchmark failed: {value}")
    if said != what:
        raise RuntimeError(f"the {role} process of the share benchmark said {said!r}, expected {what!r}")
    return value


def _worker(role: str, conn: Any, setup: ShareSetup, env: dict[str, str]) -> None:
    """One engine process: build the engine, then time what the parent asks for."""
    os.environ.update(env)  # an MPS client: before CUDA is touched
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        bench = _Bench(role, setup)
        conn.send(("ready", None))
        while True:
            command, count = conn.recv()
            if command == "exit":
                return
            if command == "alone":
                conn.send(("done", bench.steps(count=count)))
            elif command == "run":
                prompts, tokens = count
                conn.send(("done", [bench.prefill(tokens) for _ in range(prompts)]))
            elif command == "fresh":  # a fresh decode batch, and its first step (untimed)
                bench.fresh_batch()
                bench.steps(count=1)
                conn.send(("done", None))
            elif command == "release":
                bench.release_batch()
                conn.send(("done", None))
            elif command == "spin":
                conn.send(("spinning", None))
                steps = bench.steps(until=conn.poll)
                conn.recv()  # the stop
                conn.send(("done", steps))
    except Exception as exc:  # noqa: BLE001 - said to the parent, which raises it with the role
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except (BrokenPipeError, OSError):
            pass


class _Bench:
    """The engine of one process (modelpool.measure's, one shape) and its timed calls, each an interval."""

    def __init__(self, role: str, setup: ShareSetup) -> None:
        from modelpool.measure import Calibration, MeasurePlan, hf_config

        self.setup = setup
        plan = MeasurePlan(prefill_lengths=(setup.prefill_tokens,), prefill_batches=(1,),
                           decode_batches=(setup.decode_batch,), decode_contexts=(setup.decode_context + SPIN_STEPS,),
                           decode_steps=1, repeats=1, switch_repeats=1, kv_batches=(1,), kv_contexts=(16,))
        self.cal = Calibration({setup.shape: setup.arch}, setup.device, plan, seed=setup.seed)
        cal = self.cal
        cal.images[setup.shape] = cal.cache.add_random(setup.shape, hf_config(setup.arch), cal.dtype,
                                                       seed=setup.seed, device=cal.device)
        cal.engine = cal._engine(cal._kv_bytes())
        cal._warm_up(lambda _: None)
        cal.engine.activate(setup.shape)
        self.ids: list[str] = []
        self.stepped = 0
        if role == "decode":
            self.fresh_batch()
            self.steps(count=1)
        else:
            for tokens in setup.lengths:  # a first prompt of each length: allocator growth, GEMM heuristics
                self.prefill(tokens)

    def fresh_batch(self) -> None:
        self.release_batch()
        requests = self.cal._requests(self.setup.shape, self.setup.decode_batch, self.setup.decode_context)
        self.cal._admit(requests)
        self.ids, self.stepped = [r.request_id for r in requests], 0

    def release_batch(self) -> None:
        engine = self.cal.engine
        assert engine is not None
        if self.ids:
            engine.release(self.ids)
        self.ids, self.stepped = [], 0

    def steps(self, count: int | None = None, until: Callable[[], bool] | None = None) -> list[tuple[float, float]]:
        """Decode steps back to back, as a pool's decode instance runs them: no sync between steps (on CUDA the
        engine's async decode queues each next step before the host reads this one's tokens, so the device never
        waits for the host), each step's interval from the previous step's return to its own; `count` steps, or
        until `until()`; a fresh batch first where there is none (as in a prefilling process) or its KV headroom
        is spent. A step right after a sync (the first, or the first of a fresh batch) starts at that
        sync. (Synchronising around every step left the device idle between steps: a lighter neighbour than a
        served decode instance.)"""
        engine = self.cal.engine
        assert engine is not None
        out: list[tuple[float, float]] = []
        last: float | None = None
        while (count is None or len(out) < count) and not (until is not None and until()):
            if not self.ids or self.stepped >= SPIN_STEPS:
                self.fresh_batch()
                last = None
            if last is None:
                self.cal._sync()
                last = time.monotonic()
            engine.decode_step(self.ids)
            now = time.monotonic()
            out.append((last, now))
            last = now
            self.stepped += 1
        self.cal._sync()
        return out

    def prefill(self, tokens: int) -> tuple[float, float]:
        engine = self.cal.engine
        assert engine is not None
        requests = self.cal._requests(self.setup.shape, 1, tokens)
        interval = self._interval(lambda: engine.prefill(requests))
        engine.release([r.request_id for r in requests])
        return interval

    def _interval(self, fn: Any) -> tuple[float, float]:
        self.cal._sync()
        start = time.monotonic()
        fn()
        self.cal._sync()
        end = time.monotonic()
        return start, end

