"""`request-level`: models come and go per request, never mid-request.

Algorithm (ServerlessLLM, vLLM sleep mode + llama-swap, Ray Serve
multiplexing): an instance holds one model at a time. A queued request runs
on an instance that already holds its model and has KV room (continuous
batching there); otherwise, oldest head request first, a model is switched
onto a free instance (one with no running request): an empty one if any,
else the least recently used. A model is evicted only from an instance that
has no running request of it, so a busy model pins its instance until its
batch drains - the head-of-line blocking token-level scheduling removes.
"""

from __future__ import annotations

from typing import ClassVar

from scheduler.costs import kv_capacity
from scheduler.plan import Action, Prefill, Stop, Switch
from scheduler.policies.base import InstanceState, PolicyBase


class RequestLevelPolicy(PolicyBase):
    name: ClassVar[str] = "request-level"

    def _plan(self, now: float) -> dict[str, list[Action]]:
        out: dict[str, list[Action]] = {}
        holders: dict[str, list[InstanceState]] = {}
        for inst in self.instances.values():
            if inst.active is not None and not inst.lost:
                holders.setdefault(inst.active, []).append(inst)
        # 1. instances keep serving the model they hold
        for inst in self.instances.values():
            if inst.idle and inst.active is not None:
                acts = self.continuous_step(inst, (inst.active,))
                if acts:
                    out[inst.instance_id] = acts
        # 2. models still waiting: interrupt a holder with room, or switch a free instance over
        waiting = sorted(self.waiting_models(), key=self.head_arrival)
        for model in waiting:
            victim = self.stop_to_admit(model, holders.get(model, ()))
            if victim is not None:
                out[victim.instance_id] = [Stop(reason=f"admit queued {model} at the next token")]
                continue
            if any(i.idle for i in holders.get(model, ())):
                continue  # a holder is free but the head does not fit yet; wait for its KV
            free = self._free_instance(model, out)
            if free is None:
                continue
            inst = free
            if inst.active is not None:
                holders[inst.active].remove(inst)
            holders.setdefault(model, []).append(inst)
            inst.kv_capacity_bytes = kv_capacity(inst.spec, self.models[model].weight_bytes)
            why = "empty instance" if inst.active is None else f"evict LRU idle {inst.active}"
            inst.active = model  # planned; SwitchDone confirms
            switch: list[Action] = [Switch(model, reason=f"load {model} for queued requests ({why})")]
            out[inst.instance_id] = switch + [a for a in self.continuous_step(inst, (model,)) if isinstance(a, Prefill)]
        return out

    def kv_room(self, model: str) -> float:
        tp = self.models[model].tp
        return max((kv_capacity(i.spec, self.models[model].weight_bytes)
                    for i in self.instances.values() if i.spec.tp == tp), default=0.0)

    def _free_instance(self, model: str, planned: dict[str, list[Action]]) -> InstanceState | None:
        tp = self.models[model].tp
        free = [i for i in self.instances.values()
                if i.idle and i.spec.tp == tp and not i.on_device and i.instance_id not in planned]
        if not free:
            return None
        return min(free, key=lambda i: (i.active is not None, i.last_used_at, i.instance_id))
