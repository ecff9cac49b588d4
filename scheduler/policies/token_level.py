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
a model not yet held there counting its switch spread over `round_target_s`,
among those whose KV tiers (device and host memory, kv_tiers) take it; where
none does, it waits with its KV on the prefill instance until one does.
Members form same-model batches that fit the device KV. At each turn
boundary the batch *due first* goes (earliest next-token deadline: first
token + tokens so far * TPOT SLO), for `q_i / d_i` steps from
`decode_quotas` (SLO derived; c0 = the waiting models' switches plus the KV
moves that cannot be avoided), while the next batch's model is prefetched.
KV moves to host only to make room. A newcomer of the running batch's model
joins it at the next token; one of another model waits for the turn boundary.
A sole batch decodes open-ended until something else needs the instance.

What differs from the artifact, and why (measured on the shipped fleet:
docs/lessons.md; the figures in git show 1476354:BENCHMARKS.md): rounds fixed
at their start made a newcomer wait for the round to end (up to Q_max per
batch), failing the mean TPOT of short answers, so turns go to the batch due
first and a newcomer joins a running turn of its model; prompts of a busy
model all went to the first instance holding a group of it, so dispatch
predicts finish times; a Prefetch planned after the compute it should overlap
started when that compute ended, so it comes first; a mixed
instance moved each prompt's KV to host and back. `max_quota_s` is 2 s
(the paper's Q_max is 4 s); `first_tokens` is 8 (the artifact hands off after
the first token; 1 restores that). A quota turn lasts at least `min_turn_tpot`
(1) TPOT SLO periods of the round (0 restores the formula alone): with alpha
floored at 0.5 and a small c0 (two small models, both held in the two weight
slots) the formula gives turns of 2-4 steps, each a switch and a round trip to
the scheduler in the live pool, which bought nothing - the floor leaves SLO
attainment as it was and lowers mean TPOT and p99 ITL, as switches (and the KV
moves of crowded instances) get rarer (BENCHMARKS.md, "Token-level's turn floor").
The floor only lengthens short turns: each batch still gets at least
TPOT/d_i tokens per turn, so with k batches in a round, floored turns keep
every batch's pace while its step takes at most 1/k of a TPOT period.

A "mixed" instance (for classes too small to split well) does both and keeps
a prompt's KV where it was prefilled. Prompts of its resident models go in
chunks beside its decode steps (Sarathi: a 1-step Decode with prefill_chunks),
the earliest TTFT deadline first, each iteration sized so its predicted time
(CostModel.mixed_iteration_s, the weights read once) stays within
`mixed_chunk_tpot` (0.8) of the TPOT SLO. A prompt of a model not resident
is prefilled whole when every decode batch there has the slack for its switch
and prefill, or when it has only half its TTFT SLO left; until then the decode
turn is cut so the prompt is weighed again in time (0 `mixed_chunk_tpot`
restores the old rule: whole prefills at turn boundaries unless a batch is
behind its pace). While prompts of the resident models go in chunks it waits
behind them, but only until its latest start less its switch and one TPOT SLO:
from then no chunk goes before it, not even one of a prompt already started (a
steady stream of resident prompts kept it out for good: issue 37; sending it
at half its TTFT SLO left instead, tried first, stalled the decode batches with
whole prefills and took the shipped fleet from 16 to 22 H20s). Dispatch keeps
a prompt on a mixed instance that holds its model's weights, where its decode
joins the round without switches (the models decoding there and it fit the
weights together), while its prefill there is predicted to end within
`mixed_affinity` (1.0) of its TTFT SLO - the prediction counting the started
prompts' chunks left and stretched by the instance's decode share, not the
whole of the decode turn running there (a prompt ends an open-ended turn or
goes beside it in chunks) - its KV fits and no group queued there is pushed
past its TTFT SLO: elsewhere each turn of it may copy weights. A prompt
arriving ends an open-ended turn. A quota turn counts a chunked iteration as
the decode steps of its predicted time (mixed_iteration_s; counted as one
step, an 80 ms iteration beside a 13 ms step on the shipped fleet's TP2 class,
a turn held the instance for several times its quota while the other batches
waited), but runs on to its prompt's last chunk. Measured: the shipped fleet
22 -> 16 H20s (BENCHMARKS.md, issue 35); seeds 0-7 from 16/18/16/18/16/16/18/18
to 16 on every seed (the TP2 class's two mixed instances: a mixed instance
looked busy for the whole of its open-ended turn, so dispatch spread the four
TP2 models over both instances and nearly every round switched weights).

The code reads in three parts: this module plans each instance by its role and
routes events; `token_prefill.PrefillSide` holds the groups, dispatch and the
hand-off; `token_decode.DecodeSide` holds the members, batches and each decode
instance's `Turn` (the one object that says how long the running batch keeps
the instance, and why the Decode in flight should stop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from scheduler.costs import CostModel, InstanceSpec, ModelProfile
from scheduler.plan import Action, Decode, Event, KvMoved, Prefetch, StepDone, Stop, SwapOut, Switch
from scheduler.policies.base import InstanceState, PolicyBase
from scheduler.policies.token_decode import DecodeSide
from scheduler.policies.kv_tiers import tiers_admit
from scheduler.policies.token_prefill import Group, Head, PrefillSide
from scheduler.policies.token_weights import MemoryPlan, ResidentSet, plan_memory
from scheduler.request import PREFILLING, RUNNING, SWAPPED, Request, transition

_INF = float("inf")
_MIN_CHUNK = 16  # prompt tokens an iteration carries when its decode batch alone fills the budget


class TokenLevelPolicy(PolicyBase):
    """Plans each touched instance by its role: `PrefillSide` (token_prefill) runs prefill instances, `DecodeSide`
    (token_decode) decode instances, and a mixed instance weighs both at each turn boundary."""

    name: ClassVar[str] = "token-level"

    def __init__(self, models: Mapping[str, ModelProfile], instances: Sequence[InstanceSpec], costs: CostModel, *,
                 max_group_size: int = 8, max_quota_s: float = 2.0, round_target_s: float = 0.5,
                 switch_aversion: float = 1.0, first_tokens: int = 8, min_turn_tpot: float = 1.0,
                 fixed_turn_steps: int | None = None, joint_turns: bool = True, mixed_chunk_tpot: float = 0.8,
                 mixed_affinity: float = 1.0,
                 # PolicyBase's keywords spelled out, not **kwargs: mypyc miscompiles **kwargs beside int defaults
                 max_batch_size: int = 256, max_prefill_tokens: int = 8192,
                 chunked_prefill_tokens: int | None = None, keep_ended: bool = True) -> None:
        super().__init__(models, instances, costs, max_batch_size=max_batch_size, max_prefill_tokens=max_prefill_tokens,
                         chunked_prefill_tokens=chunked_prefill_tokens, keep_ended=keep_ended)
        if not 0 <= mixed_chunk_tpot <= 1:
            raise ValueError(f"mixed_chunk_tpot must be within [0, 1] (a share of the TPOT SLO), got {mixed_chunk_tpot}")
        if min_turn_tpot < 0:
            raise ValueError(f"min_turn_tpot must be >= 0 (TPOT SLO periods), got {min_turn_tpot}")
        self.max_group_size = max_group_size
        self.max_quota_s = max_quota_s
        self.round_target_s = round_target_s
        self.switch_aversion = switch_aversion
        self.first_tokens = first_tokens
        self.min_turn_tpot = min_turn_tpot
        self.fixed_turn_steps = fixed_turn_steps  # test knob: every turn exactly this many steps
        self.joint_turns = joint_turns  # decode every resident model's members together when they fit (token_decode)
        self.mixed_chunk_tpot = mixed_chunk_tpot  # a mixed iteration's share of the TPOT SLO (0: whole prefills)
        # a prompt goes to a mixed instance holding its model's weights while its prefill there is predicted to
        # end within this share of its TTFT SLO (its decode stays there: elsewhere each turn may copy weights)
        self.mixed_affinity = mixed_affinity
        self._last_chunk: dict[str, set[str]] = {}  # mixed instance -> prompts whose last chunk is in flight
        self.full_scan = False  # test knob: plan every instance, not only touched ones (the plans must be identical)
        # _plan reads `now` only for idle instances and, on a busy one, plans a Stop only after news that asks a
        # turn to stop; a SwitchDone or KvMoved that leaves its instance busy enables nothing else, except a
        # hand-off's KvMoved placing requests on a decode instance, which DecodeSide.join marks as news
        self.skip_quiet_schedules = True
        self._plan_memory()
        self.prefill = PrefillSide(self)
        self.decode = DecodeSide(self)
        self._rank = {iid: k for k, iid in enumerate(self.instances)}
        self._ids = list(self.instances)  # by rank
        for model in self.models.values():
            roles = {i.spec.role for i in self.instances.values() if i.spec.tp == model.tp}
            if not ({"prefill", "mixed"} & roles and {"decode", "mixed"} & roles):
                raise ValueError(f"token-level needs prefill and decode instances of TP{model.tp} for {model.name}; "
                                 f"roles present: {sorted(roles) or 'none'}")

    def _plan_memory(self) -> None:
        """Each instance's KV/weights split (token_weights.plan_memory) and its resident set."""
        sizes = {name: m.weight_bytes for name, m in self.models.items()}
        self.memory_plans: dict[str, MemoryPlan] = {}
        self.weights: dict[str, ResidentSet] = {}
        self._warm: dict[str, list[str]] = {}  # instance -> pinned and preloaded models to copy in at start
        for iid, inst in self.instances.items():
            spec = inst.spec
            members = [m for m in self.models.values() if m.tp == spec.tp]
            num_decode = sum(1 for i in self.instances.values()
                             if i.spec.tp == spec.tp and i.spec.role in ("decode", "mixed"))
            plan = plan_memory(spec, members, num_decode, self.max_prefill_tokens)
            self.memory_plans[iid] = plan
            inst.kv_capacity_bytes = plan.kv_bytes
            pinned = sorted(m.name for m in members if m.pinned)
            others = max((m.weight_bytes for m in members if not m.pinned), default=0.0)
            if pinned and sum(sizes[m] for m in pinned) + others > plan.weight_bytes:
                raise ValueError(f"pinned models {pinned} ({sum(sizes[m] for m in pinned) / 1e9:.1f} GB) leave no room "
                                 f"beside them for the largest other TP{spec.tp} model ({others / 1e9:.1f} GB) in "
                                 f"instance {iid}'s {plan.weight_bytes / 1e9:.1f} GB of weights; pin fewer models")
            self.weights[iid] = ResidentSet(plan.weight_bytes, sizes, pinned)
            preload = sorted((m for m in members if m.preload and not m.pinned), key=lambda m: (-m.rate_rps, m.name))
            if pinned or preload:
                self._warm[iid] = pinned + [m.name for m in preload]
        self.last_request_at: dict[str, float] = {}  # model -> its latest arrival (idle TTLs count from it)
        self._now = 0.0  # the time of the plan being made
        self.weight_budgets = {iid: plan.weight_bytes for iid, plan in self.memory_plans.items()}
        self._worth: dict[str, float] = {}  # worth's answers
        self._use_count = 0  # recency of the resident sets' models (ties in eviction go least recently used)
        self.switch_planned_s: dict[str, float] = {}  # instance -> predicted copy time of the Switch just planned

    def worth(self, model: str) -> float:
        """What evicting `model` is expected to cost per second: its rate times its switch time."""
        worth = self._worth.get(model)
        if worth is None:
            profile = self.models[model]
            worth = self._worth[model] = (profile.load_rps or profile.rate_rps) * self.costs.switch_s(model)
        return worth

    def switch_cost_s(self, instance_id: str, model: str) -> float:
        """A switch to `model` on the instance: free when its weights are held there, else a whole copy."""
        return 0.0 if model in self.weights[instance_id] else self.costs.switch_s(model)

    def _needed(self, inst: InstanceState, model: str) -> set[str]:
        """Models the instance needs soon besides `model`: its queued groups' and its decode members'."""
        iid = inst.instance_id
        out = {model}
        if inst.active is not None:
            out.add(inst.active)
        for group in self.prefill.groups.get(iid, ())[:4]:
            out.add(group.model)
        state = self.decode.states.get(iid)
        if state is not None:
            out.update(state.mix)
        return out

    # ---- planning --------------------------------------------------------------
    def submit(self, request: Request, now: float) -> None:
        self.last_request_at[request.model] = now
        super().submit(request, now)

    def _plan(self, now: float) -> dict[str, list[Action]]:
        self._now = now
        if self.decode.waiting:  # prefilled requests waiting for room on a decode instance (kv_tiers)
            self.decode.join_waiting()
        if self._queued_news:
            self._queued_news = False
            self.prefill.dispatch(now)
        out: dict[str, list[Action]] = {}
        for iid in self._touched_in_order():
            inst = self.instances[iid]
            if inst.lost:
                continue
            if not inst.idle:
                why = self.decode.should_stop(inst) if iid in self.decode.states else ""
                if why:
                    out[iid] = [Stop(reason=why)]
                    self._touched.add(iid)
                continue
            role = inst.spec.role
            warm = self._warm_up(inst) if iid in self._warm else []
            if role == "prefill":
                acts = self.prefill.step(inst)
            elif role == "decode":
                acts = self.decode.step(inst)
            else:
                acts = self._mixed_step(inst, now)
            acts = warm + acts
            if acts:
                out[iid] = acts
                self._touched.add(iid)  # a plan may go on from the state it leaves
                if role != "decode":
                    self.prefill.planned(inst, acts, now)
        return out

    def _touched_in_order(self) -> list[str]:
        """The instances touched since the last plan, in instance order, and no longer touched.

        Only touched instances can plan something (see PolicyBase.touch); planning one instance changes no
        other instance's state, so the others' plans would be empty. `full_scan` plans every instance."""
        touched, self._touched = self._touched, set()
        if self.full_scan or len(touched) == len(self.instances):
            return list(self.instances)
        if len(touched) < 2:
            return list(touched)
        # sorted as plain ints, not sorted(key=...): a key function costs a call per id (compiled, ~4% of the
        # event loop's CPU under token-level)
        rank, ids = self._rank, self._ids
        ranks = [rank[iid] for iid in touched]
        ranks.sort()
        return [ids[k] for k in ranks]

    def _mixed_step(self, inst: InstanceState, now: float) -> list[Action]:
        """A mixed instance computes queued prompts of its resident models in chunks beside its decode steps
        (`_chunked_step`) until a head group of a model not resident must start; otherwise, at a turn boundary,
        it prefills its head group unless a decode batch is behind its pace and the group can still wait (more
        than half its TTFT SLO left after the prefill)."""
        acts: list[Action] = []
        iid = inst.instance_id
        if inst.prefilling:
            rid = next(iter(inst.prefilling))
            model = self.requests[rid].model
            if model not in inst.resident:  # a decode turn switched away mid-prompt: the prompt finishes first
                rest = inst.prefilling.pop(rid)
                self._last_chunk.setdefault(iid, set()).add(rid)
                return self.use_model(inst, model, f"finish {rid}'s prompt") + [
                    Decode((), 1, prefill_chunks=((rid, rest),), reason=f"the last {rest} prompt tokens of {rid}")]
        # the head group, priced once for this plan: the chunk path changes it only when it plans chunks, and
        # then nothing below reads it
        head = self.prefill.head(inst) if self.prefill.groups[iid] else None
        late = self._late_start(inst, head) if self.mixed_chunk_tpot > 0 else None
        if self.mixed_chunk_tpot > 0 and (late is None or now < late) and (inst.prefilling or self._chunkable(inst)):
            acts = self._chunked_step(inst)
            if acts:
                return self._cut(acts, late, now)
        # due: half its TTFT SLO left (or its late start passed, when that comes first)
        due = head is not None and (head.start_by - now <= head.ttft_slo_s / 2 or (late is not None and late <= now))
        if head is not None and (self.decode.at_boundary(iid) or due) and self._prefill_first(inst, now, head, due):
            acts = self.prefill.step(inst)
        if acts:
            return acts
        acts = self.decode.step(inst)
        if not acts:
            return self.prefill.step(inst)
        if head is None or self.mixed_chunk_tpot <= 0:
            return acts
        at = head.start_by - head.ttft_slo_s / 2  # the turn stops in time to weigh the head again before it is due
        return self._cut(acts, late if late is not None and late < at else at, now)

    def _late_start(self, inst: InstanceState, head: Head | None) -> float | None:
        """The latest start of a head group of a model not resident that keeps its TTFT SLO: its latest start
        less its switch and one TPOT SLO (a step in flight). Prompts of the resident models go in chunks before
        it until then, and none after, not even one started: a steady stream of them kept such a group from its
        prefill for good (one live Plan log showed a group prefilled 26 s after it arrived). None for no such
        head."""
        if head is None or head.model in inst.resident:
            return None
        return head.start_by - self.switch_cost_s(inst.instance_id, head.model) - self.models[head.model].tpot_slo_s

    def _cut(self, acts: list[Action], at: float | None, now: float) -> list[Action]:
        """A prompt waits here: the decode turn stops by `at` (None: it need not) to weigh it again."""
        last = acts[-1]
        if at is not None and isinstance(last, Decode) and last.max_steps > 1:
            step_s = self.iteration_s(last.request_ids, ())
            steps = max(1, int((at - now) / step_s)) if step_s > 0 else last.max_steps
            if steps < last.max_steps:
                acts[-1] = Decode(last.request_ids, steps, f"{last.reason}; a prompt waits", last.prefill_chunks)
        return acts

    def _chunkable(self, inst: InstanceState) -> bool:
        """Whether a queued prompt here could go in chunks now: its model resident and requests decoding."""
        if not inst.on_device or not self.running_on(inst):
            return False
        for group in self.prefill.groups[inst.instance_id]:
            if group.ids and group.model in inst.resident:
                return True
        return False

    def _chunked_step(self, inst: InstanceState) -> list[Action]:
        """The decode side's next step with prompt chunks beside it (Sarathi): one iteration whose predicted
        time (CostModel.mixed_step_s) stays within `mixed_chunk_tpot` of the strictest TPOT SLO in it, so no
        decode batch falls behind for a prompt. Prompts already started go first, then queued ones of the
        models resident, earliest TTFT deadline first. [] when no decode step can carry a chunk."""
        acts = self.decode.step(inst)
        if acts and not isinstance(acts[-1], Decode):
            return acts
        last = acts[-1] if acts else None
        ids = last.request_ids if isinstance(last, Decode) else ()
        chunks = self._chunks(inst, ids)
        if not chunks:
            return acts
        completed = {rid for rid, _ in chunks if rid not in inst.prefilling}
        self._last_chunk.setdefault(inst.instance_id, set()).update(completed)
        tokens = sum(take for _, take in chunks)
        step = Decode(ids, 1, prefill_chunks=tuple(chunks),
                      reason=f"iteration: decode {len(ids)}, {tokens} prompt tokens of {len(chunks)}")
        turn = self.decode.states[inst.instance_id].turn
        if turn is not None and ids:  # the turn counts the iteration by its time (Turn.carries)
            turn.carries(self.iteration_s(ids, step.prefill_chunks), bool(inst.prefilling))
        return acts[:-1] + [step] if acts else [step]

    def _chunks(self, inst: InstanceState, ids: tuple[str, ...]) -> list[tuple[str, int]]:
        """(request, tokens) chunks for one iteration beside decoding `ids`; prompts it admits are reserved
        (PREFILLING) and their tokens not taken yet stay in `inst.prefilling`."""
        requests, costs = self.requests, self.costs
        per_model: dict[str, list[int]] = {}  # model -> [batch size, context tokens]
        tpot = _INF
        for rid in ids:
            req = requests[rid]
            entry = per_model.setdefault(req.model, [0, 0])
            entry[0] += 1
            entry[1] += req.context_tokens
            tpot = min(tpot, self.models[req.model].tpot_slo_s)
        self._admit_prompts(inst)
        if not inst.prefilling:
            return []
        models = {requests[rid].model for rid in inst.prefilling}
        tpot = min([tpot] + [self.models[m].tpot_slo_s for m in models])
        budget = self.mixed_chunk_tpot * tpot if ids else _INF  # nothing decodes: the started prompt finishes
        chunks: list[tuple[str, int]] = []
        taken: dict[str, list[int]] = {}  # model -> [chunk tokens, prompts]

        def step_s() -> float:
            return costs.mixed_iteration_s(per_model, taken)

        for rid, left in list(inst.prefilling.items()):
            model = requests[rid].model
            if model not in inst.resident:
                continue  # the decode turn switched away: _mixed_step finishes it next
            entry = taken.setdefault(model, [0, 0])
            entry[1] += 1
            lo, hi = 0, left  # the most tokens of this prompt that keep the iteration within the budget
            while lo < hi:
                mid = (lo + hi + 1) // 2
                entry[0] += mid
                fits = step_s() <= budget
                entry[0] -= mid
                lo, hi = (mid, hi) if fits else (lo, mid - 1)
            if lo == 0 and not chunks:
                lo = min(left, _MIN_CHUNK)  # the decode batch alone fills the budget: the prompt still moves
            if lo == 0:
                entry[1] -= 1
                break
            entry[0] += lo
            chunks.append((rid, lo))
            if lo < left:
                inst.prefilling[rid] = left - lo
                break
            del inst.prefilling[rid]
        return chunks

    def iteration_s(self, ids: tuple[str, ...], chunks: tuple[tuple[str, int], ...]) -> float:
        """Predicted time of a mixed iteration (CostModel.mixed_iteration_s, as the simulator charges it)."""
        requests = self.requests
        per_model: dict[str, list[int]] = {}
        for rid in ids:
            req = requests[rid]
            entry = per_model.setdefault(req.model, [0, 0])
            entry[0] += 1
            entry[1] += req.context_tokens
        taken: dict[str, list[int]] = {}
        for rid, tokens in chunks:
            entry = taken.setdefault(requests[rid].model, [0, 0])
            entry[0] += tokens
            entry[1] += 1
        return self.costs.mixed_iteration_s(per_model, taken)

    def _admit_prompts(self, inst: InstanceState) -> None:
        """Start queued prompts of the models resident here (earliest TTFT deadline first) while KV admits them:
        reserved and PREFILLING, their tokens in `inst.prefilling`."""
        if inst.prefilling:
            return  # one prompt's chunks at a time: the started one finishes first
        requests, models = self.requests, self.models
        best: tuple[float, str, Group] | None = None
        for group in self.prefill.groups[inst.instance_id]:
            if group.model not in inst.resident:
                continue
            for rid in group.ids:
                req = requests[rid]
                key = (req.arrival_at + models[req.model].ttft_slo_s, rid)
                if best is None or key < best[:2]:
                    best = (key[0], key[1], group)
        if best is None:
            return
        _, rid, group = best
        req = requests[rid]
        need = self.kv_need_bytes(req)
        if need > inst.kv_free_bytes or not tiers_admit(self, inst, need):
            return
        group.ids.remove(rid)
        self.reserve(inst, req)
        transition(req, PREFILLING)
        inst.prefilling[rid] = req.context_tokens

    def _prefill_first(self, inst: InstanceState, now: float, head: Head,
                       due: bool) -> bool:
        if due:
            return True
        if self.mixed_chunk_tpot <= 0:
            return not self.decode.behind_pace(inst, now)
        # the whole prefill (and its switch) must end before any decode batch here owes its next token
        switch_s = 0.0 if inst.active == head.model else self.switch_cost_s(inst.instance_id, head.model)
        return self.decode.slack_s(inst, now) >= switch_s + head.prefill_s

    # ---- actions both sides plan ----------------------------------------------------
    def use_model(self, inst: InstanceState, model: str, why: str) -> list[Action]:
        """Make `model` current: a Switch unless it already is (free when it was prefetched in time)."""
        if inst.active == model:
            return []
        held = self.weights[inst.instance_id]
        hit = " (prefetched)" if inst.prefetched == model else " (resident)" if model in held else ""
        self.switch_planned_s[inst.instance_id] = self.switch_cost_s(inst.instance_id, model)
        self._use_count += 1
        keep = held.add(model, self._use_count, self._needed(inst, model), self.worth, self._expired(held))
        assert keep is not None  # the budget holds the class's largest model: nothing is hard here
        inst.active = model
        inst.resident = {model}
        return [Switch(model, reason=why + hit, keep=keep)]

    def co_locate(self, inst: InstanceState, model: str, why: str) -> list[Action]:
        """Make a held `model` resident beside the active one (a joint decode turn); nothing when it is."""
        if model in inst.resident:
            return []
        held = self.weights[inst.instance_id]
        self._use_count += 1
        keep = held.add(model, self._use_count, self._needed(inst, model), self.worth, hard=inst.resident)
        assert keep is not None  # _joint checked that the joint models fit together
        inst.resident.add(model)
        inst.active = model
        return [Switch(model, reason=why, evict=False, keep=keep)]

    def prefetch(self, inst: InstanceState, model: str | None, why: str) -> list[Action]:
        """Copy the next model into the spare slot while the planned compute runs (placed before it)."""
        held = self.weights[inst.instance_id]
        if model is None or model == inst.active or inst.prefetched == model or model in held:
            return []
        needed = self._needed(inst, model)
        hard = inst.resident | ({inst.active} if inst.active is not None else set())
        keep = held.add(model, self._use_count + 1, needed, self.worth, self._expired(held), hard=hard)
        if keep is None:
            return []  # no room beside the models in use: the switch copies it when its turn comes
        self._use_count += 1
        inst.prefetched = model
        return [Prefetch(model, reason=why, keep=keep)]

    def _warm_up(self, inst: InstanceState) -> list[Action]:
        """At start (or a restart): copy in the pinned models, then the preloaded ones that fit beside them."""
        held = self.weights[inst.instance_id]
        acts: list[Action] = []
        for model in self._warm.pop(inst.instance_id):
            if model in held or held.would_evict(model, held.held, self.worth, hard=held.held) is None:
                continue  # a preload that would push out what is there already waits for its requests
            self._use_count += 1
            keep = held.add(model, self._use_count, (), self.worth, hard=list(held.held))
            assert keep is not None
            what = "pinned" if self.models[model].pinned else "preload"
            acts.append(Prefetch(model, reason=f"{what} {model}", keep=keep))
        return acts

    def _expired(self, held: ResidentSet) -> list[str]:
        """Held models whose idle TTL has run out (no request for that long): freed at the next weight change."""
        out = []
        for model in held.held:
            ttl = self.models[model].idle_ttl_s
            if ttl is not None and self._now - self.last_request_at.get(model, 0.0) > ttl:
                out.append(model)
        return out

    def head_order(self, model: str) -> tuple[float, str]:
        """Dispatch order of a model's queue head: its arrival, a high-priority model's half a TTFT SLO earlier
        (a low one's later)."""
        arrival, _ = self.head_arrival(model)
        profile = self.models[model]
        return (arrival - profile.priority * profile.ttft_slo_s / 2 if profile.priority else arrival), model

    def swap_out(self, ids: list[str], why: str) -> SwapOut:
        for rid in ids:
            self.release(self.requests[rid])
        if len(ids) > 1:
            ids = sorted(ids, key=self._fcfs_key)
        return SwapOut(tuple(ids), reason=why)

    # ---- events ----------------------------------------------------------------
    def _after_event(self, inst: InstanceState, event: Event, now: float) -> None:
        if isinstance(event, KvMoved):
            if event.to == "host" and inst.spec.role == "prefill":  # the hand-off after the first tokens
                for rid in event.request_ids:
                    req = self.requests.get(rid)
                    if req is not None and req.status is SWAPPED:
                        self.decode.join_decoder(req)
            return
        if not isinstance(event, StepDone):
            return
        if event.kind == "decode":
            if inst.instance_id in self.decode.states:
                self.decode.ran(inst.instance_id, event.num_steps)
            last = self._last_chunk.get(inst.instance_id)
            if last:  # prompts whose last chunk ran: their first token came with the iteration
                for rid in event.request_ids:
                    if rid in last:
                        last.discard(rid)
                        req = self.requests.get(rid)
                        if req is not None and not req.done:
                            self.decode.first_token_at[rid] = now
                            self.decode.join(inst, req)
            return
        if event.kind != "prefill":
            return
        first_token_at = self.decode.first_token_at
        for rid in event.request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue  # ended and forgotten (keep_ended=False)
            if not req.done:
                first_token_at[rid] = now
            if req.status is SWAPPED:
                self.decode.join_decoder(req)
            elif req.status is RUNNING and inst.spec.role == "mixed":
                self.decode.join(inst, req)

    def _forget(self, request: Request) -> None:
        self.decode.first_token_at.pop(request.request_id, None)
        iid = request.instance_id
        if iid is None:
            return
        last = self._last_chunk.get(iid)
        if last:
            last.discard(request.request_id)
        self._touched.add(iid)
        self.decode.forget(request, iid)
        self.prefill.forget(request, iid)

    def _add_instance(self, instance_id: str) -> None:
        super()._add_instance(instance_id)
        held = self.weights[instance_id]
        held.clear()  # a restarted engine holds nothing the plan can count on
        if held.pinned:
            self._warm[instance_id] = sorted(held.pinned)

    def _lose(self, inst: InstanceState, why: str, now: float) -> None:
        super()._lose(inst, why, now)
        self._last_chunk.pop(inst.instance_id, None)
        self.weights[inst.instance_id].clear()
        self.prefill.lose(inst.instance_id)
        self.decode.lose(inst.instance_id)
