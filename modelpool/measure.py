"""Measure what the cost model needs on this machine, with the torch engine and random weights of real shapes.

No files and no downloads: each shape's weights are random numbers in a
`HostWeightCache` image (as benchmarks/gpu_engine.py builds them), so any
architecture of a fleet file can be measured on any device that holds it.
`Calibration.run()` measures, in order: graph capture (if the engine captures
ahead of serving), then per shape weight switches, prefill by length and
batch, decode steps by batch and context (CUDA graphs as the engine replays
them on CUDA, and one eager step), KV moves out and back (alone, and at the
largest point again beside the other engine's switch of the largest model);
then copies of two engines on the one device at the same time (two threads);
then the per-step host overhead of the live pool (`modelpool.measure_live`).
Every result is a plain JSON-ready dict; `sims.profiles.calibrated` fits the
profile from it.

Imports torch, transformers and pool.engines only (no Ray, no vLLM).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pool.engines.base import GenRequest, SamplingParams
from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
from pool.engines.weights import HostWeightCache, ModelImage
from scheduler.fleet import Arch, hf_shape

MiB, GiB = 1 << 20, 1 << 30
FAMILIES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig", "mistral": "MistralConfig"}
Progress = Callable[[str], None]


@dataclass(frozen=True)
class MeasurePlan:
    """What to measure: the grid of points and how often each is repeated (the median counts)."""

    prefill_lengths: tuple[int, ...]
    prefill_batches: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int
    repeats: int
    switch_repeats: int
    kv_batches: tuple[int, ...]
    kv_contexts: tuple[int, ...]
    shared_repeats: int
    live: dict[str, int] = field(default_factory=dict)  # see modelpool.measure_live.LIVE_KEYS


def plan_for(cuda: bool, quick: bool) -> MeasurePlan:
    """The default grid: on CUDA sized for ~3 shapes of 1.5B-7B in under 3 minutes on an H200 (--quick ~1)."""
    if cuda and not quick:
        return MeasurePlan((128, 512, 2048), (1, 4), (1, 8, 32, 64), (256, 1024, 4096), 20, 4, 3, (1, 8), (512, 2048), 2,
                           {"prefill_probes": 6, "prompt": 512, "batch": 4, "decode_prompt": 256, "tokens": 128})
    if cuda:
        return MeasurePlan((256, 2048), (1, 4), (1, 16), (512, 2048), 10, 2, 2, (1, 8), (512, 2048), 1,
                           {"prefill_probes": 3, "prompt": 512, "batch": 4, "decode_prompt": 256, "tokens": 48})
    if quick:
        return MeasurePlan((16, 64), (1, 2), (1, 4), (32, 96), 4, 1, 2, (1, 4), (24, 48), 1,
                           {"prefill_probes": 2, "prompt": 32, "batch": 2, "decode_prompt": 16, "tokens": 8})
    return MeasurePlan((32, 128, 512), (1, 4), (1, 4, 16), (64, 256, 1024), 10, 3, 3, (1, 4), (64, 256), 2,
                       {"prefill_probes": 4, "prompt": 128, "batch": 4, "decode_prompt": 64, "tokens": 32})


def hf_config(arch: Arch) -> Any:
    """A transformers config of `arch`'s shape (no download: the config class of its family)."""
    import transformers

    family = arch.family if arch.family in FAMILIES else "llama"
    cls = getattr(transformers, FAMILIES[family])
    extra: dict[str, Any] = {"head_dim": arch.dim} if family != "qwen2" else {}
    if family == "llama" and arch.qkv_bias:
        extra["attention_bias"] = True
    if family == "mistral":
        extra["sliding_window"] = None
    return cls(**hf_shape(arch), max_position_embeddings=arch.max_context, **extra)


def unsupported(arch: Arch, tp: int) -> str:
    """Why the torch engine cannot measure `arch` at `tp` ('' when it can)."""
    if arch.is_moe:
        return "a mixture of experts (the torch engine runs dense models)"
    if tp > 1:
        return f"tensor parallel (tp {tp}; calibrate times one device: benchmarks/gpu_tp.py measures TP instances)"
    if arch.family.split("_")[0] not in FAMILIES and arch.family != "yi":
        return f"family {arch.family!r} (the torch engine runs {', '.join(FAMILIES)})"
    return ""


class Calibration:
    """One calibration run: the engines, the shapes, the plan, and what was measured (`result`)."""

    def __init__(self, archs: dict[str, Arch], device: str, plan: MeasurePlan, seed: int = 0) -> None:
        self.archs, self.plan, self.seed = archs, plan, seed
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = {"float32": torch.float32, "float16": torch.float16}.get(next(iter(archs.values())).dtype,
                                                                               torch.bfloat16)
        self.cache = HostWeightCache(pin=self.cuda)
        self.images: dict[str, ModelImage] = {}
        self.engine: TorchEngine | None = None
        self.other: TorchEngine | None = None  # a second engine on the same device: copies at the same time
        self.result: dict[str, Any] = {"device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
                                       "software": {"torch": torch.__version__, "cuda": torch.version.cuda or ""},
                                       "prefill": [], "decode": [], "swap": [], "kv_move": [], "kv_shared": [],
                                       "shared": [], "shapes": {}, "figures": {}}
        self._ids = 0

    @property
    def num_steps(self) -> int:
        """Progress units `run` reports (one per call of its `progress`)."""
        return 3 + 5 * len(self.archs)

    def run(self, progress: Progress = lambda _: None) -> dict[str, Any]:
        torch.manual_seed(self.seed)
        for name, arch in self.archs.items():
            self.images[name] = self.cache.add_random(name, hf_config(arch), self.dtype, seed=self.seed,
                                                      device=self.device)
            self.result["shapes"][name] = {"weight_bytes": self.images[name].nbytes, "num_layers": arch.num_layers}
            progress(f"built {name}")
        self.engine, self.other = self._engine(self._kv_bytes()), self._engine((64 if self.cuda else 1) * MiB)
        self._warm_up(progress)
        for name in self.archs:
            self._switch(name)
            progress(f"{name}: switches")
            self._prefill(name)
            progress(f"{name}: prefill")
            self._decode(name)
            progress(f"{name}: decode")
            self._kv_move(name)
            progress(f"{name}: KV moves")
        extra = self.engine.stats().extra  # a graph miss ran eagerly: the "graph" steps were not all graphs
        self.result["figures"].update({key: extra[key] for key in ("graph_captures", "graph_misses", "graph_replays")
                                       if isinstance(extra.get(key), (int, float))})
        self._shared()
        progress("copies of two engines at once")
        from modelpool.measure_live import measure_live

        smallest = min(self.archs, key=lambda n: self.images[n].nbytes)
        self.result["live"] = measure_live(self.engine, smallest, self.archs[smallest], self.plan.live, self._kv_bytes())
        progress("live pool host overhead")
        return self.result

    # ---- engines ---------------------------------------------------------------------------------
    def _engine(self, kv_bytes: int) -> TorchEngine:
        cuda = self.cuda
        moved = max(self.plan.kv_batches) * max(self.plan.kv_contexts) * max(a.kv_bytes_per_token for a in self.archs.values())
        batches = sorted({1, *self.plan.decode_batches, *_bucket_up(self.plan.live.get("batch", 1))})
        engine = TorchEngine(TorchEngineConfig(
            device=str(self.device), block_size=16, kv_bytes=kv_bytes, device_slab_bytes=(64 if cuda else 1) * MiB,
            host_slab_bytes=GiB if cuda else 4 * MiB, max_host_kv_bytes=max(4 * moved, 64 * MiB),
            host_kv_prealloc_bytes=2 * moved, max_model_bytes=max(i.nbytes for i in self.images.values()),
            graph_batch_sizes=tuple(batches),
            # as `modelpool serve` warms the pool's engines (to its max_prefill_tokens): to the longest prefill here
            warm_prefill_tokens=max(self.plan.prefill_lengths) * max(self.plan.prefill_batches) if cuda else 0),
            weight_cache=self.cache)
        for image in self.images.values():
            engine.add_image(image)
        return engine

    def _kv_bytes(self) -> int:
        plan = self.plan
        tokens = max(max(plan.decode_batches) * (max(plan.decode_contexts) + 64),
                     max(plan.prefill_batches) * (max(plan.prefill_lengths) + 16),
                     max(plan.kv_batches) * (max(plan.kv_contexts) + 16),
                     plan.live.get("batch", 1) * (plan.live.get("decode_prompt", 0) + plan.live.get("tokens", 0))
                     + plan.live.get("prompt", 0) + 64)
        need = int(1.25 * tokens * max(a.kv_bytes_per_token for a in self.archs.values()))
        slab = (64 if self.cuda else 1) * MiB
        return (need // slab + 2 * len(self.archs) + 2) * slab

    def _warm_up(self, progress: Progress) -> None:
        """Capture the decode graphs ahead of time, where the engine does that (else it captures on first use)."""
        engine = self.engine
        assert engine is not None
        warm_up = getattr(engine, "warm_up", None)
        if warm_up is not None and self.cuda:
            started = time.perf_counter()
            captured = warm_up(max(self.plan.decode_contexts))  # decode prompts stop short of each context
            seconds = time.perf_counter() - started
            prefills = getattr(engine, "warm_prefill_s", 0.0)  # the padded prefill lengths it ran first
            self.result["figures"].update(warm_up_s=round(seconds, 4), graphs_captured_at_warm_up=captured,
                                          warm_prefill_s=round(prefills, 4))
            if captured:
                self.result["figures"]["graph_capture_s"] = round((seconds - prefills) / captured, 5)
        self.result["figures"]["prefill_padded"] = float(bool(getattr(engine, "pads_prefill", False)))
        progress("graph capture")

    # ---- one shape ---------------------------------------------------------------------------------
    def _switch(self, name: str) -> None:
        engine = self.engine
        assert engine is not None
        times = []
        for _ in range(self.plan.switch_repeats):
            engine.deactivate(name)
            engine.drop_resident(name)
            times.append(self._timed(lambda: engine.activate(name)))
        self.result["swap"].append({"arch": name, "bytes": self.images[name].nbytes, "seconds": _median(times),
                                    "all_s": _round(times)})

    def _prefill(self, name: str) -> None:
        engine = self.engine
        assert engine is not None
        for length in self.plan.prefill_lengths:
            for batch in self.plan.prefill_batches:
                first = self._time_prefill(name, length, batch)  # a fresh shape: allocator growth, GEMM heuristics
                times = [self._time_prefill(name, length, batch) for _ in range(self.plan.repeats)]
                self.result["prefill"].append({"arch": name, "tokens": length, "batch": batch,
                                               "seconds": _median(times), "first_s": round(first, 6)})

    def _time_prefill(self, name: str, length: int, batch: int) -> float:
        engine = self.engine
        assert engine is not None
        requests = self._requests(name, batch, length)
        seconds = self._timed(lambda: engine.prefill(requests))
        engine.release([r.request_id for r in requests])
        return seconds

    def _decode(self, name: str) -> None:
        engine = self.engine
        assert engine is not None
        steps = self.plan.decode_steps
        graphs = engine.use_cuda_graphs
        modes = [(graphs, b, c) for b in self.plan.decode_batches for c in self.plan.decode_contexts]
        if graphs:
            modes.append((False, 1, self.plan.decode_contexts[0]))  # eager: the launch floor
        for use_graphs, batch, context in modes:
            engine.use_cuda_graphs = use_graphs
            try:
                prompt = max(1, context - steps - 3)
                requests = self._requests(name, batch, prompt)
                ids = [r.request_id for r in requests]
                self._admit(requests)
                first = self._timed(lambda: engine.decode_step(ids))
                times = [self._timed(lambda: engine.decode_step(ids)) for _ in range(steps)]
                engine.release(ids)
            finally:
                engine.use_cuda_graphs = graphs
            step = _median(times)
            self.result["decode"].append({"arch": name, "batch": batch, "context": prompt + 2 + steps // 2,
                                          "graphs": use_graphs, "seconds": step, "first_step_s": round(first, 6)})

    def _kv_move(self, name: str) -> None:
        engine = self.engine
        assert engine is not None
        for batch, context in ((b, c) for b in self.plan.kv_batches for c in self.plan.kv_contexts):
            requests = self._requests(name, batch, context)
            ids = [r.request_id for r in requests]
            self._admit(requests)
            nbytes = engine.stats().kv_device_used_bytes
            engine.save_kv(ids)  # first copies: slabs are assigned
            engine.restore_kv(ids)
            save, restore = [], []
            for _ in range(self.plan.repeats):
                save.append(self._timed(lambda: engine.save_kv(ids)))
                restore.append(self._timed(lambda: engine.restore_kv(ids)))
            self.result["kv_move"].append({"arch": name, "batch": batch, "context": context, "bytes": nbytes,
                                           "save_s": _median(save),
                                           "restore_s": _median(restore)})
            if (batch, context) == (max(self.plan.kv_batches), max(self.plan.kv_contexts)):
                self._kv_beside_copy(name, ids, batch, context, nbytes)
            engine.release(ids)

    def _kv_beside_copy(self, name: str, ids: list[str], batch: int, context: int, nbytes: int) -> None:
        """Save and restore the KV of `ids` while the other engine switches in the largest model at the same
        moment, from two threads (a KV move beside another instance's switch on one GPU): each move's time, the
        switch's, and the span of both (medians). Each move waits for its own stream only, not for the switch."""
        engine, other = self.engine, self.other
        assert engine is not None and other is not None
        copied = max(self.images, key=lambda n: self.images[n].nbytes)
        other.activate(copied)  # its device buffer is allocated now, not inside a timed copy
        row: dict[str, Any] = {"arch": name, "batch": batch, "context": context, "bytes": nbytes, "copied": copied,
                               "copy_bytes": self.images[copied].nbytes}
        for way, move, stream in (("save", engine.save_kv, engine.streams.swap_out),
                                  ("restore", engine.restore_kv, engine.streams.swap_in)):
            runs = []
            for _ in range(self.plan.shared_repeats):
                other.deactivate(copied)
                other.drop_resident(copied)
                self._sync()
                runs.append(_together([lambda: _on_stream(move, ids, stream), lambda: other.activate(copied)]))
            row |= {f"{way}_s": _median([kv for (kv, _), _ in runs]),
                    f"{way}_copy_s": _median([copy for _, (copy, _) in runs]),
                    f"{way}_span_s": _median([max(end for _, end in r) - min(end - t for t, end in r) for r in runs])}
        self.result["kv_shared"].append(row)

    # ---- two engines at once -------------------------------------------------------------------------
    def _shared(self) -> None:
        """Each engine switches in a model at the same moment, from its own thread (as two instances on one
        GPU do): each copy's time and the span of both, against each alone."""
        engine, other = self.engine, self.other
        assert engine is not None and other is not None
        names = sorted(self.archs, key=lambda n: self.images[n].nbytes)
        first, second = names[-1], names[-2] if len(names) > 1 else names[-1]
        other.activate(second)  # its device buffer is allocated now, not inside a timed copy
        for _ in range(self.plan.shared_repeats):
            for e, n in ((engine, first), (other, second)):
                e.deactivate(n)
                e.drop_resident(n)
            self._sync()
            times = _together([lambda: engine.activate(first), lambda: other.activate(second)])
            self.result["shared"].append({"archs": [first, second], "bytes": [self.images[first].nbytes,
                                                                              self.images[second].nbytes],
                                          "seconds": _round([t for t, _ in times]),
                                          "span_s": round(max(end for _, end in times) - min(end - t for t, end in times), 6)})

    # ---- helpers ---------------------------------------------------------------------------------
    def _admit(self, requests: list[GenRequest], max_tokens: int = 16384) -> None:
        """Prefill `requests` a few at a time (bounded activations: a batch of long prompts is large)."""
        engine = self.engine
        assert engine is not None
        per_call = max(1, max_tokens // max(1, len(requests[0].prompt_token_ids)))
        for start in range(0, len(requests), per_call):
            engine.prefill(requests[start:start + per_call])

    def _requests(self, name: str, batch: int, length: int) -> list[GenRequest]:
        vocab = self.archs[name].vocab_size
        gen = torch.Generator().manual_seed(self._ids)
        out = []
        for _ in range(batch):
            self._ids += 1
            tokens = torch.randint(0, vocab, (length,), generator=gen).tolist()
            out.append(GenRequest(f"cal{self._ids}", name, tokens, SamplingParams(max_tokens=1 << 20, ignore_eos=True)))
        return out

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _timed(self, fn: Callable[[], object]) -> float:
        self._sync()
        started = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - started


def _together(calls: Sequence[Callable[[], object]]) -> list[tuple[float, float]]:
    """Run `calls` in threads released at once; each one's (seconds, end time). The engines' calls wait
    for their own copies (activate returns when the weights are there), not for each other's."""
    barrier = threading.Barrier(len(calls))
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(calls)

    def one(k: int) -> None:
        barrier.wait()
        started = time.perf_counter()
        calls[k]()
        end = time.perf_counter()
        out[k] = (end - started, end)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def _on_stream(move: Callable[[list[str]], None], ids: list[str], stream: Any) -> None:
    """`move(ids)` (save_kv or restore_kv: they queue their copies on `stream`, None on CPU), waited for."""
    move(ids)
    if stream is not None:
        stream.synchronize()


def _bucket_up(batch: int) -> tuple[int, ...]:
    """The power of two at or above `batch` (the graph bucket a live batch pads to)."""
    return (1 << (batch - 1).bit_length(),)


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 7)


def _round(values: Sequence[float]) -> list[float]:
    return [round(v, 7) for v in values]
