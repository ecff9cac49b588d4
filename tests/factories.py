"""Test factories: small fleets, requests and a linear cost model (a sims.costmodel.SimCosts)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from scheduler import InstanceSpec, ModelProfile, Request, make_scheduler
from sims.costmodel import SimCosts
from sims.simulator import Simulator

GB = 1e9


class LinearCosts(SimCosts):
    """Times that are easy to work out by hand: fixed + per-token terms."""

    def __init__(self, step_s: float = 0.01, per_token_s: float = 1e-7, prefill_per_token_s: float = 1e-4,
                 switch_s: float = 0.5, kv_per_token_s: float = 1e-6) -> None:
        self.step = step_s
        self.per_token = per_token_s
        self.prefill_per_token = prefill_per_token_s
        self.switch = switch_s
        self.kv_per_token = kv_per_token_s

    def prefill_s(self, model: str, num_tokens: int, num_requests: int = 1) -> float:
        return 0.005 + self.prefill_per_token * num_tokens

    def decode_step_s(self, model: str, batch_size: int, context_tokens: int) -> float:
        return self.step + self.per_token * context_tokens

    def decode_turn_s(self, model: str, batch_size: int, context_tokens: int, num_steps: int) -> float:
        # context grows by batch_size each step: an arithmetic series
        return num_steps * self.step + self.per_token * (num_steps * context_tokens
                                                         + batch_size * num_steps * (num_steps - 1) / 2)

    def switch_s(self, model: str) -> float:
        return self.switch

    def kv_move_s(self, model: str, num_tokens: int) -> float:
        return self.kv_per_token * num_tokens


def make_models(num: int = 3, *, tp: int = 1, weight_gb: float = 14.0, kv_per_token: int = 57344,
                tpot_s: float = 0.1, ttft_s: float = 10.0, rates: Sequence[float] | None = None) -> dict[str, ModelProfile]:
    return {f"m{i}": ModelProfile(f"m{i}", tp, weight_gb * GB, kv_per_token, 32768, ttft_s, tpot_s,
                                  rates[i] if rates else 0.1) for i in range(num)}


def make_instances(num: int = 2, *, memory_gb: float = 80.0, roles: Sequence[str] | None = None,
                   tp: int = 1) -> list[InstanceSpec]:
    return [InstanceSpec(f"i{k}", tp, memory_gb * GB * tp, (roles[k] if roles else "mixed"))  # type: ignore[arg-type]
            for k in range(num)]


def make_request(request_id: str = "r1", model: str = "m0", arrival_at: float = 0.0, prompt_tokens: int = 100,
                 max_output_tokens: int = 20) -> Request:
    return Request(request_id, model, arrival_at, prompt_tokens, max_output_tokens)


def make_workload(num: int, models: Sequence[str], *, rate: float = 2.0, seed: int = 0,
                  max_prompt: int = 2000, max_output: int = 300) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for k in range(num):
        t += rng.expovariate(rate)
        out.append(Request(f"r{k:05d}", rng.choice(list(models)), t, rng.randint(1, max_prompt),
                           rng.randint(1, max_output)))
    return out


def make_sim(policy: str, models: dict[str, ModelProfile], instances: list[InstanceSpec], requests: list[Request],
             costs: LinearCosts | None = None, plan_log=None, faults=(), **options) -> tuple[Simulator, Any]:
    """A simulator and its scheduler, not yet run (a test may set their knobs first)."""
    costs = costs or LinearCosts()
    sched = make_scheduler(policy, models, instances, costs, **options)
    capacity = {iid: inst.kv_capacity_bytes for iid, inst in sched.instances.items()}  # type: ignore[attr-defined]
    sim = Simulator(sched, costs, requests, kv_bytes_per_token={n: m.kv_bytes_per_token for n, m in models.items()},
                    kv_capacity=capacity, plan_log=plan_log, faults=faults,
                    weight_capacity=getattr(sched, "weight_budgets", None),  # token-level's planned weight budgets
                    weight_bytes={n: m.weight_bytes for n, m in models.items()})
    return sim, sched


def run_sim(policy: str, models: dict[str, ModelProfile], instances: list[InstanceSpec], requests: list[Request],
            costs: LinearCosts | None = None, plan_log=None, faults=(), **options) -> tuple[Simulator, object]:
    sim, sched = make_sim(policy, models, instances, requests, costs, plan_log, faults, **options)
    sim.run()
    return sim, sched
