"""Step times of the torch engine on CPU slots: the cost model `serve` plans the demo and CPU fleets with."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler import CostModel, ModelProfile


class CpuCosts(CostModel):
    """Step times of the torch engine on one CPU core (float32): hand-set rates, not a fit.

    What they are: a roofline with four constants - `flops` (3e10 FLOP/s) for a
    prefill's 2 x params FLOP per token, `mem_bytes_s` (4.5e9 B/s) for a decode
    step's read of the weights and the batch's KV (or the batch's FLOP at `flops`,
    whichever is longer), `copy_bytes_s` (5e9 B/s) for weight switches and KV
    moves, and `fixed_s` (2 ms) per step. They were set by hand on the 2-core dev
    VM from SmolLM2-135M's step times as first observed (decode ~0.11-0.13 s per
    token, a 100-token prefill ~0.9 s); `modelpool calibrate --device cpu` measures
    synthetic shapes for the GPU cost model, not these, so nothing derives them.

    How far off: `benchmarks/cpu_costs.py` (claimed vs measured on this CPU, one
    thread) on the dev VM, 2026-12-06, torch 2.13 CPU, a quiet machine:
    SmolLM2-135M prefill is overestimated 2.0x at 32 tokens and ~3x at 128-512
    (1.15 s claimed vs 0.39 s measured at 128: the engine reaches ~90 GFLOP/s, not
    30); decode at a 128-token context 2.2x at batch 1 (123 vs 57 ms), 1.3-1.5x
    at batch 2-8, 1.0x at batch 16. The tiny models: prefill 1.6-2.6x, decode
    3.2-3.5x at batch 1 falling to 1.2-1.5x at 16 (their steps are a few ms, where
    `fixed_s` dominates). The plans therefore think the demo slower than it is,
    prefill most of all; the demo's tests depend on its timing, so the figures
    stay until a change re-runs those tests (copy rates are not benchmarked).
    """

    def __init__(self, profiles: Mapping[str, ModelProfile], *, mem_bytes_s: float = 4.5e9,
                 flops: float = 3e10, copy_bytes_s: float = 5e9, fixed_s: float = 0.002, bytes_per_param: int = 4):
        self.profiles = dict(profiles)
        self.mem_bytes_s, self.flops, self.copy_bytes_s = mem_bytes_s, flops, copy_bytes_s
        self.fixed_s, self.bytes_per_param = fixed_s, bytes_per_param

    def _flops_per_token(self, model: str) -> float:
        return 2.0 * self.profiles[model].weight_bytes / self.bytes_per_param

    def prefill_s(self, model: str, num_tokens: int, num_requests: int = 1) -> float:
        return self.fixed_s + self._flops_per_token(model) * num_tokens / self.flops

    def decode_step_s(self, model: str, batch_size: int, context_tokens: int) -> float:
        profile = self.profiles[model]
        read = profile.weight_bytes + profile.kv_bytes_per_token * context_tokens
        return self.fixed_s + max(read / self.mem_bytes_s, self._flops_per_token(model) * batch_size / self.flops)

    def switch_s(self, model: str) -> float:
        return self.profiles[model].weight_bytes / self.copy_bytes_s

    def kv_move_s(self, model: str, num_tokens: int) -> float:
        return self.profiles[model].kv_bytes_per_token * num_tokens / self.copy_bytes_s
