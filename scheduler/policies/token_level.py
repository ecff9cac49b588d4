"""`token-level`: Aegaeon's token-level auto-scaling (SOSP'25), after its artifact, with fixes.

Prefill instances keep an FCFS list of *groups*, each holding at most
`max_group_size` (8) requests of one model. Per-model FIFO queues are drained
oldest head first; each request goes where its prefill is predicted to end
first: joining the first group of its model with room there, else a new group
at the tail, whose switch counts `1 + switch_aversion` times (the TTFT SLO
leaves room to wait for a loaded model rather than spend PCIe time). An
instance prefills its head group (batched up to a token budget), switching
when the group's model is not loaded, and prefetches the next group's model
while it computes. The prompt's KV then goes to host memory; with
`first_tokens` > 1 the prefill instance first decodes that many tokens, where
weights and KV already are, so the hand-off hides behind time banked against
the TPOT SLO (short answers finish there).

Decode instances take each prefilled request where it adds least to the sum
of batch step times (the share of every TPOT period the instance decodes),
a model not yet held there counting its switch spread over `round_target_s`.
Members form same-model batches that fit the device KV. At each turn
boundary the batch *due first* goes (earliest next-token deadline: first
token + tokens so far * TPOT SLO), for `q_i / d_i` steps from
`decode_quotas` (SLO derived; c0 = the waiting models' switches plus the KV
moves that cannot be avoided), while the next batch's model is prefetched.
KV moves to host only to make room. A newcomer of the running batch's model
joins it at the next token; one of another model waits for the turn boundary.
A sole batch decodes open-ended until something else needs the instance.

What differs from the artifact, and why (measured on the shipped fleet, see
BENCHMARKS.md): rounds fixed at their start made a newcomer wait for the round
to end (up to Q_max per batch), failing the mean TPOT of short answers, so
turns go to the batch due first and a newcomer joins a running turn of its
model; prompts of a busy model all went to the first instance holding a group
of it, so dispatch predicts finish times; a Prefetch planned after the compute
it should overlap started when that compute ended, so it comes first; a mixed
instance moved each prompt's KV to host and back. `max_quota_s` is 2 s
(the paper's Q_max is 4 s); `first_tokens` is 8 (the artifact hands off after
the first token; 1 restores that). A quota turn lasts at least `min_turn_tpot`
(1) TPOT SLO periods of the round (0 restores the formula alone): with alpha
floored at 0.5 and a small c0 (two small models, both held in the two weight
slots) the formula gives turns of 2-4 steps, each a switch and a round trip to
the scheduler in the live pool, which bought nothing - the floor leaves SLO
attainment as it was and lowers mean TPOT and p99 ITL, as switches (and the KV
moves of crowded instances) get rarer (BENCHMARKS.md, "Simulator speed").
The floor only lengthens short turns: each batch still gets at least
TPOT/d_i tokens per turn, so with k batches in a round, floored turns keep
every batch's pace while its step takes at most 1/k of a TPOT period.

A "mixed" instance (for classes too small to split well) does both and keeps
a prompt's KV where it was prefilled: at a turn boundary it prefills its head
group unless a decode batch is behind its pace and the group can still wait
(more than half its TTFT SLO left); a prompt arriving ends an open-ended turn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Final

from scheduler.costs import CostModel, InstanceSpec, ModelProfile, kv_capacity
from scheduler.plan import Action, Decode, Event, KvMoved, Prefetch, Prefill, StepDone, Stop, SwapIn, SwapOut, Switch
from scheduler.policies.base import InstanceState, PolicyBase
from scheduler.quotas import first_decode_quota
from scheduler.request import RUNNING, SWAPPED, Request

_INF: Final = float("inf")


@dataclass(slots=True, init=False)
class Group:
    model: str
    ids: list[str]

    def __init__(self, model: str, ids: list[str] | None = None) -> None:  # written out: compiled, it is native
        self.model, self.ids = model, [] if ids is None else ids


@dataclass(slots=True, init=False)
class Batch:
    model: str
    ids: list[str]
    kv_bytes: float
    steps: int

    def __init__(self, model: str, ids: list[str] | None = None, kv_bytes: float = 0.0, steps: int = 1) -> None:
        self.model, self.ids, self.kv_bytes, self.steps = model, [] if ids is None else ids, kv_bytes, steps


@dataclass(slots=True)
class DecodeState:
    members: dict[str, None] = field(default_factory=dict)  # FCFS ordered set
    current: Batch | None = None  # the batch whose turn is in progress
    next_model: str | None = None  # the model due after it (prefetched)
    steps_left: int = 0
    open_ended: bool = False  # a sole batch, decoding until something happens
    cut_in: bool = False  # a newcomer joined the batch whose turn runs: stop it at the next token
    preempt: bool = False  # another model's newcomer (or a prompt, on a mixed instance) ends an open-ended turn
    mix: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # model -> members, context estimate, step s
    load_s: float = 0.0  # sum of the step times in `mix`: the dispatcher's load figure
    packed: list[Batch] | None = None  # `_pack`'s answer until the members change (read-only: a turn copies one)


class TokenLevelPolicy(PolicyBase):
    name: ClassVar[str] = "token-level"

    def __init__(self, models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec], costs: CostModel, *,
                 max_group_size: int = 8, max_quota_s: float = 2.0, round_target_s: float = 0.5,
                 switch_aversion: float = 1.0, first_tokens: int = 8, min_turn_tpot: float = 1.0,
                 fixed_turn_steps: int | None = None,
                 # PolicyBase's keywords spelled out, not **kwargs: mypyc miscompiles **kwargs beside int defaults
                 max_batch_size: int = 256, max_prefill_tokens: int = 8192,
                 chunked_prefill_tokens: int | None = None, keep_ended: bool = True) -> None:
        super().__init__(models, instances, costs, max_batch_size=max_batch_size, max_prefill_tokens=max_prefill_tokens,
                         chunked_prefill_tokens=chunked_prefill_tokens, keep_ended=keep_ended)
        self.max_group_size = max_group_size
        self.max_quota_s = max_quota_s
        self.round_target_s = round_target_s
        self.switch_aversion = switch_aversion
        self.first_tokens = first_tokens
        if min_turn_tpot < 0:
            raise ValueError(f"min_turn_tpot must be >= 0 (TPOT SLO periods), got {min_turn_tpot}")
        self.min_turn_tpot = min_turn_tpot
        self.fixed_turn_steps = fixed_turn_steps  # test knob: every turn exactly this many steps
        self.full_scan = False  # test knob: plan every instance, not only touched ones (the plans must be identical)
        # _plan reads `now` only for idle instances and, on a busy one, plans a Stop only after news that sets
        # cut_in/preempt; a SwitchDone or KvMoved that leaves its instance busy enables nothing else, except a
        # hand-off's KvMoved placing requests on a decode instance, which _join marks as news
        self.skip_quiet_schedules = True
        self.groups: dict[str, list[Group]] = {}
        self.busy_until: dict[str, float] = {}  # prefill instance -> predicted end of its planned work
        self.first_token_at: dict[str, float] = {}  # request -> when its prefill (first token) ended
        self.handoff: dict[str, tuple[str, list[str]]] = {}  # prefill instance -> ("decode" | "move", requests)
        self.decoders: dict[str, DecodeState] = {}
        self._rank = {iid: k for k, iid in enumerate(self.instances)}
        self._ids = list(self.instances)  # by rank
        self._prefillers: dict[int, list[InstanceState]] = {}  # prefill and mixed instances per TP, in order
        self._decoders_by_tp: dict[int, list[InstanceState]] = {}  # decode and mixed instances per TP, in order
        for inst in self.instances.values():
            if inst.spec.role in ("prefill", "mixed"):
                self.groups[inst.instance_id] = []
                self._prefillers.setdefault(inst.spec.tp, []).append(inst)
            if inst.spec.role in ("decode", "mixed"):
                self.decoders[inst.instance_id] = DecodeState()
                self._decoders_by_tp.setdefault(inst.spec.tp, []).append(inst)
        for model in self.models.values():
            roles = {i.spec.role for i in self.instances.values() if i.spec.tp == model.tp}
            if not ({"prefill", "mixed"} & roles and {"decode", "mixed"} & roles):
                raise ValueError(f"token-level needs prefill and decode instances of TP{model.tp} for {model.name}; "
                                 f"roles present: {sorted(roles) or 'none'}")

    def _kv_capacity(self, spec: InstanceSpec) -> float:
        # the device buffer holds KV | current model | prefetched model
        biggest = max((m.weight_bytes for m in self.models.values() if m.tp == spec.tp), default=0.0)
        return kv_capacity(spec, 2 * biggest)

    # ---- planning --------------------------------------------------------------
    def _plan(self, now: float) -> dict[str, list[Action]]:
        if self._queued_news:
            self._queued_news = False
            self._dispatch_prefill(now)
        # Only touched instances can plan something (see PolicyBase.touch); planning one instance changes no
        # other instance's state, so the others' plans would be empty. `full_scan` plans every instance.
        touched, self._touched = self._touched, set()
        if self.full_scan or len(touched) == len(self.instances):
            order = list(self.instances)
        elif len(touched) < 2:
            order = list(touched)
        else:  # in instance order: by rank, sorted as plain ints (a key function costs a call per id)
            rank, ids = self._rank, self._ids
            ranks = [rank[iid] for iid in touched]
            ranks.sort()
            order = [ids[k] for k in ranks]
        out: dict[str, list[Action]] = {}
        for iid in order:
            inst = self.instances[iid]
            if inst.lost:
                continue
            if not inst.idle:
                if iid in self.decoders and self._should_stop(inst):
                    cut_in = self.decoders[iid].cut_in
                    out[iid] = [Stop(reason="a newcomer joins the running batch" if cut_in else "another batch is due")]
                    self._touched.add(iid)
                continue
            acts: list[Action] = []
            if inst.spec.role == "prefill":
                acts = self._prefill_step(inst)
            elif inst.spec.role == "decode":
                acts = self._decode_step(inst)
            else:
                state = self.decoders[iid]
                if self.groups[iid] and (state.current is None or state.steps_left <= 0) \
                        and self._prefill_first(inst, state, now):
                    acts = self._prefill_step(inst)
                acts = acts or self._decode_step(inst) or self._prefill_step(inst)
            if acts:
                out[iid] = acts
                self._touched.add(iid)  # a plan may go on from the state it leaves
                if iid in self.groups:
                    self.busy_until[iid] = now + self._predict_s(inst, acts)
        return out

    def _dispatch_prefill(self, now: float) -> None:
        queues = self.queues
        waiting = self.waiting_models()
        stuck: list[str] = []
        ends: dict[str, list[float]] = {}  # per prefill instance, predicted end of each queued group
        while waiting:
            model = waiting[0] if len(waiting) == 1 else min(waiting, key=self._head_arrival)
            queue = queues[model]
            req = self.requests[queue[0]]
            choice = self._pick_prefill_instance(req, now, ends)
            if choice is None:  # every prefill instance of its TP is lost; wait for one (InstanceAdded)
                waiting.remove(model)
                stuck.append(model)
                continue
            inst_id, group = choice
            queue.popleft()
            if not queue:
                waiting.remove(model)
            if group is None:
                group = Group(model)
                self.groups[inst_id].append(group)
            group.ids.append(req.request_id)
            req.instance_id = inst_id
            self._touched.add(inst_id)
            ends.pop(inst_id, None)
            state = self.decoders.get(inst_id)
            if state is not None and state.open_ended:  # a mixed instance: let the turn boundary weigh the prompt
                state.preempt, state.steps_left = True, 0
        self.queued_models = {m: None for m in stuck}  # every other queue is empty now

    def _pick_prefill_instance(self, req: Request, now: float,
                               ends: dict[str, list[float]]) -> tuple[str, Group | None] | None:
        """The instance (and group to join, None = a new one at the tail) where `req`'s prefill is predicted
        to finish first: joining a group of its model saves a switch, a shorter queue saves waiting."""
        model = req.model
        own_s = self.costs.prefill_s(model, req.context_tokens)
        best_at, best_id, best_group = _INF, None, None  # the earliest end, ties to the first instance
        for inst in self._prefillers.get(self.models[model].tp, []):
            if inst.lost:
                continue
            iid = inst.instance_id
            groups = self.groups[iid]
            inst_ends = ends.get(iid)
            if inst_ends is None:
                inst_ends = ends[iid] = self._group_ends(inst, now)
            index = -1
            for k, candidate in enumerate(groups):
                if candidate.model == model and len(candidate.ids) < self.max_group_size:
                    index = k
                    break
            if index >= 0:
                done_at, group = inst_ends[index] + own_s, groups[index]
            else:
                tail_model = inst.active
                for candidate in reversed(groups):
                    if candidate.ids:
                        tail_model = candidate.model
                        break
                tail_at = inst_ends[-1] if inst_ends else max(now, self.busy_until.get(iid, now))
                free = tail_model == model or (not groups and inst.prefetched == model)
                switch_s = 0.0 if free else self.costs.switch_s(model)
                done_at, group = tail_at + (1.0 + self.switch_aversion) * switch_s + own_s, None
            if best_id is None or done_at < best_at:
                best_at, best_id, best_group = done_at, iid, group
        return None if best_id is None else (best_id, best_group)

    def _group_ends(self, inst: InstanceState, now: float) -> list[float]:
        """Predicted finish of each queued group (a switch is hidden as far as the previous prefill lasts)."""
        t = max(now, self.busy_until.get(inst.instance_id, now))
        model, previous_s, out = inst.active, 0.0, []
        for group in self.groups[inst.instance_id]:
            if group.ids:
                if group.model != model:
                    t += max(0.0, self.costs.switch_s(group.model) - previous_s)
                    model = group.model
                tokens = 0
                for rid in group.ids:
                    tokens += self.requests[rid].context_tokens
                previous_s = self.costs.prefill_s(group.model, tokens, len(group.ids))
                t += previous_s
            out.append(t)
        return out

    def _predict_s(self, inst: InstanceState, acts: list[Action]) -> float:
        """Predicted time the planned actions keep an instance busy (prefetches overlap)."""
        took = 0.0
        for act in acts:
            if isinstance(act, Switch):
                took += self.costs.switch_s(act.model)
            elif isinstance(act, Prefill):
                for rid in act.request_ids:
                    req = self.requests[rid]
                    took += self.costs.prefill_s(req.model, req.context_tokens)
            elif isinstance(act, Decode):
                ctx = sum(self.requests[rid].context_tokens for rid in act.request_ids)
                took += act.max_steps * self.costs.decode_step_s(self.requests[act.request_ids[0]].model,
                                                                 len(act.request_ids), ctx)
        return took

    def _prefill_step(self, inst: InstanceState) -> list[Action]:
        acts = self._hand_off(inst)
        if acts and isinstance(acts[0], Decode):
            return acts
        groups = self.groups[inst.instance_id]
        while groups and not groups[0].ids:
            groups.pop(0)
        if not groups:
            return acts
        head = groups[0]
        if inst.on_device and inst.spec.role == "mixed":  # make room for prompts
            head_need = self.kv_need_bytes(self.requests[head.ids[0]])
            if head_need > inst.kv_free_bytes:
                state = self.decoders[inst.instance_id]
                out = self._evictees(inst, state, set(), head_need - inst.kv_free_bytes)
                acts.append(self._swap_out(inst, out, "make room to prefill"))
        acts += self._use(inst, head.model, f"head group is {head.model}")
        queue_view = _ListQueue(head.ids)
        batch = self.take_prefill_batch(inst, queue_view)  # type: ignore[arg-type]
        if not batch:
            return acts  # the head does not fit even an empty instance: _refuse prevents this
        if not head.ids:
            groups.pop(0)
        nxt = next((g.model for g in groups if g.model != head.model), None)
        acts += self._prefetch(inst, nxt, "model of the next group")  # before the prefill: the copy overlaps it
        ids = tuple(r.request_id for r in batch)
        going_on = [r.request_id for r in batch if r.max_output_tokens > 1]
        if inst.spec.role == "mixed":  # the KV stays: this instance decodes it (see _after_event)
            acts.append(Prefill(ids, reason=f"head group of {head.model}: {len(batch)} prompt(s)"))
        elif self.first_tokens <= 1 or not going_on:
            acts.append(Prefill(ids, kv_to_host=True, reason=f"head group of {head.model}: {len(batch)} prompt(s)"))
        else:  # the KV stays for the first tokens (see _hand_off)
            acts.append(Prefill(ids, reason=f"head group of {head.model}: {len(batch)} prompt(s); "
                                            f"first {self.first_tokens} tokens here"))
            self.handoff[inst.instance_id] = ("decode", going_on)
        return acts

    def _hand_off(self, inst: InstanceState) -> list[Action]:
        """After a prefill that kept its KV: decode the first tokens where weights and KV already are, then
        (in the next plan, which may go on to the next prompts) move the KV to host for a decode instance.
        The time those tokens bank against the TPOT SLO hides the hand-off."""
        pending = self.handoff.get(inst.instance_id)
        if pending is None:
            return []
        del self.handoff[inst.instance_id]
        stage, ids = pending
        live = [rid for rid in ids if rid in self.requests and self.requests[rid].status is RUNNING]
        if not live:
            return []
        if stage == "decode":
            ids_now = tuple(live)
            steps = min(self.first_tokens - 1, self.decode_steps(ids_now))
            self.handoff[inst.instance_id] = ("move", live)
            return [Decode(ids_now, steps, reason=f"first {steps + 1} tokens before the hand-off")]
        return [self._swap_out(inst, live, "hand the KV over to a decode instance")]

    def _decode_step(self, inst: InstanceState) -> list[Action]:
        state = self.decoders[inst.instance_id]
        state.cut_in = state.preempt = False
        batch = state.current
        if batch is not None and state.steps_left > 0:
            batch.ids = self._live(inst, batch.ids)
            if batch.ids:
                return self._run_turn(inst, state, batch, f"rest of {batch.model}'s turn")
        state.current = None
        batches = self._pack(inst, state)
        if not batches:
            return []
        if len(batches) > 1:
            batches = self._by_due(batches)
        first = batches[0]
        batch = state.current = Batch(first.model, list(first.ids), first.kv_bytes)
        state.open_ended = len(batches) == 1 and self.fixed_turn_steps is None
        if self.fixed_turn_steps is not None:
            batch.steps = self.fixed_turn_steps
        elif state.open_ended:
            batch.steps = self.decode_steps(tuple(batch.ids))
        else:
            batch.steps = self._first_quota_steps(inst, batches)
        state.steps_left = batch.steps
        state.next_model = batches[1].model if len(batches) > 1 else None
        kind = "open-ended" if state.open_ended else f"quota {batch.steps} steps"
        return self._run_turn(inst, state, batch, f"{batch.model} turn ({kind}), due first of {len(batches)}",
                              f"{batch.model}'s batch is due first")

    def _live(self, inst: InstanceState, ids: list[str]) -> list[str]:
        requests, iid = self.requests, inst.instance_id
        live = []
        for rid in ids:
            req = requests.get(rid)
            if req is not None and not req.done and req.instance_id == iid:
                live.append(rid)
        return live

    def _pack(self, inst: InstanceState, state: DecodeState) -> list[Batch]:
        """Members in same-model batches (FCFS within a model) that each fit the device KV; kept until the
        members change, so the batches are read-only."""
        if state.packed is not None:
            return state.packed
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
        state.packed = batches
        return batches

    def _by_due(self, batches: list[Batch]) -> list[Batch]:
        """`batches` sorted by `_due_at`, stably (an insertion sort on plain floats: a round has a few batches)."""
        dues: list[float] = []
        out: list[Batch] = []
        for batch in batches:
            due = self._due_at(batch)
            k = len(out)
            while k > 0 and dues[k - 1] > due:
                k -= 1
            dues.insert(k, due)
            out.insert(k, batch)
        return out

    def _due_at(self, batch: Batch) -> float:
        """When the batch's most pressed member owes its next token: first token + tokens so far * TPOT SLO."""
        tpot = self.models[batch.model].tpot_slo_s
        requests, first_token_at = self.requests, self.first_token_at
        due = _INF
        for rid in batch.ids:
            at = first_token_at.get(rid, 0.0) + requests[rid].num_output_tokens * tpot
            if at < due:
                due = at
        return due

    def _first_quota_steps(self, inst: InstanceState, batches: list[Batch]) -> int:
        """The first batch's turn length from `decode_quotas` over the batches waiting now; c0 counts their
        switches and the KV moves that cannot be avoided (none when every batch's KV fits the device together).
        The turn lasts at least `min_turn_tpot` TPOT SLO periods (see the module docstring)."""
        costs, requests = self.costs, self.requests
        step_s: list[float] = []
        contexts: list[int] = []
        kv_bytes = 0.0
        tpot = _INF
        for batch in batches:
            context = 0
            for rid in batch.ids:
                context += requests[rid].context_tokens
            contexts.append(context)
            step_s.append(costs.decode_step_s(batch.model, len(batch.ids), context))
            kv_bytes += batch.kv_bytes
            tpot = min(tpot, self.models[batch.model].tpot_slo_s)
        switch_s = 0.0
        seen: list[str] = []  # each model once, in batch order (a set's would follow string hashes: sums could differ)
        for batch in batches:
            if batch.model not in seen:
                seen.append(batch.model)
                switch_s += costs.switch_s(batch.model)
        move_s = 0.0
        if kv_bytes > inst.kv_capacity_bytes:  # each batch's KV goes out and comes back once a round
            for batch, context in zip(batches, contexts):
                move_s += 2 * costs.kv_move_s(batch.model, context)
        quota = first_decode_quota(step_s, tpot, switch_s + move_s, self.max_quota_s)
        return max(max(1, int(quota / step_s[0])), math.ceil(self.min_turn_tpot * tpot / step_s[0]))  # 2-arg max: native

    def _run_turn(self, inst: InstanceState, state: DecodeState, batch: Batch, why: str,
                  switch_why: str = "") -> list[Action]:
        """Swap in what the batch lacks (moving out only what must make room), switch, prefetch, decode."""
        acts: list[Action] = []
        requests = self.requests
        swap_in: list[Request] = []
        need = 0.0
        for rid in batch.ids:
            req = requests[rid]
            if req.status is SWAPPED:
                swap_in.append(req)
                need += self.kv_need_bytes(req)
        if need > inst.kv_free_bytes:
            out = self._evictees(inst, state, set(batch.ids), need - inst.kv_free_bytes)
            acts.append(self._swap_out(inst, out, f"make room for {batch.model}'s batch"))
        acts += self._use(inst, batch.model, switch_why or f"{batch.model}'s turn")
        for req in swap_in:
            self._reserve(inst, req)
        if swap_in:
            acts.append(SwapIn(tuple([r.request_id for r in swap_in]), reason=f"KV of {batch.model}'s batch"))
        acts += self._prefetch(inst, state.next_model, "model of the batch due next")  # the copy overlaps the turn
        ids = tuple(batch.ids)
        acts.append(Decode(ids, min(state.steps_left, self.decode_steps(ids)), reason=why))
        return acts

    def _evictees(self, inst: InstanceState, state: DecodeState, keep: set[str], free_bytes: float) -> list[str]:
        """Device-resident requests to move to host, latest due first, until enough is free."""
        tpot = {rid: self.models[self.requests[rid].model].tpot_slo_s for rid in inst.on_device}
        order = sorted((rid for rid in inst.on_device if rid not in keep),
                       key=lambda r: (-(self.first_token_at.get(r, 0.0) + self.requests[r].num_output_tokens * tpot[r]), r))
        out: list[str] = []
        for rid in order:
            if free_bytes <= 0:
                break
            out.append(rid)
            free_bytes -= self.requests[rid].kv_reserved_bytes
        return out

    def _swap_out(self, inst: InstanceState, ids: list[str], why: str) -> SwapOut:
        for rid in ids:
            self._release(self.requests[rid])
        if len(ids) > 1:
            ids = sorted(ids, key=self._fcfs_key)
        return SwapOut(tuple(ids), reason=why)

    def _use(self, inst: InstanceState, model: str, why: str) -> list[Action]:
        """Make `model` current: a Switch unless it already is (free when it was prefetched in time)."""
        if inst.active == model:
            return []
        hit = " (prefetched)" if inst.prefetched == model else ""
        inst.active = model
        return [Switch(model, reason=why + hit)]

    def _prefetch(self, inst: InstanceState, model: str | None, why: str) -> list[Action]:
        """Copy the next model into the spare slot while the planned compute runs (placed before it)."""
        if model is None or model == inst.active or inst.prefetched == model:
            return []
        inst.prefetched = model
        return [Prefetch(model, reason=why)]

    def _should_stop(self, inst: InstanceState) -> bool:
        state = self.decoders[inst.instance_id]
        return inst.decoding and not inst.stopping and (state.cut_in or state.preempt)

    # ---- events ----------------------------------------------------------------
    def _after_event(self, inst: InstanceState, event: Event, now: float) -> None:
        if isinstance(event, KvMoved):
            if event.to == "host" and inst.spec.role == "prefill":  # the hand-off after the first tokens
                for rid in event.request_ids:
                    req = self.requests.get(rid)
                    if req is not None and req.status is SWAPPED:
                        self._join_decoder(req)
            return
        if not isinstance(event, StepDone):
            return
        if event.kind == "decode" and inst.instance_id in self.decoders:
            state = self.decoders[inst.instance_id]
            state.steps_left -= event.num_steps
        elif event.kind == "prefill":
            for rid in event.request_ids:
                req = self.requests.get(rid)
                if req is None:
                    continue  # ended and forgotten (keep_ended=False)
                if not req.done:
                    self.first_token_at[rid] = now
                if req.status is SWAPPED:
                    self._join_decoder(req)
                elif req.status is RUNNING and inst.spec.role == "mixed":
                    self._join(inst, req)

    def _join_decoder(self, req: Request) -> None:
        """Place a prefilled request on the decode instance of its TP where it adds least load (ties by id)."""
        tp, model = self.models[req.model].tp, req.model
        estimate = self._context_estimate(req)
        # the load it adds where its model is not held yet: the same on every such instance
        fresh = self.costs.decode_step_s(model, 1, estimate), \
            self.costs.switch_s(model) * self.models[model].tpot_slo_s / self.round_target_s
        best_load, best_id = _INF, None  # the least load, ties to the smallest id (compared by hand: no tuples)
        for inst in self._decoders_by_tp.get(tp, []):
            if inst.lost:
                continue
            iid = inst.instance_id
            load = self._decode_load_after(self.decoders[iid], model, estimate, fresh)
            if best_id is None or load < best_load or (load == best_load and iid < best_id):
                best_load, best_id = load, iid
        if best_id is None:
            req.instance_id = None
            self._fail(req, f"no decode instance of TP{tp} left")
            return
        self._join(self.instances[best_id], req)

    def _join(self, inst: InstanceState, req: Request) -> None:
        self._touched.add(inst.instance_id)
        self._dirty = True  # news even when it comes with a quiet event (the hand-off's KvMoved)
        state = self.decoders[inst.instance_id]
        state.members[req.request_id] = None
        state.packed = None
        self._mix_update(state, req, +1)
        req.instance_id = inst.instance_id
        self._admit(inst, state, req)

    def _prefill_first(self, inst: InstanceState, state: DecodeState, now: float) -> bool:
        """A mixed instance at a turn boundary: prefill unless a decode batch is behind its pace and the head
        group's prompts can still wait (more than half their TTFT SLO left after the predicted prefill)."""
        head = next((g for g in self.groups[inst.instance_id] if g.ids), None)
        if head is None:
            return False
        reqs = [self.requests[rid] for rid in head.ids]
        ttft = self.models[head.model].ttft_slo_s
        start_by = min(r.arrival_at for r in reqs) + ttft - self.costs.prefill_s(
            head.model, sum(r.context_tokens for r in reqs), len(reqs))
        if start_by - now <= ttft / 2:
            return True
        batches = self._pack(inst, state)
        return not batches or min(map(self._due_at, batches)) > now

    def _decode_load_after(self, state: DecodeState, model: str, estimate: int, fresh: tuple[float, float]) -> float:
        """Decode instance choice: the sum of its batches' step times once a request of `model` joins (the share
        of each TPOT period it decodes), plus, for a model it does not hold yet, the switch that adds to every
        round; `fresh` is (step time, switch share) of a model new to the instance."""
        held = state.mix.get(model)
        if held is None:
            return state.load_s + fresh[0] + fresh[1]
        count, context, step_s = held
        return state.load_s + (self.costs.decode_step_s(model, count + 1, context + estimate) - step_s)

    @staticmethod
    def _context_estimate(req: Request) -> int:
        return req.prompt_tokens + req.max_output_tokens // 2

    def _mix_update(self, state: DecodeState, req: Request, sign: int) -> None:
        count, context, step_s = state.mix.get(req.model, (0, 0, 0.0))
        count, context = count + sign, context + sign * self._context_estimate(req)
        new_s = self.costs.decode_step_s(req.model, int(count), int(context)) if count > 0 else 0.0
        state.load_s += new_s - step_s
        if count > 0:
            state.mix[req.model] = (count, context, new_s)
        else:
            state.mix.pop(req.model, None)

    def _admit(self, inst: InstanceState, state: DecodeState, req: Request) -> None:
        """A newcomer of the model whose turn runs joins it at the next token; one of another model ends an
        open-ended turn (else it waits for the next turn boundary, where the batch due first goes)."""
        batch = state.current
        if batch is None or self.fixed_turn_steps is not None:
            return
        need = self.kv_need_bytes(req)
        if batch.model == req.model and batch.kv_bytes + need <= inst.kv_capacity_bytes \
                and len(batch.ids) < self.max_batch_size and state.steps_left > 0:
            batch.ids.append(req.request_id)
            batch.kv_bytes += need
            state.cut_in = True
        elif state.open_ended:
            state.preempt = True
            state.steps_left = 0

    def _forget(self, request: Request) -> None:
        self.first_token_at.pop(request.request_id, None)
        iid = request.instance_id
        if iid is None:
            return
        self._touched.add(iid)
        if iid in self.decoders and request.request_id in self.decoders[iid].members:
            state = self.decoders[iid]
            del state.members[request.request_id]
            state.packed = None
            self._mix_update(state, request, -1)
        if iid in self.groups:
            for group in self.groups[iid]:
                if request.request_id in group.ids:
                    group.ids.remove(request.request_id)
                    break

    def _lose(self, inst: InstanceState, why: str, now: float) -> None:
        super()._lose(inst, why, now)
        if inst.instance_id in self.groups:
            self.groups[inst.instance_id] = []
            self.handoff.pop(inst.instance_id, None)
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
