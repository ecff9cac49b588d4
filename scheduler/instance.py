"""The instance model: which models an instance can compute with, what a switch, prefetch and KV move cost,
and what each action requires. Written once; the simulator's executor (sims.simulator), the engines' model
slots (pool.engines: sim, torch, vllm) and the parity harness's fake engine (tests/parity) all use it.

Weights. An instance computes with its *resident* models: the active one (the last switched in) and any
co-located beside it (`Switch(model, evict=False)`, as spatial does). Beside them it may hold *cached* models
that are not resident: ones a Prefetch copied in, or ones a Switch switched away from (a free switch back).
A Switch to

- a resident model only makes it the active one: nothing is copied, it costs nothing;
- a cached model changes its role once its copy is done: it costs what is left of that copy;
- any other model copies its weights in whole (the cost model's `switch_s`).

With `evict` (the default) the resident set becomes that one model and the model switched away from is cached;
without, the model joins the resident set. A Prefetch of a model neither resident nor cached copies it in
(cached); otherwise it does nothing. Prefill and decode run only on resident models.

Which models stay cached is the plan's to say or the *one-spare* rule's. An action with `keep` (token-level's
resident set) names every model besides the one it switches to or prefetches that stays on the device: the
others are freed, and keeping a model the instance does not hold is refused. Without `keep` at most one model is
cached, the latest (the spare slot). Where sizes are known (`capacity_bytes` and `model_bytes`: an engine's
model region, or a policy's planned weight budget), the models held must fit: without `keep` the spare is
dropped first; a switch or prefetch whose models cannot fit is refused.

KV. A request's KV is on this instance's device or in host memory. Prefill places it on the device;
decode needs it there; a SwapOut (`save_kv`) moves it to host memory, a SwapIn (`restore_kv`) back; a
release frees it wherever it is and costs nothing. One KV move (a SwapOut or SwapIn of several requests,
a prefill's KV sent to host) costs its requests' `kv_move_s` plus one `kv_move_overhead_s`: the engine
issues a move's copies together (`kv_move_s` below). A hand-off between a prefill and a decode instance on
one GPU moves KV within it instead (`staging_instances`; sims.simulator charges it).

Refusals raise `RefusedAction` (scheduler.errors) with a message that names the model or request; the
callers turn it into their own error (EngineError, InvariantViolation).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence

from scheduler.costs import CostModel
from scheduler.errors import NoKvRoom, RefusedAction
from scheduler.plan import Switch


def switched(resident: frozenset[str], model: str, evict: bool) -> frozenset[str]:
    """The models an instance computes with after a Switch to `model`: that one alone with `evict`, else it joins
    `resident`."""
    return frozenset((model,)) if evict else resident | {model}


def resident_after(resident: frozenset[str], actions: Iterable[object]) -> frozenset[str]:
    """The models an instance computes with after one plan's `actions`, given those it computed with before.

    A *model switch* is a plan after which they differ: one, however many Switch actions it took (a joint
    decode turn planned step by step switches its models back in at every step and changes nothing), whether or
    not weights are copied (those are `ModelSlots`' copies). The live pool (pool.service) and the simulator
    (sims.simulator) count model switches by this rule."""
    out = resident
    for action in actions:
        if isinstance(action, Switch):
            out = switched(out, action.model, action.evict)
    return out


class ModelSlots:
    """The models an instance holds: the resident set (the active model among them) and the cached ones."""

    def __init__(self, capacity_bytes: float | None = None, model_bytes: Mapping[str, float] | None = None) -> None:
        self.active: str | None = None
        self.resident: set[str] = set()
        self.cached: dict[str, float] = {}  # not resident: model -> when its copy is (or was) done, oldest first
        self.capacity_bytes = capacity_bytes
        self.model_bytes = model_bytes

    @property
    def spare(self) -> str | None:
        """The latest cached model (the one-spare rule's spare slot), None when nothing is cached."""
        return next(reversed(self.cached), None)

    def held(self) -> list[str]:
        """Every model whose weights are on the device (resident first, sorted; then the cached, oldest first)."""
        return sorted(self.resident) + list(self.cached)

    def held_bytes(self) -> float:
        sizes = self.model_bytes or {}
        return sum(sizes.get(m, 0.0) for m in self.held())

    def snapshot(self) -> tuple[str | None, set[str], dict[str, float]]:
        """The state, for `restore` (an engine that fails a copy rolls the rule back)."""
        return self.active, set(self.resident), dict(self.cached)

    def restore(self, state: tuple[str | None, set[str], dict[str, float]]) -> None:
        self.active, self.resident, self.cached = state[0], set(state[1]), dict(state[2])

    def switch(self, model: str, at: float, evict: bool = True,
               keep: Collection[str] | None = None) -> tuple[bool, float]:
        """Make `model` the active model at `at`; returns (copy, wait_s): whether its weights must be copied in
        whole (the caller times the copy), else the seconds until its cached copy is done. `keep`: the models
        besides it that stay on the device (None: the one-spare rule)."""
        wait_s = 0.0
        copy = False
        if model in self.resident:
            pass
        elif model in self.cached:
            wait_s = max(0.0, self.cached[model] - at)
        else:
            copy = True
        if keep is not None:
            self._require_held(keep, f"switch to {model!r}")
        old, resident = self.active, set(switched(frozenset(self.resident), model, evict))
        cached = {m: ready for m, ready in self.cached.items() if m != model}
        if keep is not None:
            if evict:  # the models that stop being resident stay cached where `keep` says
                for m in sorted(self.resident - {model}):
                    cached[m] = at
            cached = {m: ready for m, ready in cached.items() if m in keep}
            self._need_room(sorted(resident) + list(cached), what=f"switch to {model!r} keeping {sorted(keep)}")
        else:
            self._need_room(sorted(resident), what=f"switch to {model!r}" if evict else f"co-locating {model!r}")
            if evict and old is not None and old != model:
                cached = {old: at}  # the spare slot: the model switched away from
            cached = dict(list(cached.items())[-1:])
            if cached and not self._fits(sorted(resident) + list(cached)):
                cached = {}
        self.resident, self.cached, self.active = resident, cached, model
        return copy, wait_s

    def prefetch(self, model: str, ready_at: float, keep: Collection[str] | None = None) -> bool:
        """Copy `model` in beside the resident ones, done at `ready_at` (`set_ready` may move it); False when
        there is nothing to copy (resident or cached already) or, without `keep`, no room beside the resident.
        `keep` as in `switch` (a model to keep that is not held, or models that do not fit, are refused)."""
        if keep is not None:
            self._require_held(keep, f"prefetch of {model!r}")
        if model in self.resident or model in self.cached:
            if keep is not None:
                self.cached = {m: r for m, r in self.cached.items() if m in keep or m == model}
            return False
        if keep is not None:
            cached = {m: r for m, r in self.cached.items() if m in keep}
            self._need_room(sorted(self.resident) + list(cached) + [model],
                            what=f"prefetch of {model!r} keeping {sorted(keep)}")
        elif self._fits(sorted(self.resident) + [model]):
            cached = {}
        else:
            return False
        cached[model] = ready_at
        self.cached = cached
        return True

    def set_ready(self, model: str, ready_at: float) -> None:
        """When the cached `model`'s copy is done (the caller timed the copy after `prefetch`)."""
        if model in self.cached:
            self.cached[model] = ready_at

    def deactivate(self, model: str) -> None:
        """`model` stops being resident; its weights stay, cached (a free switch back; the one-spare rule)."""
        if model not in self.resident:
            return
        self.resident.discard(model)
        if self.active == model:
            self.active = None
        self.cached = {model: 0.0}

    def drop(self, model: str) -> None:
        """Forget the cached copy of `model` (its next switch copies it in again); a resident one is refused."""
        if model in self.resident:
            raise RefusedAction(f"model {model!r} is resident; deactivate it first")
        self.cached.pop(model, None)

    def require_resident(self, model: str, what: str) -> None:
        """Refuse `what` (a prefill or decode of `model`) unless `model` is resident."""
        if model not in self.resident:
            raise RefusedAction(f"{what}: model {model!r} is not resident (resident: {sorted(self.resident)}, "
                                f"active: {self.active!r})")

    def clear(self) -> None:
        self.active = None
        self.resident, self.cached = set(), {}

    # ---- sizes ----------------------------------------------------------------------------
    def _require_held(self, keep: Collection[str], what: str) -> None:
        missing = sorted(m for m in keep if m not in self.resident and m not in self.cached)
        if missing:
            raise RefusedAction(f"{what}: cannot keep {missing}: not on the device (held: {self.held()})")

    def _fits(self, models: Sequence[str]) -> bool:
        if self.capacity_bytes is None or self.model_bytes is None:
            return True
        return sum(self.model_bytes.get(m, 0.0) for m in models) <= self.capacity_bytes * (1 + 1e-9)

    def _need_room(self, models: Sequence[str], what: str) -> None:
        if not self._fits(models):
            sizes = self.model_bytes or {}
            raise RefusedAction(f"{what}: models {list(models)} need {sum(sizes.get(m, 0.0) for m in models):.0f} "
                                f"bytes of weights; the instance's model region holds {self.capacity_bytes:.0f}")


def kv_held_bytes(bytes_per_token: float, prompt_tokens: int, output_tokens: int) -> float:
    """The device KV a request holds on an instance: its whole context, the prompt and every output token."""
    return float(bytes_per_token * (prompt_tokens + output_tokens))


def kv_fits(used_bytes: float, capacity_bytes: float) -> bool:
    """Whether `used_bytes` of KV fit a device that holds `capacity_bytes` (up to float rounding)."""
    return used_bytes <= capacity_bytes * (1 + 1e-9)


class KvPlaces:
    """Where each request's KV is, for one instance: on its device (True) or in host memory (False).

    With `capacity_bytes`, the device holds at most that much KV: each request counts the bytes given when
    it was placed or admitted (`kv_held_bytes`, as the simulator counts them), and
    a placement or move that would exceed it is refused (an engine's refusal for lack of KV).
    """

    def __init__(self, capacity_bytes: float | None = None) -> None:
        self.on_device: dict[str, bool] = {}
        self.capacity_bytes = capacity_bytes
        self.nbytes: dict[str, float] = {}
        self.device_bytes = self.peak_bytes = 0.0

    def place(self, request_id: str, nbytes: float = 0.0) -> None:
        """A prefill put the request's KV on the device (an imported request's arrives in host memory)."""
        if request_id in self.on_device:
            raise RefusedAction(f"request {request_id!r} is already on this instance")
        self._to_device([request_id], {request_id: nbytes})
        self.on_device[request_id] = True
        self.nbytes[request_id] = nbytes

    def admit_to_host(self, request_id: str, nbytes: float = 0.0) -> None:
        if request_id in self.on_device:
            raise RefusedAction(f"request {request_id!r} is already on this instance")
        self.on_device[request_id] = False
        self.nbytes[request_id] = nbytes

    def _to_device(self, request_ids: Sequence[str], nbytes: Mapping[str, float]) -> None:
        adding = sum(nbytes[rid] for rid in request_ids)
        if self.capacity_bytes is not None and not kv_fits(self.device_bytes + adding, self.capacity_bytes):
            raise NoKvRoom(f"no room for the KV of {list(request_ids)}: {adding / 1e9:.3f} GB more on a device "
                                f"holding {self.device_bytes / 1e9:.3f} of {self.capacity_bytes / 1e9:.3f} GB")
        self.device_bytes += adding
        self.peak_bytes = max(self.peak_bytes, self.device_bytes)

    def require(self, request_id: str) -> bool:
        """Whether the request's KV is on the device; refused when the instance does not hold the request."""
        where = self.on_device.get(request_id)
        if where is None:
            raise RefusedAction(f"unknown request {request_id!r} (finished, released or never prefilled here)")
        return where

    def require_on_device(self, request_id: str, what: str) -> None:
        if not self.require(request_id):
            raise RefusedAction(f"{what} of request {request_id!r}: its KV is in host memory; restore it first")

    def move(self, request_ids: Sequence[str], to_device: bool) -> list[str]:
        """Move the requests' KV (all must be held here); returns those that moved (the others were there)."""
        moved = [rid for rid in request_ids if self.require(rid) != to_device]
        if to_device:
            self._to_device(moved, self.nbytes)
        else:
            self.device_bytes -= sum(self.nbytes[rid] for rid in moved)
        for rid in moved:
            self.on_device[rid] = to_device
        return moved

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the requests wherever their KV is; unknown ids are ignored."""
        for rid in request_ids:
            if self.on_device.pop(rid, False):
                self.device_bytes -= self.nbytes[rid]
            self.nbytes.pop(rid, None)


def kv_move_s(costs: CostModel, moves: Sequence[tuple[str, int]]) -> float:
    """The time of one KV move of (model, tokens) pairs: each request's `kv_move_s` plus one overhead (that of
    the first request's model); nothing moves, nothing is paid, for none."""
    if not moves:
        return 0.0
    took = 0.0
    for model, tokens in moves:
        took += costs.kv_move_s(model, tokens)
    return took + costs.kv_move_overhead_s(moves[0][0])


def staging_instances(roles: Mapping[str, str], gpus: Mapping[str, Collection[Hashable]]) -> set[str]:
    """The instances that hand requests off through device memory (pool.engines.handoff): the prefill instances
    on GPUs every decode instance shares. Their SwapOut stages a request's KV in their own device memory, the
    decode instance's SwapIn copies it from there: both copies within the GPU (sims.simulator's `kv_device_move_s`),
    none on a host link. Other prefill instances hand off through host memory. `gpus`: each instance's GPUs."""
    decoders = [iid for iid, role in roles.items() if role == "decode"]
    return {iid for iid, role in roles.items()
            if role == "prefill" and decoders and all(set(gpus[d]) == set(gpus[iid]) for d in decoders)}


def prefill_s(costs: CostModel, prompts: Sequence[tuple[str, int]]) -> float:
    """The time of one prefill of (model, tokens) prompts: one `prefill_s` per model over its prompts."""
    by_model: dict[str, list[int]] = {}
    for model, tokens in prompts:
        totals = by_model.setdefault(model, [0, 0])
        totals[0] += tokens
        totals[1] += 1
    took = 0.0
    for model, (tokens, count) in by_model.items():
        took += costs.prefill_s(model, tokens, count)
    return took


def decode_turn_s(costs: CostModel, batch: Sequence[tuple[str, int]], num_steps: int = 1) -> float:
    """The time of `num_steps` decode steps of (model, context tokens) requests: each model's batch reads its own
    weights, so the models' `decode_turn_s` add up."""
    by_model: dict[str, list[int]] = {}
    for model, context in batch:
        totals = by_model.setdefault(model, [0, 0])
        totals[0] += 1
        totals[1] += context
    took = 0.0
    for model, (size, context) in by_model.items():
        took += costs.decode_turn_s(model, size, context, num_steps)
    return took
