"""token-level's memory plan and resident set: how an instance's memory splits between KV and model weights,
and which models' weights it keeps.

The split is planned per instance when the policy starts (`plan_memory`), from the load the fleet expects:

- a decode (or mixed) instance keeps KV for the requests it is expected to decode at once: by Little's law,
  each model's arrival rate times the time its answer takes at the TPOT SLO (the slowest pace allowed, which
  makes requests overlap most), shared over the class's decode instances, plus three standard deviations of
  that Poisson count for bursts, each request holding its mean prompt plus output;
- a prefill instance keeps KV for two prefill batches (the one handing off and the next);
- either keeps at least the KV of the longest request a model of its class may run (so none is refused), and
  at most what leaves room for the class's largest model's weights.

The rest holds weights. With no load figures (a model without `rate_rps` or mean lengths) the plan is the
two-slot one the engines were built with: room for two copies of the class's largest model. An instance whose
engine reports its own KV region (`InstanceSpec.kv_bytes`, the live pool) keeps that KV and plans its weights in
what is left (`InstanceSpec.weight_bytes` when the engine says, else the memory less the KV).

`ResidentSet` keeps as many models as that weight budget holds. A switch or prefetch that needs room evicts
the models least worth keeping first: a model's worth is what losing it is expected to cost per second, its
arrival rate times its switch time (a big model that is asked for often is expensive to lose); a model the
instance needs soon (the next group or batch) is not evicted, a pinned one never, and ties go least recently
used first. Each Switch and Prefetch carries the set it leaves (`keep`), so the engine holds exactly what the
plan says (scheduler.instance).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from scheduler.costs import InstanceSpec, ModelProfile, kv_need_tokens


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """One instance's memory: device bytes for KV and for model weights (they add up to its memory)."""

    kv_bytes: float
    weight_bytes: float
    why: str


def decode_kv_load_bytes(models: Sequence[ModelProfile], num_decode: int) -> float | None:
    """KV bytes one of `num_decode` decode instances is expected to hold at once at the models' planned load,
    with three Poisson standard deviations of headroom; None when a model lacks a rate or mean lengths."""
    concurrent = kv = 0.0
    for m in models:
        rate = m.load_rps or m.rate_rps
        if m.mean_output_tokens <= 0:
            return None
        count = rate * m.mean_output_tokens * m.tpot_slo_s / max(1, num_decode)
        concurrent += count
        kv += count * m.kv_bytes_per_token * (m.mean_prompt_tokens + m.mean_output_tokens)
    if concurrent <= 0:
        return None  # no rates: nothing to plan with
    per_request = kv / concurrent
    return (concurrent + 3.0 * math.sqrt(concurrent)) * per_request


def plan_memory(spec: InstanceSpec, models: Sequence[ModelProfile], num_decode: int,
                max_prefill_tokens: int) -> MemoryPlan:
    """The KV/weights split of `spec` (see the module docstring); `models`: those of its TP class."""
    biggest = max((m.weight_bytes for m in models), default=0.0)
    if spec.kv_bytes is not None:
        weights = spec.weight_bytes if spec.weight_bytes is not None else spec.memory_bytes - spec.kv_bytes
        # an engine serves every model of its class, so its model memory holds the largest at least (the sim
        # engine reports a region sized from its own costs, which the fleet's estimate may exceed)
        return MemoryPlan(spec.kv_bytes, max(weights, biggest), "KV region reported by the engine")
    floor = max((m.kv_bytes_per_token * kv_need_tokens(m, m.max_context) for m in models), default=0.0)
    most = spec.memory_bytes - biggest
    if spec.role == "prefill":
        per_token = max((m.kv_bytes_per_token for m in models), default=0)
        need, why = 2.0 * max_prefill_tokens * per_token, "two prefill batches"
    else:
        load = decode_kv_load_bytes(models, num_decode)
        if load is None:
            kv = spec.memory_bytes - 2 * biggest
            return MemoryPlan(kv, spec.memory_bytes - kv, "no load figures: two slots of the largest model")
        need, why = load, "decode load by Little's law + 3 sd"
    kv = min(max(need, floor), most)
    if kv == floor and need < floor:
        why = "the longest request a model allows"
    elif kv == most and need > most:
        why = f"{why}, capped to leave the largest model room"
    weights = useful_weight_bytes(models, spec.memory_bytes - kv)
    return MemoryPlan(spec.memory_bytes - weights, weights, f"{why}; the rest to KV")


def useful_weight_bytes(models: Sequence[ModelProfile], room: float) -> float:
    """The weight bytes worth keeping in `room`: the models most asked for (by rate, then size) that fit
    together, filled greedily, and at least the largest model. Bytes no further model fits into go to KV."""
    biggest = max((m.weight_bytes for m in models), default=0.0)
    taken = 0.0
    for m in sorted(models, key=lambda m: (-(m.load_rps or m.rate_rps), m.weight_bytes, m.name)):
        if taken + m.weight_bytes <= room:
            taken += m.weight_bytes
    return max(taken, biggest)


class ResidentSet:
    """The models whose weights one instance holds, as the plan has left them, within its weight budget."""

    def __init__(self, budget_bytes: float, sizes: Mapping[str, float], pinned: Collection[str] = ()) -> None:
        self.budget_bytes = budget_bytes
        self.sizes = sizes
        self.pinned = frozenset(pinned)
        self.held: dict[str, float] = {}  # model -> when the plan last used it

    def __contains__(self, model: str) -> bool:
        return model in self.held

    def used_bytes(self) -> float:
        return sum(self.sizes[m] for m in self.held)

    def add(self, model: str, now: float, protect: Collection[str], worth: Callable[[str], float],
            expired: Collection[str] = (), hard: Collection[str] = ()) -> tuple[str, ...] | None:
        """Hold `model` (used at `now`), evicting the models least worth keeping until it fits; returns the
        other models held after (the action's `keep`). `protect`: models needed soon, evicted only when
        nothing else frees room (the active model's successor is then copied again); pinned models are
        evicted only when the model alone cannot fit beside them; `hard` ones (resident: computing) never.
        `expired` models (idle past their TTL) go whether or not room is needed, unless protected. None, and
        nothing changes, when `model` cannot fit beside the `hard` ones."""
        if self.sizes[model] + sum(self.sizes[m] for m in hard if m != model and m in self.held) \
                > self.budget_bytes * (1 + 1e-9):
            return None
        self.held.pop(model, None)
        for gone in expired:
            if gone not in protect and gone not in self.pinned and gone not in hard:
                self.held.pop(gone, None)
        room = self.budget_bytes - self.sizes[model]
        order = sorted((m for m in self.held if m not in hard),
                       key=lambda m: (m in self.pinned, m in protect, worth(m), self.held[m], m))
        used = sum(self.sizes[m] for m in self.held)
        for victim in order:
            if used <= room * (1 + 1e-9):
                break
            used -= self.sizes[victim]
            del self.held[victim]
        keep = tuple(sorted(self.held))
        self.held[model] = now
        return keep

    def would_evict(self, model: str, protect: Collection[str], worth: Callable[[str], float],
                    hard: Collection[str] = ()) -> list[str] | None:
        """The models `add` would evict to hold `model` (none when it is held or fits beside the others);
        None when it cannot fit beside the `hard` ones."""
        if model in self.held:
            return []
        trial = ResidentSet(self.budget_bytes, self.sizes, self.pinned)
        trial.held = dict(self.held)
        kept = trial.add(model, 0.0, protect, worth, hard=hard)
        return None if kept is None else [m for m in self.held if m not in kept]

    def clear(self) -> None:
        self.held.clear()
