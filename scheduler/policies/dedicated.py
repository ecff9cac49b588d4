"""`dedicated`: every model owns its instances; nothing ever switches.

Algorithm: at start each model is given `replicas[model]` instances of its TP
size (by default one each, spare instances going to the model with the most
traffic per replica). Each instance loads its model once and runs vLLM-style
continuous batching: queued prompts are admitted FCFS when their KV fits
(prefill first), otherwise the running batch decodes. A decoding instance is
stopped at the next token boundary when a queued request of its model fits.
This is per-model allocation, the baseline the capacity report compares with.

With `chunked_prefill_tokens` the batching is Sarathi-Serve's (Agrawal et al.,
OSDI'24) instead: each iteration decodes every running request and fills the
rest of its token budget with prompt chunks (see `PolicyBase.chunked_step`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from scheduler.costs import CostModel, InstanceSpec, ModelProfile, kv_capacity
from scheduler.plan import Action, Stop, Switch
from scheduler.policies.base import PolicyBase


def assign_replicas(models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec],
                    replicas: Mapping[str, int] | None = None) -> dict[str, str]:
    """instance_id -> model: each model its replicas, on instances of its TP size."""
    by_tp: dict[int, list[str]] = {}
    for spec in instances:
        by_tp.setdefault(spec.tp, []).append(spec.instance_id)
    want = {name: (replicas or {}).get(name, 1) for name in models}
    out: dict[str, str] = {}
    for tp, free in sorted(by_tp.items()):
        names = sorted((n for n in models if models[n].tp == tp), key=lambda n: (-models[n].rate_rps, n))
        if sum(want[n] for n in names) > len(free):
            raise ValueError(f"dedicated needs {sum(want[n] for n in names)} TP{tp} instances for "
                             f"{len(names)} models; the pool has {len(free)}")
        count = {n: 0 for n in names}
        for name in names:
            for _ in range(want[name]):
                out[free.pop(0)] = name
                count[name] += 1
        while free and names and replicas is None:  # spare instances to the busiest per replica
            name = max(names, key=lambda n: (models[n].rate_rps / count[n], n))
            out[free.pop(0)] = name
            count[name] += 1
    missing = [n for n in models if n not in out.values()]
    if missing:
        raise ValueError(f"dedicated: no instance of the right TP size for {', '.join(missing)}")
    return out


class DedicatedPolicy(PolicyBase):
    name: ClassVar[str] = "dedicated"
    supports_chunked_prefill: ClassVar[bool] = True

    def __init__(self, models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec], costs: CostModel, *,
                 replicas: Mapping[str, int] | None = None,
                 # PolicyBase's keywords spelled out, not **kwargs: mypyc miscompiles **kwargs beside int defaults
                 max_batch_size: int = 256, max_prefill_tokens: int = 8192,
                 chunked_prefill_tokens: int | None = None, keep_ended: bool = True) -> None:
        super().__init__(models, instances, costs, max_batch_size=max_batch_size, max_prefill_tokens=max_prefill_tokens,
                         chunked_prefill_tokens=chunked_prefill_tokens, keep_ended=keep_ended)
        self.skip_quiet_schedules = True  # _plan reads only state, plans only idle instances
        self.owner = assign_replicas(self.models, instances, replicas)
        self.serving: dict[str, list[str]] = {}
        for iid, model in self.owner.items():
            self.serving.setdefault(model, []).append(iid)
            inst = self.instances[iid]
            inst.kv_capacity_bytes = kv_capacity(inst.spec, self.models[model].weight_bytes)

    def kv_room(self, model: str) -> float:
        return max(self.instances[i].kv_capacity_bytes for i in self.serving[model])

    def _plan(self, now: float) -> dict[str, list[Action]]:
        out: dict[str, list[Action]] = {}
        queues, instances = self.queues, self.instances
        for iid, model in self.owner.items():
            inst = instances[iid]
            if not inst.idle:
                continue
            if inst.active != model:
                out[iid] = [Switch(model, reason="load the instance's own model")]
                continue
            if not inst.on_device and not queues[model]:
                continue  # nothing to run or admit (the common case in a large pool)
            acts = self.continuous_step(inst, (model,))
            if acts:
                out[iid] = acts
        for model, iids in self.serving.items():
            if not queues[model]:
                continue
            victim = self.stop_to_admit(model, map(instances.__getitem__, iids))
            if victim is not None:
                out[victim.instance_id] = [Stop(reason=f"admit queued {model} at the next token")]
        return out
