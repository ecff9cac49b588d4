"""`spatial`: co-locate as many models as fit in GPU memory; never swap.

Algorithm (MuxServe / Prism-style co-location): at start, each model gets a
replica per instance's worth of its TP class's traffic it carries (at least
one; MuxServe gives popular models more units), and replicas are placed
busiest first, each on the instance of its TP size with the least traffic
placed so far among those whose memory still holds its weights plus a KV
reserve of `min_kv_tokens`; instances left empty get more replicas of the
busiest models. A model that fits nowhere is refused. Each
instance then runs continuous batching over all its resident models: queued
prompts are admitted FCFS when their KV fits the shared KV pool, and one
decode step advances every running request of every resident model (their
step times add up: decode is memory bound and each model reads its own
weights). Weights never move after start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from scheduler.costs import CostModel, InstanceSpec, ModelProfile, kv_capacity
from scheduler.plan import Action, Stop, Switch
from scheduler.policies.base import PolicyBase
from scheduler.request import Request


def place_models(models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec],
                 min_kv_tokens: int = 4096) -> dict[str, list[str]]:
    """instance_id -> models placed on it.

    Per TP class, a model gets a replica for every instance's worth of the class's traffic it carries
    (at least one), and replicas are placed busiest first, each on the least-loaded instance that still
    holds its weights plus a KV reserve. Instances left empty take more replicas of the busiest models.
    """
    free = {s.instance_id: s.memory_bytes for s in instances}
    load = {s.instance_id: 0.0 for s in instances}
    tp_of = {s.instance_id: s.tp for s in instances}
    placed: dict[str, list[str]] = {s.instance_id: [] for s in instances}

    def need(m: ModelProfile) -> float:
        return m.weight_bytes + m.kv_bytes_per_token * min(min_kv_tokens, m.max_context)

    def put(m: ModelProfile, share: float, candidates: list[str]) -> bool:
        fits = [i for i in candidates if tp_of[i] == m.tp and free[i] >= need(m) and m.name not in placed[i]]
        if not fits:
            return False
        best = min(fits, key=lambda i: (load[i], -free[i], i))
        placed[best].append(m.name)
        free[best] -= m.weight_bytes
        load[best] += share
        return True

    wanted: dict[str, int] = {}
    for tp in set(tp_of.values()):
        members = [m for m in models.values() if m.tp == tp]
        slots = sum(1 for t in tp_of.values() if t == tp)
        per_instance = sum(m.rate_rps for m in members) / slots if slots else 0.0
        for m in members:
            wanted[m.name] = max(1, min(slots, math.ceil(m.rate_rps / per_instance - 1e-9))) if per_instance else 1
    order = sorted(((m, k) for m in models.values() for k in range(wanted[m.name])),
                   key=lambda mk: (-mk[0].rate_rps / wanted[mk[0].name], mk[1], -mk[0].weight_bytes, mk[0].name))
    replicas = {m.name: 0 for m in models.values()}
    for m, _ in order:
        if put(m, m.rate_rps / wanted[m.name], list(placed)):
            replicas[m.name] += 1
    ranked = sorted(models.values(), key=lambda m: (-m.rate_rps, m.name))
    for _ in range(len(instances)):
        empty = [i for i, v in placed.items() if not v]
        if not empty:
            break
        for m in sorted((m for m in ranked if replicas[m.name]), key=lambda m: (-m.rate_rps / replicas[m.name], m.name)):
            if put(m, m.rate_rps / (replicas[m.name] + 1), empty):
                replicas[m.name] += 1
                break
        else:
            break
    return placed


class SpatialPolicy(PolicyBase):
    name: ClassVar[str] = "spatial"

    def __init__(self, models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec], costs: CostModel, *,
                 min_kv_tokens: int = 4096,
                 # PolicyBase's keywords spelled out, not **kwargs: mypyc miscompiles **kwargs beside int defaults
                 max_batch_size: int = 256, max_prefill_tokens: int = 8192,
                 chunked_prefill_tokens: int | None = None, keep_ended: bool = True) -> None:
        super().__init__(models, instances, costs, max_batch_size=max_batch_size, max_prefill_tokens=max_prefill_tokens,
                         chunked_prefill_tokens=chunked_prefill_tokens, keep_ended=keep_ended)
        self.placement = place_models(self.models, instances, min_kv_tokens)
        self.hosts: dict[str, list[str]] = {name: [] for name in self.models}
        for iid, names in self.placement.items():
            inst = self.instances[iid]
            inst.kv_capacity_bytes = kv_capacity(inst.spec, sum(self.models[n].weight_bytes for n in names))
            for name in names:
                self.hosts[name].append(iid)

    def kv_room(self, model: str) -> float:
        return max((self.instances[i].kv_capacity_bytes for i in self.hosts[model]), default=0.0)

    def _refuse(self, request: Request) -> str:
        if request.model in self.hosts and not self.hosts[request.model]:
            return f"spatial placement found no instance with memory for {request.model}"
        return super()._refuse(request)

    def _plan(self, now: float) -> dict[str, list[Action]]:
        out: dict[str, list[Action]] = {}
        for iid, names in self.placement.items():
            inst = self.instances[iid]
            if not inst.idle or not names:
                continue
            missing = [n for n in names if n not in inst.resident]
            if missing:
                inst.resident.update(missing)  # planned; weights stay for good
                out[iid] = [Switch(n, reason="co-locate at start", evict=False) for n in missing]
                continue
            acts = self.continuous_step(inst, names)
            if acts:
                out[iid] = acts
        for model, iids in self.hosts.items():
            victim = self.stop_to_admit(model, (self.instances[i] for i in iids))
            if victim is not None and victim.instance_id not in out:
                out[victim.instance_id] = [Stop(reason=f"admit queued {model} at the next token")]
        return out
