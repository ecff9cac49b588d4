"""`token-level`: Aegaeon's token-level auto-scaling (SOSP'25), as its artifact does it.

Prefill instances keep an FCFS list of *groups*, each holding at most
`max_group_size` (8) requests of one model. A dispatched request joins the
first group of its model with room, else opens a group at the tail; per-model
FIFO queues are drained oldest head first, each request going to an instance
that already has a group of its model with room, else to the least-loaded
one. An instance prefills the head of its head group (batched with the rest of
that group up to a token budget, a fair improvement), switching model when
the group's model is not loaded, and prefetches the model of the next group
with a different model. The prompt's KV then goes to host memory.

Decode instances take prefilled requests (one that already decodes the same
model first, else the one with the fewest models, then members) and run
*rounds*: members are packed FCFS into same-model batches that fit the device
KV; each batch gets a turn of `q_i / d_i` steps from `decode_quotas` (SLO
derived; c0 = the round's model switches plus its KV moves), after which its
KV moves to host if another batch waits, and the next batch's model is
switched in (prefetched during the turn). A round with one batch has no
quota: it decodes until a request finishes or a new member arrives.

A "mixed" instance (a pool too small to split) does both: pending prefills
run at round boundaries, then its decode rounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.costs import CostModel, InstanceSpec, ModelProfile
from scheduler.plan import Action, Decode, Event, Prefetch, Prefill, StepDone, Stop, SwapIn, SwapOut, Switch
from scheduler.policies.base import InstanceState, PolicyBase
from scheduler.quotas import decode_quotas
from scheduler.request import Request, RequestStatus

S = RequestStatus


@dataclass(slots=True)
class Group:
    model: str
    ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    model: str
    ids: list[str] = field(default_factory=list)
    kv_bytes: float = 0.0
    steps: int = 1


@dataclass(slots=True)
class DecodeState:
    members: dict[str, None] = field(default_factory=dict)  # FCFS ordered set
    batches: list[Batch] = field(default_factory=list)
    turn: int = -1  # index into batches of the turn in progress
    steps_left: int = 0
    open_ended: bool = False  # a sole batch, decoding until something happens
    new_round: bool = True  # repack before the next turn


class TokenLevelPolicy(PolicyBase):
    name = "token-level"

    def __init__(self, models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec], costs: CostModel, *,
                 max_group_size: int = 8, max_quota_s: float = 4.0, fixed_turn_steps: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(models, instances, costs, **kwargs)
        self.max_group_size = max_group_size
        self.max_quota_s = max_quota_s
        self.fixed_turn_steps = fixed_turn_steps  # test knob: every turn exactly this many steps
        self.groups: dict[str, list[Group]] = {}
        self.decoders: dict[str, DecodeState] = {}
        for inst in self.instances.values():
            if inst.spec.role in ("prefill", "mixed"):
                self.groups[inst.instance_id] = []
            if inst.spec.role in ("decode", "mixed"):
                self.decoders[inst.instance_id] = DecodeState()
        for model in self.models.values():
            roles = {i.spec.role for i in self.instances.values() if i.spec.tp == model.tp}
            if not ({"prefill", "mixed"} & roles and {"decode", "mixed"} & roles):
                raise ValueError(f"token-level needs prefill and decode instances of TP{model.tp} for {model.name}; "
                                 f"roles present: {sorted(roles) or 'none'}")

    def _kv_capacity(self, spec: InstanceSpec) -> float:
        # the device buffer holds KV | current model | prefetched model
        biggest = max((m.weight_bytes for m in self.models.values() if m.tp == spec.tp), default=0.0)
        return spec.memory_bytes - 2 * biggest

    # ---- planning --------------------------------------------------------------
    def _plan(self, now: float) -> dict[str, list[Action]]:
        self._dispatch_prefill()
        out: dict[str, list[Action]] = {}
        for iid, inst in self.instances.items():
            if inst.lost:
                continue
            if not inst.idle:
                if iid in self.decoders and self._should_stop(inst):
                    out[iid] = [Stop(reason="new decode work arrived during an open-ended turn")]
                continue
            acts: list[Action] = []
            if inst.spec.role == "prefill":
                acts = self._prefill_step(inst)
            elif inst.spec.role == "decode":
                acts = self._decode_step(inst)
            else:
                state = self.decoders[iid]
                if self.groups[iid] and (state.new_round or state.steps_left <= 0 or not state.batches):
                    acts = self._prefill_step(inst)
                acts = acts or self._decode_step(inst)
            if acts:
                out[iid] = acts
        return out

    def _dispatch_prefill(self) -> None:
        waiting = [m for m, q in self.queues.items() if q]
        while waiting:
            model = min(waiting, key=self._head_arrival)
            queue = self.queues[model]
            inst_id = self._pick_prefill_instance(model)
            if inst_id is None:  # every prefill instance of its TP is lost; wait for one
                waiting.remove(model)
                continue
            req = self.requests[queue.popleft()]
            if not queue:
                waiting.remove(model)
            groups = self.groups[inst_id]
            group = next((g for g in groups if g.model == model and len(g.ids) < self.max_group_size), None)
            if group is None:
                group = Group(model)
                groups.append(group)
            group.ids.append(req.request_id)
            req.instance_id = inst_id

    def _pick_prefill_instance(self, model: str) -> str | None:
        tp = self.models[model].tp
        candidates = [iid for iid in self.groups if not self.instances[iid].lost and self.instances[iid].spec.tp == tp]
        if not candidates:
            return None
        for iid in candidates:
            if any(g.model == model and len(g.ids) < self.max_group_size for g in self.groups[iid]):
                return iid
        return min(candidates, key=lambda i: (sum(len(g.ids) for g in self.groups[i]), i))

    def _prefill_step(self, inst: InstanceState) -> list[Action]:
        groups = self.groups[inst.instance_id]
        while groups and not groups[0].ids:
            groups.pop(0)
        if not groups:
            return []
        head = groups[0]
        acts: list[Action] = []
        if inst.on_device:  # a mixed instance: make room for prompts
            head_need = self.kv_need_bytes(self.requests[head.ids[0]])
            if head_need > inst.kv_free_bytes:
                acts.append(self._swap_out(inst, list(inst.on_device), "make room to prefill"))
        if inst.active != head.model:
            hit = " (prefetched)" if inst.prefetched == head.model else ""
            acts.append(Switch(head.model, reason=f"head group is {head.model}{hit}"))
            inst.active = head.model
        queue_view = _ListQueue(head.ids)
        batch = self.take_prefill_batch(inst, queue_view)  # type: ignore[arg-type]
        if not batch:
            return acts  # the head does not fit even an empty instance: _refuse prevents this
        if not head.ids:
            groups.pop(0)
        acts.append(Prefill(tuple(r.request_id for r in batch), kv_to_host=True,
                            reason=f"head group of {head.model}: {len(batch)} prompt(s)"))
        nxt = next((g.model for g in groups if g.model != head.model), None)
        if nxt is not None and inst.prefetched != nxt:
            acts.append(Prefetch(nxt, reason="model of the next group"))
            inst.prefetched = nxt
        return acts

    def _decode_step(self, inst: InstanceState) -> list[Action]:
        state = self.decoders[inst.instance_id]
        if 0 <= state.turn < len(state.batches) and state.steps_left > 0 and not state.new_round:
            batch = state.batches[state.turn]
            live = [rid for rid in batch.ids if self.requests[rid].status is S.RUNNING
                    and self.requests[rid].instance_id == inst.instance_id]
            if live:
                return [Decode(tuple(live), min(state.steps_left, self.decode_steps(live)),
                               reason=f"rest of {batch.model}'s turn")]
        for _ in range(len(state.batches) + 1):
            state.turn += 1
            if state.new_round or state.turn >= len(state.batches):
                self._new_round(inst, state)
                if not state.batches:
                    return []
            batch = state.batches[state.turn]
            batch.ids = [rid for rid in batch.ids if not self.requests[rid].done
                         and self.requests[rid].instance_id == inst.instance_id]
            if batch.ids:
                return self._start_turn(inst, state, batch)
        return []

    def _new_round(self, inst: InstanceState, state: DecodeState) -> None:
        state.new_round, state.turn, state.steps_left = False, 0, 0
        cap = inst.kv_capacity_bytes
        batches: list[Batch] = []
        open_batch: dict[str, Batch] = {}
        for rid in state.members:
            req = self.requests[rid]
            need = self.kv_need_bytes(req)
            batch = open_batch.get(req.model)
            if batch is None or batch.kv_bytes + need > cap or len(batch.ids) >= self.max_batch_size:
                batch = open_batch[req.model] = Batch(req.model)
                batches.append(batch)
            batch.ids.append(rid)
            batch.kv_bytes += need
        state.batches = batches
        state.open_ended = len(batches) == 1 and self.fixed_turn_steps is None
        if len(batches) > 1 and self.fixed_turn_steps is None:
            self._assign_quotas(batches)
        for batch in batches:
            if self.fixed_turn_steps is not None:
                batch.steps = self.fixed_turn_steps
            elif state.open_ended:
                batch.steps = self.decode_steps(batch.ids)

    def _assign_quotas(self, batches: list[Batch]) -> None:
        step_s, overhead_s = [], 0.0
        for index, batch in enumerate(batches):
            context = sum(self.requests[rid].context_tokens for rid in batch.ids)
            step_s.append(self.costs.decode_step_s(batch.model, len(batch.ids), context))
            if batches[index - 1].model != batch.model:
                overhead_s += self.costs.switch_s(batch.model)
            overhead_s += 2 * self.costs.kv_move_s(batch.model, context)
        tpot = min(self.models[b.model].tpot_slo_s for b in batches)
        for batch, quota, d in zip(batches, decode_quotas(step_s, tpot, overhead_s, self.max_quota_s), step_s):
            batch.steps = max(1, int(quota / d))

    def _start_turn(self, inst: InstanceState, state: DecodeState, batch: Batch) -> list[Action]:
        acts: list[Action] = []
        others = [rid for rid in inst.on_device if rid not in set(batch.ids)]
        if others:
            acts.append(self._swap_out(inst, others, f"turn passes to {batch.model}"))
        if inst.active != batch.model:
            hit = " (prefetched)" if inst.prefetched == batch.model else ""
            acts.append(Switch(batch.model, reason=f"turn {state.turn + 1}/{len(state.batches)} is {batch.model}{hit}"))
            inst.active = batch.model
        swap_in = [rid for rid in batch.ids if self.requests[rid].status is S.SWAPPED]
        for rid in swap_in:
            self._reserve(inst, self.requests[rid])
        if swap_in:
            acts.append(SwapIn(tuple(swap_in), reason=f"KV of {batch.model}'s batch"))
        state.steps_left = batch.steps
        kind = "open-ended" if state.open_ended else f"quota {batch.steps} steps"
        acts.append(Decode(tuple(batch.ids), min(batch.steps, self.decode_steps(batch.ids)),
                           reason=f"{batch.model} turn ({kind})"))
        nxt = state.batches[(state.turn + 1) % len(state.batches)].model
        if nxt != batch.model and inst.prefetched != nxt:
            acts.append(Prefetch(nxt, reason="model of the next turn"))
            inst.prefetched = nxt
        return acts

    def _swap_out(self, inst: InstanceState, ids: list[str], why: str) -> SwapOut:
        for rid in ids:
            self._release(self.requests[rid])
        return SwapOut(tuple(sorted(ids, key=lambda r: (self.requests[r].arrival_at, r))), reason=why)

    def _should_stop(self, inst: InstanceState) -> bool:
        state = self.decoders[inst.instance_id]
        return state.open_ended and inst.decoding and not inst.stopping and state.new_round

    # ---- events ----------------------------------------------------------------
    def _after_event(self, inst: InstanceState, event: Event, now: float) -> None:
        if not isinstance(event, StepDone):
            return
        if event.kind == "decode" and inst.instance_id in self.decoders:
            state = self.decoders[inst.instance_id]
            state.steps_left -= event.num_steps
        elif event.kind == "prefill":
            for rid in event.request_ids:
                req = self.requests[rid]
                if req.status is S.SWAPPED:
                    self._join_decoder(req)

    def _join_decoder(self, req: Request) -> None:
        tp = self.models[req.model].tp
        candidates = [iid for iid in self.decoders if self.instances[iid].spec.tp == tp and not self.instances[iid].lost]
        if not candidates:
            req.instance_id = None
            self._fail(req, f"no decode instance of TP{tp} left")
            return

        def key(iid: str) -> tuple[int, int, int, str]:
            members = self.decoders[iid].members
            same = sum(1 for rid in members if self.requests[rid].model == req.model)
            models = len({self.requests[rid].model for rid in members})
            return (0 if same else 1, models, len(members), iid)

        best = min(candidates, key=key)
        state = self.decoders[best]
        state.members[req.request_id] = None
        req.instance_id = best
        if state.open_ended or not state.batches:
            state.new_round = True  # join at once: the sole batch's turn is cut short

    def _forget(self, request: Request) -> None:
        iid = request.instance_id
        if iid is None:
            return
        if iid in self.decoders:
            self.decoders[iid].members.pop(request.request_id, None)
        if iid in self.groups:
            for group in self.groups[iid]:
                if request.request_id in group.ids:
                    group.ids.remove(request.request_id)
                    break

    def _lose(self, inst: InstanceState, why: str, now: float) -> None:
        super()._lose(inst, why, now)
        if inst.instance_id in self.groups:
            self.groups[inst.instance_id] = []
        if inst.instance_id in self.decoders:
            self.decoders[inst.instance_id] = DecodeState()


class _ListQueue:
    """The deque interface `take_prefill_batch` uses, over a group's list."""

    def __init__(self, items: list[str]) -> None:
        self.items = items

    def __bool__(self) -> bool:
        return bool(self.items)

    def __getitem__(self, index: int) -> str:
        return self.items[index]

    def popleft(self) -> str:
        return self.items.pop(0)
