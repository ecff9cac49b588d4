"""token-level's prefill side: which prefill instance takes each prompt, and what it runs next.

Prefill (and mixed) instances keep an FCFS list of *groups*, each holding at most `max_group_size`
requests of one model. The per-model queues are drained oldest head first; each request goes where its
prefill is predicted to end first: joining the first group of its model with room there, else a new group
at the tail, whose switch counts `1 + switch_aversion` times. An instance prefills its head group (batched
up to a token budget), switching when the group's model is not loaded, and prefetches the next group's
model while it computes.

On a mixed instance the prediction counts the chunks left of the prompts it has started and its decode
batches' share of the time (`_stretch`), not the whole decode turn planned there (a prompt ends an open-ended
turn or goes beside it in chunks), and a prompt stays on a mixed instance holding its model, in time
for its TTFT SLO, where its decode joins the round without switches (`_fits_round`), its KV fits and no
group queued there is pushed past its TTFT SLO.

On a prefill instance the prompt's KV then goes to host memory for a decode instance; with
`first_tokens` > 1 the instance first decodes that many tokens where weights and KV already are (the
*hand-off*: decode, then move), so the move hides behind time banked against the TPOT SLO. On a mixed
instance the KV stays where it was prefilled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

from scheduler.plan import Action, Decode, Prefill, Switch
from scheduler.policies.base import InstanceState
from scheduler.policies.kv_tiers import host_takes, tiers_admit
from scheduler.request import RUNNING, Request

if TYPE_CHECKING:
    from scheduler.policies.token_level import TokenLevelPolicy

_INF: Final = float("inf")


class Group:
    """Queued requests of one model on a prefill instance, prefilled together."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.ids: list[str] = []


class Head(NamedTuple):
    """The first group with requests on a mixed instance, priced: its model, the latest start that keeps its TTFT
    SLO, that SLO, and its predicted prefill time."""

    model: str
    start_by: float
    ttft_slo_s: float
    prefill_s: float


class PrefillSide:
    """The prefill and mixed instances' groups and hand-offs (the module docstring says how)."""

    def __init__(self, policy: TokenLevelPolicy) -> None:
        self.policy = policy
        self.groups: dict[str, list[Group]] = {}
        self.busy_until: dict[str, float] = {}  # instance -> predicted end of its planned work
        self.handoff: dict[str, tuple[str, list[str]]] = {}  # prefill instance -> ("decode" | "move", requests)
        self.by_tp: dict[int, list[InstanceState]] = {}  # prefill and mixed instances per TP, in order
        for inst in policy.instances.values():
            if inst.spec.role in ("prefill", "mixed"):
                self.groups[inst.instance_id] = []
                self.by_tp.setdefault(inst.spec.tp, []).append(inst)

    # ---- dispatch ----------------------------------------------------------------
    def dispatch(self, now: float) -> None:
        """Place every queued request in a group of a prefill instance (oldest queue head first)."""
        policy = self.policy
        queues = policy.queues
        waiting = policy.waiting_models()
        stuck: list[str] = []
        ends: dict[str, list[float]] = {}  # per prefill instance, predicted end of each queued group
        while waiting:
            model = waiting[0] if len(waiting) == 1 else min(waiting, key=policy.head_order)
            queue = queues[model]
            req = policy.requests[queue[0]]
            choice = self._pick_instance(req, now, ends)
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
                self._insert(self.groups[inst_id], group)
            group.ids.append(req.request_id)
            req.instance_id = inst_id
            policy.touch(inst_id)
            ends.pop(inst_id, None)
            if policy.instances[inst_id].spec.role == "mixed":  # let the turn boundary weigh the prompt
                policy.decode.preempt(inst_id)
        policy.queued_models = {m: None for m in stuck}  # every other queue is empty now

    def _insert(self, groups: list[Group], group: Group) -> None:
        """A new group goes at the tail, a high-priority model's ahead of the groups of lower priority (behind
        the head group, which may be prefilling)."""
        models = self.policy.models
        rank = models[group.model].priority
        for k in range(1, len(groups)):
            if models[groups[k].model].priority < rank:
                groups.insert(k, group)
                return
        groups.append(group)

    def _pick_instance(self, req: Request, now: float,
                       ends: dict[str, list[float]]) -> tuple[str, Group | None] | None:
        """The instance (and group to join, None = a new one at the tail) where `req`'s prefill is predicted
        to finish first: joining a group of its model saves a switch, a shorter queue saves waiting. A mixed
        instance that holds the model keeps it while its prefill there is predicted to end within `mixed_affinity`
        of its TTFT SLO, where its decode joins the round without switches (`_fits_round`), its KV fits beside the
        prompts queued there (`_kv_room`) and the groups it would delay still keep their TTFT SLOs
        (`_keeps_deadlines`)."""
        policy = self.policy
        model = req.model
        own_s = policy.costs.prefill_s(model, req.context_tokens)
        best_at, best_id, best_group = _INF, None, None  # the earliest end, ties to the first instance
        held_at, held_id, held_group = _INF, None, None  # the same among mixed instances holding the model, where
        # its decode joins the round without switches
        for inst in self.by_tp.get(policy.models[model].tp, []):
            if inst.lost:
                continue
            iid = inst.instance_id
            groups = self.groups[iid]
            inst_ends = ends.get(iid)
            if inst_ends is None:
                inst_ends = ends[iid] = self._group_ends(inst, now)
            prefill_s = own_s * self._stretch(inst)
            # the first group of the model with room (loops, not next(genexpr): once per request and instance)
            index = -1
            for k, candidate in enumerate(groups):
                if candidate.model == model and len(candidate.ids) < policy.max_group_size:
                    index = k
                    break
            if index >= 0:
                done_at, group = inst_ends[index] + prefill_s, groups[index]
            else:
                tail_model = inst.active
                for candidate in reversed(groups):
                    if candidate.ids:
                        tail_model = candidate.model
                        break
                tail_at = inst_ends[-1] if inst_ends else max(now, self.busy_until.get(iid, now))
                free = tail_model == model or (not groups and inst.prefetched == model)
                switch_s = 0.0 if free else policy.switch_cost_s(iid, model)
                done_at, group = tail_at + (1.0 + policy.switch_aversion) * switch_s + prefill_s, None
            if best_id is None or done_at < best_at:
                best_at, best_id, best_group = done_at, iid, group
            if inst.spec.role == "mixed" and (model in policy.weights[iid] or inst.active == model) \
                    and self._fits_round(iid, model) and (held_id is None or done_at < held_at) \
                    and (index < 0 or self._keeps_deadlines(iid, inst_ends, index, prefill_s)) \
                    and self._kv_room(inst, req):
                held_at, held_id, held_group = done_at, iid, group
        if held_id is not None and held_id != best_id \
                and held_at - req.arrival_at <= policy.mixed_affinity * policy.models[model].ttft_slo_s:
            return held_id, held_group  # a mixed instance holding the model, in time: its decode stays switch-free
        return None if best_id is None else (best_id, best_group)

    def _kv_room(self, inst: InstanceState, req: Request) -> bool:
        """Whether the instance's free device KV holds `req` beside the prompts queued there."""
        policy = self.policy
        need = policy.kv_need_bytes(req)
        for group in self.groups[inst.instance_id]:
            for rid in group.ids:
                need += policy.kv_need_bytes(policy.requests[rid])
        return need <= inst.kv_free_bytes

    def _keeps_deadlines(self, instance_id: str, inst_ends: list[float], index: int, extra_s: float) -> bool:
        """Whether the groups queued behind group `index` still end within their TTFT SLOs when it takes
        `extra_s` more."""
        policy = self.policy
        groups = self.groups[instance_id]
        for k in range(index + 1, len(groups)):
            group = groups[k]
            if group.ids:
                first = min(policy.requests[rid].arrival_at for rid in group.ids)
                if inst_ends[k] + extra_s > first + policy.models[group.model].ttft_slo_s:
                    return False
        return True

    def _fits_round(self, instance_id: str, model: str) -> bool:
        """Whether `model`'s decode joins the round on the mixed instance without switches: it decodes there, or
        the models decoding there and it fit the instance's weights together. A held model whose round does not
        fit makes every turn there copy weights (quota turns of up to `max_quota_s` each, which the mean TPOT of
        a short answer cannot absorb): the prompt goes where its prefill ends first instead."""
        policy = self.policy
        mix = policy.decode.states[instance_id].mix
        if model in mix:
            return True
        held = policy.weights[instance_id]
        return held.sizes[model] + sum(held.sizes[m] for m in mix) <= held.budget_bytes

    def _stretch(self, inst: InstanceState) -> float:
        """How much longer a prefill takes on the instance than alone: on a mixed one its decode batches take
        their share of every TPOT period (the sum of their step times, a model's members cut into batches of
        `max_batch_size`, over the strictest TPOT SLO) beside it, in chunks or between turns; at most 10x."""
        if inst.spec.role != "mixed":
            return 1.0
        state = self.policy.decode.states[inst.instance_id]
        if not state.mix:
            return 1.0
        policy = self.policy
        tpot, share = _INF, 0.0
        for model, (count, context, step_s) in state.mix.items():
            tpot = min(tpot, policy.models[model].tpot_slo_s)
            batches = -(-count // policy.max_batch_size)
            share += step_s if batches == 1 else batches * policy.costs.decode_step_s(model, count // batches,
                                                                                      context // batches)
        return 1.0 / max(0.1, 1.0 - share / tpot)

    def _group_ends(self, inst: InstanceState, now: float) -> list[float]:
        """Predicted finish of each queued group (a switch is hidden as far as the previous prefill lasts), after
        the chunks left of the prompts a mixed instance has started."""
        costs, requests = self.policy.costs, self.policy.requests
        t = max(now, self.busy_until.get(inst.instance_id, now))
        stretch = self._stretch(inst)
        for rid, left in inst.prefilling.items():  # a mixed instance's started prompts: their chunks go first
            t += costs.prefill_s(requests[rid].model, left) * stretch
        model, previous_s, out = inst.active, 0.0, []
        for group in self.groups[inst.instance_id]:
            if group.ids:
                if group.model != model:
                    t += max(0.0, self.policy.switch_cost_s(inst.instance_id, group.model) - previous_s)
                    model = group.model
                tokens = sum(requests[rid].context_tokens for rid in group.ids)
                previous_s = costs.prefill_s(group.model, tokens, len(group.ids))
                t += previous_s * stretch
            out.append(t)
        return out

    # ---- planning ----------------------------------------------------------------
    def step(self, inst: InstanceState) -> list[Action]:
        """An idle instance's next prefill work: the hand-off of the last prompts, else its head group."""
        policy = self.policy
        acts = self._hand_off(inst)
        if acts and isinstance(acts[0], Decode):
            return acts
        groups = self.groups[inst.instance_id]
        while groups and not groups[0].ids:
            groups.pop(0)
        if not groups:
            return acts
        head = groups[0]
        mixed = inst.spec.role == "mixed"
        if inst.on_device and mixed:  # make room for prompts
            head_need = policy.kv_need_bytes(policy.requests[head.ids[0]])
            if head_need > inst.kv_free_bytes:
                out = policy.decode.evictees(inst, set(), head_need - inst.kv_free_bytes)
                if not (tiers_admit(policy, inst, head_need) and host_takes(policy, inst, out)):
                    return acts  # device and host are full: the prompts wait while the admitted requests run
                acts.append(policy.swap_out(out, "make room to prefill"))
        acts += policy.use_model(inst, head.model, f"head group is {head.model}")
        batch = policy.take_prefill_batch(inst, _ListQueue(head.ids))  # type: ignore[arg-type]
        if not batch:
            return acts  # the head does not fit even an empty instance: _refuse prevents this
        if not head.ids:
            groups.pop(0)
        nxt = next((g.model for g in groups if g.model != head.model), None)
        acts += policy.prefetch(inst, nxt, "model of the next group")  # before the prefill: the copy overlaps it
        ids = tuple(r.request_id for r in batch)
        going_on = [r.request_id for r in batch if r.max_output_tokens > 1]
        why = f"head group of {head.model}: {len(batch)} prompt(s)"
        if mixed:  # the KV stays: this instance decodes it
            acts.append(Prefill(ids, reason=why))
        elif policy.first_tokens <= 1 or not going_on:
            acts.append(Prefill(ids, kv_to_host=True, reason=why))
        else:  # the KV stays for the first tokens (see _hand_off)
            acts.append(Prefill(ids, reason=f"{why}; first {policy.first_tokens} tokens here"))
            self.handoff[inst.instance_id] = ("decode", going_on)
        return acts

    def _hand_off(self, inst: InstanceState) -> list[Action]:
        """After a prefill that kept its KV: decode the first tokens where weights and KV already are, then
        (in the next plan, which may go on to the next prompts) move the KV to host for a decode instance.
        The time those tokens bank against the TPOT SLO hides the hand-off."""
        policy = self.policy
        pending = self.handoff.pop(inst.instance_id, None)
        if pending is None:
            return []
        stage, ids = pending
        live = [rid for rid in ids if rid in policy.requests and policy.requests[rid].status is RUNNING]
        if not live:
            return []
        if stage == "decode":
            ids_now = tuple(live)
            steps = min(policy.first_tokens - 1, policy.decode_steps(ids_now))
            self.handoff[inst.instance_id] = ("move", live)
            return [Decode(ids_now, steps, reason=f"first {steps + 1} tokens before the hand-off")]
        return [policy.swap_out(live, "hand the KV over to a decode instance")]

    def head(self, inst: InstanceState) -> Head | None:
        """The first group with requests on a mixed instance, priced; None without one."""
        head = next((g for g in self.groups[inst.instance_id] if g.ids), None)
        if head is None:
            return None
        reqs = [self.policy.requests[rid] for rid in head.ids]
        prefill_s = self.policy.costs.prefill_s(head.model, sum(r.context_tokens for r in reqs), len(reqs))
        ttft = self.policy.models[head.model].ttft_slo_s
        return Head(head.model, min(r.arrival_at for r in reqs) + ttft - prefill_s, ttft, prefill_s)

    def planned(self, inst: InstanceState, acts: list[Action], now: float) -> None:
        """Note when the planned work should end (dispatch predicts queues from it)."""
        self.busy_until[inst.instance_id] = now + self._predict_s(inst, acts)

    def _predict_s(self, inst: InstanceState, acts: list[Action]) -> float:
        """Predicted time the planned actions keep an instance busy (prefetches overlap)."""
        costs, requests = self.policy.costs, self.policy.requests
        took = 0.0
        for act in acts:
            if isinstance(act, Switch):
                took += self.policy.switch_planned_s.get(inst.instance_id, costs.switch_s(act.model))
            elif isinstance(act, Prefill):
                for rid in act.request_ids:
                    req = requests[rid]
                    took += costs.prefill_s(req.model, req.context_tokens)
            elif isinstance(act, Decode) and act.prefill_chunks:  # a mixed iteration (token_level._chunks)
                took += self.policy.iteration_s(act.request_ids, act.prefill_chunks)
            elif isinstance(act, Decode):
                ctx = sum(requests[rid].context_tokens for rid in act.request_ids)
                # on a mixed instance a prompt goes beside the next step or ends the turn: its decode share is
                # in the prediction's stretch (_stretch), not a wait for the whole turn
                steps = 1 if inst.spec.role == "mixed" else act.max_steps
                took += steps * costs.decode_step_s(requests[act.request_ids[0]].model, len(act.request_ids), ctx)
        return took

    # ---- events ----------------------------------------------------------------
    def forget(self, request: Request, instance_id: str) -> None:
        for group in self.groups.get(instance_id, ()):
            if request.request_id in group.ids:
                group.ids.remove(request.request_id)
                break

    def lose(self, instance_id: str) -> None:
        if instance_id in self.groups:
            self.groups[instance_id] = []
            self.handoff.pop(instance_id, None)


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
