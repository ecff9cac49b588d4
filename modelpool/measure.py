"""Microbenchmarks of the cost model's engine terms: the torch engine on random weights of several shapes.

No files and no downloads: each shape's weights are random numbers in a `HostWeightCache` image, so any
architecture the engine runs can be measured on any device that holds it. `Calibration.run()` measures, in
order: graph capture (if the engine captures ahead of serving), then per shape weight switches (pinned host
to device copies), prefill by length and prompts, decode steps by batch and context (CUDA graphs as the
engine replays them on CUDA, and one eager step), KV moves out and back. `device_peaks` times the device's own
rates (a large GEMM, a large copy, a host copy) for a device the GPU catalogue does not describe (a CPU).
The result is `sims.profiles.measurements.Points`; `sims.profiles.measurements.build` fits the terms.

Imports torch, transformers and pool.engines only (no Ray, no vLLM).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    # the engine idles this long before each timed prefill, as a served prefill instance's engine does (it waits on
    # its pipe, or runs the previous request's first decode steps, between prefills): the eager prefill is
    # host-bound for small shapes, and the host's time for it grows with the time since its last run - on the
    # H100 machine a 0.5B prefill of 256 tokens took 9.5 ms back to back in an engine process, 15 ms after 100 ms
    # idle; served, 16-19 ms at light load and at the knee (benchmarks/gpu_prefill_served.py,
    # benchmarks/prefill_host_cpu.py). Back-to-back points fell short of every served prefill of small models.
    prefill_gap_s: float = 0.05


def plan_for(cuda: bool, quick: bool) -> MeasurePlan:
    """The default grid: on CUDA sized for the six shapes of SHAPES in a few minutes on an H100/H200."""
    if cuda and not quick:
        return MeasurePlan((128, 512, 2048), (1, 4), (1, 8, 32, 64), (256, 2048), 12, 5, 3, (1, 8), (512, 2048))
    if cuda:  # decode batches to 64: the live pool's decode instances run batches of 16-64 (the scenarios' cap)
        return MeasurePlan((256, 2048), (1, 4), (1, 8, 32, 64), (512, 2048), 8, 2, 2, (1, 8), (512, 2048))
    if quick:
        return MeasurePlan((16, 64), (1, 2), (1, 4), (32, 96), 4, 1, 2, (1, 4), (24, 48))
    return MeasurePlan((32, 128, 512), (1, 4), (1, 4, 16), (64, 256, 1024), 10, 3, 3, (1, 4), (64, 256))


def _tiny(family: str, layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int,
          head_dim: int | None = None) -> Arch:
    return Arch(family=family, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, qkv_bias=family == "qwen2",
                max_context=4096)


def shapes_for(cuda: bool, quick: bool) -> dict[str, Arch]:
    """The shapes microbenchmarked: six (five with --quick) across qwen2, qwen3 and llama that vary layers,
    width, heads, KV heads and vocabulary apart. On CUDA real models' shapes (random weights), 0.5B-7B; on a
    CPU tiny ones (the same variety, at sizes a CPU times in seconds)."""
    from scheduler.fleet import ARCHS

    if cuda:
        keys: tuple[str, ...] = ("qwen2.5-0.5b", "llama-3.2-1b", "qwen3-1.7b", "qwen2.5-3b", "qwen3-4b", "qwen2.5-7b")
        keys = keys[:5] if quick else keys
        return {key: Arch.model_validate({**ARCHS[key], "total_params": None}) for key in keys}
    scale = 1 if quick else 2
    shapes = {
        "tiny-qwen2-a": _tiny("qwen2", 2, 64 * scale, 4, 2, 128 * scale, 512),
        "tiny-llama-a": _tiny("llama", 6, 64 * scale, 2, 1, 192 * scale, 768),
        "tiny-qwen3-a": _tiny("qwen3", 3, 96 * scale, 6, 2, 192 * scale, 1024, head_dim=16 * scale),
        "tiny-llama-b": _tiny("llama", 2, 128 * scale, 8, 8, 256 * scale, 2048),
        "tiny-qwen2-b": _tiny("qwen2", 4, 128 * scale, 4, 1, 256 * scale, 1536),
        "tiny-qwen3-b": _tiny("qwen3", 5, 64 * scale, 4, 4, 128 * scale, 640, head_dim=16 * scale),
    }
    return dict(list(shapes.items())[:5]) if quick else shapes


def device_peaks(device: str, dtype: Any = None, quick: bool = False) -> dict[str, float]:
    """The device's own rates, for a device the GPU catalogue does not describe: dense matmul FLOP/s (the
    median of a few large GEMMs in `dtype`), memory bandwidth (bytes read and written by a large copy, per
    second) and the host-to-device copy rate (a plain host copy on a CPU); the memory size in GB."""
    dev = torch.device(device)
    dtype = dtype or torch.bfloat16
    n = 512 if quick or dev.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=dev).to(dtype), torch.randn(n, n, device=dev).to(dtype)
    size = (32 if quick else 128) * MiB if dev.type == "cpu" else GiB
    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    dst.copy_(src)
    a @ b

    def timed(fn: Callable[[], object], repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            started = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    flops = 2.0 * n ** 3 / timed(lambda: a @ b)
    memory = 2.0 * size / timed(lambda: dst.copy_(src))
    h2d = size / timed(lambda: dst.copy_(host, non_blocking=False))
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
    else:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"tflops": flops / 1e12, "memory_tb_s": memory / 1e12, "h2d_gb_s": h2d / 1e9, "memory_gb": total / 1e9}


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
        self.result: dict[str, Any] = {"device": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
                                       "software": {"torch": torch.__version__, "cuda": torch.version.cuda or ""},
                                       "prefill": [], "decode": [], "swap": [], "kv_move": [], "figures": {}}
        self._ids = 0

    @property
    def num_steps(self) -> int:
        """Progress units `run` reports (one per call of its `progress`)."""
        return 1 + 5 * len(self.archs)

    def run(self, progress: Progress = lambda _: None) -> dict[str, Any]:
        """Every point of the plan; the result's prefill/decode/swap/kv_move lists are
        sims.profiles.measurements.Points fields."""
        torch.manual_seed(self.seed)
        for name, arch in self.archs.items():
            self.images[name] = self.cache.add_random(name, hf_config(arch), self.dtype, seed=self.seed,
                                                      device=self.device)
            progress(f"built {name}")
        self.engine = self._engine(self._kv_bytes())
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
        # the device memory back before what follows (the share benchmark's four engine processes on one GPU ran
        # out of memory beside this process's engine on an 80 GB H100)
        self.engine.close()
        self.engine = None
        self.images.clear()
        if self.cuda:
            torch.cuda.empty_cache()
        return self.result

    # ---- engines ---------------------------------------------------------------------------------
    def _engine(self, kv_bytes: int) -> TorchEngine:
        cuda = self.cuda
        moved = max(self.plan.kv_batches) * max(self.plan.kv_contexts) * max(a.kv_bytes_per_token for a in self.archs.values())
        batches = sorted({1, *self.plan.decode_batches})
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
        return self.kv_bytes_for(max(max(plan.decode_batches) * (max(plan.decode_contexts) + 64),
                                     max(plan.prefill_batches) * (max(plan.prefill_lengths) + 16),
                                     max(plan.kv_batches) * (max(plan.kv_contexts) + 16)))

    def kv_bytes_for(self, tokens: int) -> int:
        """The engine's KV region for `tokens` tokens of the largest shape at once: a quarter to spare, in whole
        slabs, two more per shape and two more."""
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
        self.result["figures"]["decode_ahead"] = float(bool(getattr(engine, "async_decode", False)))
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
        self.result["swap"].append({"shape": name, "bytes": self.images[name].nbytes, "seconds": _median(times)})

    def _prefill(self, name: str) -> None:
        engine = self.engine
        assert engine is not None
        for length in self.plan.prefill_lengths:
            for batch in self.plan.prefill_batches:
                self._time_prefill(name, length, batch)  # a fresh shape: allocator growth, GEMM heuristics
                times = [self._time_prefill(name, length, batch) for _ in range(self.plan.repeats)]
                self.result["prefill"].append({"shape": name, "tokens": length, "batch": batch,
                                               "seconds": _median(times), "gap_s": self.plan.prefill_gap_s})

    def _time_prefill(self, name: str, length: int, batch: int) -> float:
        engine = self.engine
        assert engine is not None
        requests = self._requests(name, batch, length)
        seconds = self._timed(lambda: engine.prefill(requests), idle_s=self.plan.prefill_gap_s)
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
                self._timed(lambda: engine.decode_step(ids))
                times = [self._timed(lambda: engine.decode_step(ids)) for _ in range(steps)]
                engine.release(ids)
            finally:
                engine.use_cuda_graphs = graphs
            step = _median(times)
            self.result["decode"].append({"shape": name, "batch": batch, "context": prompt + 2 + steps // 2,
                                          "graphs": use_graphs, "seconds": step})

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
            self.result["kv_move"].append({"shape": name, "batch": batch, "context": context, "bytes": nbytes,
                                           "save_s": _median(save), "restore_s": _median(restore)})
            engine.release(ids)

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

    def _timed(self, fn: Callable[[], object], idle_s: float = 0.0) -> float:
        """Seconds `fn` takes, the device synchronised around it, after `idle_s` with nothing to do."""
        self._sync()
        if idle_s > 0:
            time.sleep(idle_s)
        started = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - started


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 7)


