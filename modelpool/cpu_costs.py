"""Step times of the torch engine on CPU slots: the cost model `serve` plans the demo and CPU fleets with."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler import CostModel, ModelProfile


class CpuCosts(CostModel):
    """Step times of the torch engine on one CPU core (float32), fitted on the 2-core dev VM.

    SmolLM2-135M there: decode ~0.11-0.13 s/token (weights streamed at ~4.5
    GB/s), a 100-token prefill ~0.9 s (~30 GFLOP/s); copies run at ~5 GB/s.
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
