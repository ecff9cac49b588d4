"""token-level's decode side: where a prefilled request decodes, and whose turn it is on each decode instance.

A prefilled request joins the decode instance of its TP where it adds least to the sum of batch step times
(the share of every TPOT period the instance decodes), a model not yet held there counting its switch
spread over `round_target_s`. An instance's *members* form same-model batches (FCFS within a model) that
each fit its device KV; the batches take turns.

A `Turn` is one batch's hold on the instance, and the one place its length lives:

    kind        OPEN_ENDED  the only batch: it decodes until something else needs the instance
                QUOTA       one of several: q_i / d_i steps from `decode_quotas`, at least `min_turn_tpot`
                            TPOT SLO periods of the round (see token_level's docstring)
                FIXED       the test knob `fixed_turn_steps`
    steps_left  decode steps the turn may still take; `ran(n)` counts the reported steps down; `over` at 0.
                On a mixed instance an iteration that carries prompt chunks beside the batch's step (Sarathi)
                takes longer than a step: `carries(s, more)` says the one in flight is predicted to take `s`
                seconds (CostModel.mixed_iteration_s) and whether its prompt has chunks left; a quota turn
                counts it as the steps of its time, so it holds the instance for its quota's time, not for as
                many iterations as its quota has steps, and it does not end before its prompt's last chunk
    stop        why the Decode in flight should stop at the next token, or "" while it runs:
                CUT_IN   a newcomer of the batch's model joined the batch (the turn goes on with it)
                PREEMPT  an open-ended turn must end (another model's newcomer, or a prompt on a mixed
                         instance): `preempt()` also ends the turn, so the next turn boundary weighs the rest;
                         or a quota turn must end sooner: `end_by(t)` shortens it to end by `t`
    RUNNING --cut_in()--> CUT_IN --planned()--> RUNNING
    RUNNING --preempt(), open-ended--> PREEMPT (over)      RUNNING --ran(n)--> over when no steps are left
    RUNNING --end_by(t), quota, t before its end--> PREEMPT (fewer steps left, not below its floor)

On a decode instance a newcomer of another model (handed over from a prefill instance) owes its next token at
its first token + its tokens so far * TPOT SLO; a quota turn running then ends by that deadline, though not
before its floor (`min_turn_tpot` periods): a turn of up to `max_quota_s` (2 s) is more than the mean TPOT of
a short answer can absorb, and those answers were most of the TPOT misses on the shipped fleet's decode
instances (seeds 0-7 at TP1 4P+4D: 98.68-99.23% -> 99.14-99.47%). Not on a mixed instance: a newcomer there has
just had its first token on that instance and owes the next one a TPOT SLO later, so each prompt of another
model would cut the running turn to its floor and add a switch back (measured: the shipped fleet's TP2 class,
seed 0, 99.82% -> 98.53%).

At a turn boundary (no turn, or the turn over) the batch *due first* goes: the earliest next-token deadline
(first token + tokens so far * TPOT SLO). Its turn swaps in the KV it lacks (moving out only what must make
room, latest due first), switches to its model, prefetches the model due next and decodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from scheduler.plan import Action, Decode, SwapIn
from scheduler.policies.base import InstanceState
from scheduler.policies.kv_tiers import tiers_admit, tiers_ever_admit
from scheduler.quotas import first_decode_quota
from scheduler.request import SWAPPED, Request

if TYPE_CHECKING:
    from scheduler.policies.token_level import TokenLevelPolicy

_INF: Final = float("inf")
OPEN_ENDED: Final = "open-ended"
QUOTA: Final = "quota"
FIXED: Final = "fixed"
CUT_IN: Final = "cut-in"
PREEMPT: Final = "preempt"


class Batch:
    """Members of one model that decode together; a *joint* batch (`others`) holds several resident models'
    members, each decode step advancing them all (their step times add up, as spatial's do)."""

    def __init__(self, model: str, ids: list[str] | None = None, kv_bytes: float = 0.0,
                 others: tuple[str, ...] = ()) -> None:
        self.model = model
        self.ids: list[str] = [] if ids is None else ids
        self.kv_bytes = kv_bytes
        self.others = others  # a joint batch's other models, each resident beside `model`

    def has(self, model: str) -> bool:
        return model == self.model or model in self.others


class Turn:
    """One batch's turn on a decode instance (the module docstring has its states)."""

    def __init__(self, batch: Batch, kind: str, steps: int, start_at: float = 0.0, step_s: float = 0.0,
                 floor: int = 1) -> None:
        self.batch = batch  # a copy of the packed batch: newcomers that cut in join it
        self.kind = kind  # OPEN_ENDED | QUOTA | FIXED
        self.steps_left = steps
        self.stop = ""  # "" | CUT_IN | PREEMPT
        self.start_at = start_at  # a quota turn: when it started, its predicted step time and its least steps
        self.step_s = step_s
        self.floor = floor
        self.steps_run = 0
        self.iteration_s = 0.0  # predicted time of the chunked iteration in flight (0: plain decode steps)
        self.prompt_goes_on = False  # its prompt has chunks left

    @property
    def over(self) -> bool:
        return self.steps_left <= 0

    def carries(self, iteration_s: float, prompt_goes_on: bool) -> None:
        """The Decode in flight is one iteration with prompt chunks, predicted to take `iteration_s`;
        `prompt_goes_on`: its prompt has chunks left after it."""
        self.iteration_s = iteration_s
        self.prompt_goes_on = prompt_goes_on

    def ran(self, num_steps: int) -> None:
        """`num_steps` steps were reported; a quota turn counts a chunked iteration as the steps of its time, but
        does not end before the prompt's last chunk (switched away from, its rest would be prefilled whole,
        stalling every batch here)."""
        floor = 0
        if self.iteration_s > 0 and self.kind == QUOTA and self.step_s > 0:
            num_steps = max(num_steps, round(self.iteration_s / self.step_s))
            floor = min(1, self.steps_left) if self.prompt_goes_on else 0
        self.iteration_s = 0.0
        self.steps_left = max(self.steps_left - num_steps, floor)
        self.steps_run += num_steps

    def end_by(self, at: float) -> None:
        """A quota turn ends by `at` (a waiting batch's next-token deadline), though not before its floor: a
        newcomer of another model owes its next token then, and its mean TPOT over a short answer cannot absorb
        the rest of a turn of up to `max_quota_s`."""
        if self.kind != QUOTA or self.step_s <= 0 or self.over:
            return
        total = max(self.floor, int((at - self.start_at) / self.step_s), self.steps_run + 1)
        if total - self.steps_run < self.steps_left:
            self.steps_left = total - self.steps_run
            self.stop = self.stop or PREEMPT

    def cut_in(self) -> None:
        self.stop = CUT_IN

    def preempt(self) -> None:
        """Something else needs the instance: an open-ended turn ends at the next token; a quota or fixed one
        runs on (what needs the instance waits for its boundary)."""
        if self.kind == OPEN_ENDED:
            self.stop = self.stop or PREEMPT  # a cut-in already asked for the stop (and names it)
            self.steps_left = 0

    def planned(self) -> None:
        """Its next Decode is being planned: nothing in flight is to stop."""
        self.stop = ""


@dataclass(slots=True)
class DecodeState:
    members: dict[str, None] = field(default_factory=dict)  # FCFS ordered set
    turn: Turn | None = None  # the turn in progress (or over, until the next boundary)
    next_model: str | None = None  # the model due after the turn's (prefetched)
    mix: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # model -> members, context estimate, step s
    load_s: float = 0.0  # sum of the step times in `mix`: the dispatcher's load figure
    packed: list[Batch] | None = None  # `_pack`'s answer until the members change (read-only: a turn copies one)


class DecodeSide:
    """The decode and mixed instances' members and turns (the module docstring says how)."""

    def __init__(self, policy: TokenLevelPolicy) -> None:
        self.policy = policy
        self.states: dict[str, DecodeState] = {}
        self.by_tp: dict[int, list[InstanceState]] = {}  # decode and mixed instances per TP, in order
        self.first_token_at: dict[str, float] = {}  # request -> when its prefill (first token) ended
        # prefilled requests no decode instance's KV tiers take yet (kv_tiers), FCFS -> the instance holding their KV
        self.waiting: dict[str, str | None] = {}
        for inst in policy.instances.values():
            if inst.spec.role in ("decode", "mixed"):
                self.states[inst.instance_id] = DecodeState()
                self.by_tp.setdefault(inst.spec.tp, []).append(inst)

    # ---- planning ----------------------------------------------------------------
    def step(self, inst: InstanceState) -> list[Action]:
        """An idle instance's next decode: the rest of the turn in progress, else the turn of the batch due first."""
        state = self.states[inst.instance_id]
        turn = state.turn
        if turn is not None:
            turn.planned()
            if not turn.over:
                batch = turn.batch
                batch.ids = self._live(inst, batch.ids)
                if batch.ids:
                    return self._run_turn(inst, state, turn, f"rest of {batch.model}'s turn")
        state.turn = None
        batches = self._pack(inst, state)
        if not batches:
            return []
        if len(batches) > 1:
            batches = sorted(batches, key=self._turn_order)  # stable: ties keep FCFS order
        first = batches[0]
        batch = Batch(first.model, list(first.ids), first.kv_bytes)
        fixed = self.policy.fixed_turn_steps
        joint = self._joint(inst, batches) if fixed is None and len(batches) > 1 and self.policy.joint_turns else None
        if joint is not None:
            state.turn = turn = Turn(joint, OPEN_ENDED, self.policy.decode_steps(tuple(joint.ids)))
            state.next_model = None
            return self._run_turn(inst, state, turn, f"joint turn of {len(batches)} resident models' batches",
                                  f"{joint.model}'s batch is due first")
        if fixed is not None:
            turn = Turn(batch, FIXED, fixed)
        elif len(batches) == 1:
            turn = Turn(batch, OPEN_ENDED, self.policy.decode_steps(tuple(batch.ids)))
        else:
            steps, floor, step_s = self._first_quota_steps(inst, batches)
            turn = Turn(batch, QUOTA, steps, self.policy._now, step_s, floor)  # _now: this plan's time
        state.turn = turn
        state.next_model = batches[1].model if len(batches) > 1 else None
        label = "open-ended" if turn.kind == OPEN_ENDED else f"quota {turn.steps_left} steps"
        return self._run_turn(inst, state, turn, f"{batch.model} turn ({label}), due first of {len(batches)}",
                              f"{batch.model}'s batch is due first")

    def _joint(self, inst: InstanceState, batches: list[Batch]) -> Batch | None:
        """One batch of every member when their models all stay resident, their KV fits the device together and
        a step of them all still keeps the strictest TPOT SLO: no switch, no KV move and no turn to wait for
        (spatial's step, within token-level's resident set). None otherwise."""
        policy = self.policy
        held = policy.weights[inst.instance_id]
        models: list[str] = []
        for batch in batches:
            if batch.model not in models:
                models.append(batch.model)
        if sum(held.sizes[m] for m in set(models) | inst.resident) > held.budget_bytes:
            return None
        kv = sum(b.kv_bytes for b in batches)
        size = sum(len(b.ids) for b in batches)
        if kv > inst.kv_capacity_bytes or size > policy.max_batch_size:
            return None
        requests, costs = policy.requests, policy.costs
        step_s, tpot = 0.0, _INF
        for batch in batches:
            context = sum(requests[rid].context_tokens for rid in batch.ids)
            step_s += costs.decode_step_s(batch.model, len(batch.ids), context)
            tpot = min(tpot, policy.models[batch.model].tpot_slo_s)
        if step_s > tpot / 2:  # room for its prompts' prefills too (the pace is the step's)
            return None
        ids = [rid for batch in batches for rid in batch.ids]
        ids.sort(key=policy._fcfs_key)
        return Batch(batches[0].model, ids, kv, tuple(m for m in models if m != batches[0].model))

    def should_stop(self, inst: InstanceState) -> str:
        """Why the Decode in flight on `inst` should stop at the next token ("" when it should not)."""
        turn = self.states[inst.instance_id].turn
        if turn is None or not turn.stop or not inst.decoding or inst.stopping:
            return ""
        return "a newcomer joins the running batch" if turn.stop == CUT_IN else "another batch is due"

    def at_boundary(self, instance_id: str) -> bool:
        turn = self.states[instance_id].turn
        return turn is None or turn.over

    def preempt(self, instance_id: str) -> None:
        """Something else needs a mixed instance (a prompt queued there): end an open-ended turn."""
        turn = self.states[instance_id].turn
        if turn is not None:
            turn.preempt()

    def behind_pace(self, inst: InstanceState, now: float) -> bool:
        """Whether some batch on `inst` owes a token already."""
        batches = self._pack(inst, self.states[inst.instance_id])
        return bool(batches) and min(map(self.due_at, batches)) <= now

    def slack_s(self, inst: InstanceState, now: float) -> float:
        """How long every batch on `inst` can wait before one owes a token (inf with none)."""
        batches = self._pack(inst, self.states[inst.instance_id])
        return min(map(self.due_at, batches)) - now if batches else _INF

    def _live(self, inst: InstanceState, ids: list[str]) -> list[str]:
        requests, iid = self.policy.requests, inst.instance_id
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
        policy = self.policy
        cap, requests, max_batch = inst.kv_capacity_bytes, policy.requests, policy.max_batch_size
        batches: list[Batch] = []
        open_batch: dict[str, Batch] = {}
        for rid in state.members:
            req = requests[rid]
            need = policy.kv_need_bytes(req)
            batch = open_batch.get(req.model)
            if batch is None or batch.kv_bytes + need > cap or len(batch.ids) >= max_batch:
                batch = open_batch[req.model] = Batch(req.model)
                batches.append(batch)
            batch.ids.append(rid)
            batch.kv_bytes += need
        state.packed = batches
        return batches

    def _turn_order(self, batch: Batch) -> float:
        """Turn order: due first; a high-priority model's batch as if due one TPOT period earlier (low: later)."""
        profile = self.policy.models[batch.model]
        due = self.due_at(batch)
        return due - profile.priority * profile.tpot_slo_s if profile.priority else due

    def due_at(self, batch: Batch) -> float:
        """When the batch's most pressed member owes its next token: first token + tokens so far * TPOT SLO."""
        models = self.policy.models
        tpot = models[batch.model].tpot_slo_s
        requests, first_token_at = self.policy.requests, self.first_token_at
        due = _INF
        for rid in batch.ids:
            req = requests[rid]
            pace = tpot if not batch.others else models[req.model].tpot_slo_s
            at = first_token_at.get(rid, 0.0) + req.num_output_tokens * pace
            if at < due:
                due = at
        return due

    def _first_quota_steps(self, inst: InstanceState, batches: list[Batch]) -> tuple[int, int, float]:
        """The first batch's turn length from `decode_quotas` over the batches waiting now; c0 counts their
        switches and the KV moves that cannot be avoided (none when every batch's KV fits the device together).
        The turn lasts at least `min_turn_tpot` TPOT SLO periods (see token_level's docstring). Returns its steps,
        that floor in steps and the predicted step time."""
        policy = self.policy
        costs, requests = policy.costs, policy.requests
        step_s: list[float] = []
        contexts: list[int] = []
        kv_bytes = 0.0
        tpot = _INF
        for batch in batches:
            context = sum(requests[rid].context_tokens for rid in batch.ids)
            contexts.append(context)
            step_s.append(costs.decode_step_s(batch.model, len(batch.ids), context))
            kv_bytes += batch.kv_bytes
            tpot = min(tpot, policy.models[batch.model].tpot_slo_s)
        switch_s = 0.0
        seen: list[str] = []  # each model once, in batch order (a set's would follow string hashes: sums could differ)
        for batch in batches:
            if batch.model not in seen:
                seen.append(batch.model)
        held = policy.weights[inst.instance_id]
        stays = sum(held.sizes[m] for m in seen) <= held.budget_bytes  # the round's models all stay resident
        for model in seen:
            switch_s += policy.switch_cost_s(inst.instance_id, model) if stays else costs.switch_s(model)
        move_s = 0.0
        if kv_bytes > inst.kv_capacity_bytes:  # each batch's KV goes out and comes back once a round
            for batch, context in zip(batches, contexts):
                move_s += 2 * costs.kv_move_s(batch.model, context)
        floor = max(1, math.ceil(policy.min_turn_tpot * tpot / step_s[0]))
        if switch_s + move_s == 0:  # every model stays resident, every KV on the device: turns cost nothing, so
            return floor, floor, step_s[0]  # they are as short as the floor allows (a long one delays the others)
        quota = first_decode_quota(step_s, tpot, switch_s + move_s, policy.max_quota_s)
        return max(int(quota / step_s[0]), floor), floor, step_s[0]

    def _run_turn(self, inst: InstanceState, state: DecodeState, turn: Turn, why: str,
                  switch_why: str = "") -> list[Action]:
        """Swap in what the batch lacks (moving out only what must make room), switch, prefetch, decode."""
        policy, batch = self.policy, turn.batch
        acts: list[Action] = []
        swap_in: list[Request] = []
        need = 0.0
        for rid in batch.ids:
            req = policy.requests[rid]
            if req.status is SWAPPED:
                swap_in.append(req)
                need += policy.kv_need_bytes(req)
        if need > inst.kv_free_bytes:
            out = self.evictees(inst, set(batch.ids), need - inst.kv_free_bytes)
            acts.append(policy.swap_out(out, f"make room for {batch.model}'s batch"))
        acts += policy.use_model(inst, batch.model, switch_why or f"{batch.model}'s turn")
        for other in batch.others:  # a joint batch: its other models resident beside the active one
            acts += policy.co_locate(inst, other, f"{other} decodes in the joint turn")
        for req in swap_in:
            policy.reserve(inst, req)
        if swap_in:
            acts.append(SwapIn(tuple([r.request_id for r in swap_in]), reason=f"KV of {batch.model}'s batch"))
        acts += policy.prefetch(inst, state.next_model, "model of the batch due next")  # the copy overlaps the turn
        ids = tuple(batch.ids)
        acts.append(Decode(ids, min(turn.steps_left, policy.decode_steps(ids)), reason=why))
        return acts

    def evictees(self, inst: InstanceState, keep: set[str], free_bytes: float) -> list[str]:
        """Device-resident requests to move to host, latest due first, until enough is free."""
        requests, models = self.policy.requests, self.policy.models
        tpot = {rid: models[requests[rid].model].tpot_slo_s for rid in inst.on_device}
        order = sorted((rid for rid in inst.on_device if rid not in keep),
                       key=lambda r: (-(self.first_token_at.get(r, 0.0) + requests[r].num_output_tokens * tpot[r]), r))
        out: list[str] = []
        for rid in order:
            if free_bytes <= 0:
                break
            out.append(rid)
            free_bytes -= requests[rid].kv_reserved_bytes
        return out

    # ---- placing prefilled requests ------------------------------------------------
    def join_decoder(self, req: Request) -> bool:
        """Place a prefilled request on the decode instance of its TP where it adds least load (ties by id), among
        those whose KV tiers take it (kv_tiers: its KV arrives in host memory); where none does yet, it waits with
        its KV where it is (`join_waiting` places it once room frees). Returns whether it was placed."""
        policy = self.policy
        model = req.model
        need = policy.kv_need_bytes(req)
        live = [inst for inst in self.by_tp.get(policy.models[model].tp, []) if not inst.lost]
        takes = [inst for inst in live if tiers_admit(policy, inst, need, in_host=True)]
        if not takes and any(tiers_ever_admit(inst, need, in_host=True) for inst in live):
            self.waiting.setdefault(req.request_id, req.instance_id)
            return False
        estimate = _context_estimate(req)
        # the load it adds where its model is not held yet: the same on every such instance
        fresh = policy.costs.decode_step_s(model, 1, estimate), \
            policy.costs.switch_s(model) * policy.models[model].tpot_slo_s / policy.round_target_s
        # the least load, ties to the smallest id; compared by hand, and due_at a loop, not min() over tuples or a
        # generator: compiled, the two cost 3.5% of the event loop's CPU under token-level. Where no instance would
        # take it even empty, any instance may (as before: the engine decides)
        best_load, best_id = _INF, None
        for inst in takes or live:
            iid = inst.instance_id
            load = self._load_after(self.states[iid], model, estimate,
                                    fresh if model not in policy.weights[iid] else (fresh[0], 0.0))
            if best_id is None or load < best_load or (load == best_load and iid < best_id):
                best_load, best_id = load, iid
        if best_id is None:
            req.instance_id = None
            policy.fail(req, f"no decode instance of TP{policy.models[model].tp} left")
            return True
        self.waiting.pop(req.request_id, None)
        self.join(policy.instances[best_id], req)
        return True

    def join_waiting(self) -> None:
        """Place the waiting prefilled requests that the decode instances' tiers take now, FCFS within a TP (a
        request that still waits holds back the later ones of its TP); those re-queued or ended meanwhile go."""
        policy = self.policy
        held: set[int] = set()
        for rid, home in list(self.waiting.items()):
            req = policy.requests.get(rid)
            if req is None or req.done or req.status is not SWAPPED or req.instance_id != home:
                del self.waiting[rid]
                continue
            tp = policy.models[req.model].tp
            if tp in held:
                continue
            if self.join_decoder(req):
                if home is not None and home in policy.instances:
                    policy.touch(home)  # its KV no longer counts there: prompts held back by it may go now
            else:
                held.add(tp)

    def join(self, inst: InstanceState, req: Request) -> None:
        policy = self.policy
        policy.touch(inst.instance_id)
        policy.note_news()  # news even when it comes with a quiet event (the hand-off's KvMoved)
        state = self.states[inst.instance_id]
        state.members[req.request_id] = None
        state.packed = None
        self._mix_update(state, req, +1)
        req.instance_id = inst.instance_id
        self._admit(inst, state, req)

    def _load_after(self, state: DecodeState, model: str, estimate: int, fresh: tuple[float, float]) -> float:
        """Decode instance choice: the sum of its batches' step times once a request of `model` joins (the share
        of each TPOT period it decodes), plus, for a model it does not hold yet, the switch that adds to every
        round; `fresh` is (step time, switch share) of a model new to the instance."""
        held = state.mix.get(model)
        if held is None:
            return state.load_s + fresh[0] + fresh[1]
        count, context, step_s = held
        return state.load_s + (self.policy.costs.decode_step_s(model, count + 1, context + estimate) - step_s)

    def _mix_update(self, state: DecodeState, req: Request, sign: int) -> None:
        count, context, step_s = state.mix.get(req.model, (0, 0, 0.0))
        count, context = count + sign, context + sign * _context_estimate(req)
        new_s = self.policy.costs.decode_step_s(req.model, int(count), int(context)) if count > 0 else 0.0
        state.load_s += new_s - step_s
        if count > 0:
            state.mix[req.model] = (count, context, new_s)
        else:
            state.mix.pop(req.model, None)

    def _admit(self, inst: InstanceState, state: DecodeState, req: Request) -> None:
        """A newcomer of the model whose turn runs joins it at the next token; one of another model ends an
        open-ended turn, and on a decode instance a quota turn by its next-token deadline (it waits for the
        next turn boundary, where the batch due first goes)."""
        turn = state.turn
        policy = self.policy
        if turn is None or policy.fixed_turn_steps is not None:
            return
        batch, need = turn.batch, policy.kv_need_bytes(req)
        if batch.has(req.model) and batch.kv_bytes + need <= inst.kv_capacity_bytes \
                and len(batch.ids) < policy.max_batch_size and not turn.over:
            batch.ids.append(req.request_id)
            batch.kv_bytes += need
            turn.cut_in()
        else:
            turn.preempt()
            first = self.first_token_at.get(req.request_id)
            if first is not None and inst.spec.role == "decode":  # a quota turn ends by its next-token deadline
                turn.end_by(first + req.num_output_tokens * policy.models[req.model].tpot_slo_s)

    # ---- events ----------------------------------------------------------------
    def ran(self, instance_id: str, num_steps: int) -> None:
        turn = self.states[instance_id].turn
        if turn is not None:
            turn.ran(num_steps)

    def forget(self, request: Request, instance_id: str) -> None:
        state = self.states.get(instance_id)
        if state is not None and request.request_id in state.members:
            del state.members[request.request_id]
            state.packed = None
            self._mix_update(state, request, -1)

    def lose(self, instance_id: str) -> None:
        if instance_id in self.states:
            self.states[instance_id] = DecodeState()


def _context_estimate(req: Request) -> int:
    return req.prompt_tokens + req.max_output_tokens // 2
