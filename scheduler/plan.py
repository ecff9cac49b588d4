"""What the scheduler decides (actions, Plan) and what it is told (events).

Actions are imperatives carried out in order on one instance; each carries the
`reason` it was chosen. Events are past-tense facts reported by an executor.
Plans serialise to one JSON line each: the audit trail and the parity artifact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Literal, Union

Ids = tuple[str, ...]

# The classes below are frozen dataclasses (equality, repr, hash, `fields()`) with their constructors written out:
# compiled (setup.py), such an __init__ is native (~0.1 us), while the one dataclasses generates stays interpreted
# (~0.5 us), and the simulator builds one action or event per step of its loop. Frozen: fields are set through
# object.__setattr__, spelled out (mypyc compiles that call to a plain slot store).


# ---- actions (imperative) ----------------------------------------------------
@dataclass(frozen=True, slots=True, init=False)
class Switch:
    """Make `model` the instance's active model: weights in, the previous ones
    out (or kept beside it with `evict=False`, for co-location). `keep`: the
    models besides it that stay on the device, cached (a resident set planned
    by the policy); None: the instance model's one-spare rule (scheduler.instance)."""

    model: str
    reason: str
    evict: bool = True
    keep: tuple[str, ...] | None = None

    def __init__(self, model: str, reason: str, evict: bool = True, keep: tuple[str, ...] | None = None) -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "evict", evict)
        object.__setattr__(self, "keep", keep)


@dataclass(frozen=True, slots=True, init=False)
class Prefetch:
    """Start copying `model`'s weights on a side stream; a later Switch finishes it. `keep` as in Switch:
    the other cached models that stay (None: it replaces the spare)."""

    model: str
    reason: str
    keep: tuple[str, ...] | None = None

    def __init__(self, model: str, reason: str, keep: tuple[str, ...] | None = None) -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "keep", keep)


@dataclass(frozen=True, slots=True, init=False)
class Prefill:
    """Prefill prompts (plus tokens already produced); each yields one token."""

    request_ids: Ids
    reason: str
    kv_to_host: bool = False  # move the KV to host memory afterwards (P/D split)

    def __init__(self, request_ids: Ids, reason: str, kv_to_host: bool = False) -> None:
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "kv_to_host", kv_to_host)


@dataclass(frozen=True, slots=True, init=False)
class Decode:
    """Run up to `max_steps` decode steps for a batch.

    The turn ends early when a request in it finishes or a Stop arrives; the
    StepDone event says how many steps ran.

    `prefill_chunks` makes it one Sarathi-style mixed iteration (then
    `max_steps` is 1): besides one token for each of `request_ids`, it
    computes `tokens` more prompt tokens of each (request_id, tokens) pair,
    requests the scheduler holds in PREFILLING. A chunk that completes its
    request's prompt (plus tokens produced before a re-prefill) yields that
    request's first token, and the StepDone lists it among `request_ids`;
    a partial chunk yields nothing. Plan JSON omits the field when empty.
    """

    request_ids: Ids
    max_steps: int
    reason: str
    prefill_chunks: tuple[tuple[str, int], ...] = ()

    def __init__(self, request_ids: Ids, max_steps: int, reason: str,
                 prefill_chunks: tuple[tuple[str, int], ...] = ()) -> None:
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "max_steps", max_steps)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "prefill_chunks", prefill_chunks)


@dataclass(frozen=True, slots=True, init=False)
class SwapOut:
    """Move these requests' KV from the device to host memory."""

    request_ids: Ids
    reason: str

    def __init__(self, request_ids: Ids, reason: str) -> None:
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "reason", reason)


@dataclass(frozen=True, slots=True, init=False)
class SwapIn:
    """Move these requests' KV from host memory to the device."""

    request_ids: Ids
    reason: str

    def __init__(self, request_ids: Ids, reason: str) -> None:
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "reason", reason)


@dataclass(frozen=True, slots=True, init=False)
class Stop:
    """End the instance's in-flight Decode at the next step boundary."""

    reason: str

    def __init__(self, reason: str) -> None:
        object.__setattr__(self, "reason", reason)


Action = Union[Switch, Prefetch, Prefill, Decode, SwapOut, SwapIn, Stop]


@dataclass(frozen=True, slots=True, init=False)
class Plan:
    """Per instance, the actions to carry out in order; requests refused."""

    at: float
    actions: dict[str, tuple[Action, ...]] = field(default_factory=dict)
    failed: tuple[tuple[str, str], ...] = ()  # (request_id, why)

    def __init__(self, at: float, actions: dict[str, tuple[Action, ...]] | None = None,
                 failed: tuple[tuple[str, str], ...] = ()) -> None:
        object.__setattr__(self, "at", at)
        object.__setattr__(self, "actions", {} if actions is None else actions)
        object.__setattr__(self, "failed", failed)

    def __bool__(self) -> bool:
        return bool(self.actions or self.failed)

    def to_json(self) -> str:
        return json.dumps(plan_to_dict(self), separators=(",", ":"), sort_keys=True)


_OMITTED_WHEN_EMPTY = frozenset({"prefill_chunks"})  # fields added later: absent from JSON unless used
_OMITTED_WHEN_NONE = frozenset({"keep"})


def action_to_dict(action: Action) -> dict[str, object]:
    out: dict[str, object] = {"op": type(action).__name__}
    for f in fields(action):  # not __slots__: compiled (setup.py), the classes have none
        name, value = f.name, getattr(action, f.name)
        if (not value and name in _OMITTED_WHEN_EMPTY) or (value is None and name in _OMITTED_WHEN_NONE):
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def plan_to_dict(plan: Plan) -> dict[str, object]:
    return {
        "at": round(plan.at, 9),
        "actions": {iid: [action_to_dict(a) for a in acts] for iid, acts in sorted(plan.actions.items())},
        "failed": [list(pair) for pair in plan.failed],
    }


# ---- events (past tense) -------------------------------------------------------
@dataclass(frozen=True, slots=True, init=False)
class StepDone:
    """A Prefill or Decode finished: `num_steps` tokens for each of `request_ids`.

    `finished_ids` ended on their last token (max tokens, EOS or a stop string).
    """

    instance_id: str
    kind: Literal["prefill", "decode"]
    request_ids: Ids
    num_steps: int
    finished_ids: Ids = ()

    def __init__(self, instance_id: str, kind: Literal["prefill", "decode"], request_ids: Ids, num_steps: int,
                 finished_ids: Ids = ()) -> None:
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "num_steps", num_steps)
        object.__setattr__(self, "finished_ids", finished_ids)


@dataclass(frozen=True, slots=True, init=False)
class SwitchDone:
    instance_id: str
    model: str

    def __init__(self, instance_id: str, model: str) -> None:
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "model", model)


@dataclass(frozen=True, slots=True, init=False)
class KvMoved:
    instance_id: str
    request_ids: Ids
    to: Literal["host", "device"]

    def __init__(self, instance_id: str, request_ids: Ids, to: Literal["host", "device"]) -> None:
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "to", to)


@dataclass(frozen=True, slots=True, init=False)
class InstanceLost:
    instance_id: str
    reason: str = ""

    def __init__(self, instance_id: str, reason: str = "") -> None:
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "reason", reason)


@dataclass(frozen=True, slots=True, init=False)
class KvRefused:
    """An instance's engine found no room for KV the plan gave it (a refusal, not a loss): what was in flight
    there did not run, and every request placed on it goes back to the queue, to resume from prompt plus the
    tokens it produced. The instance stays (with no model taken as active: the next Switch says which)."""

    instance_id: str
    reason: str = ""

    def __init__(self, instance_id: str, reason: str = "") -> None:
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "reason", reason)


@dataclass(frozen=True, slots=True, init=False)
class InstanceAdded:
    """A (restarted or new) instance is ready; its spec is already registered."""

    instance_id: str

    def __init__(self, instance_id: str) -> None:
        object.__setattr__(self, "instance_id", instance_id)


@dataclass(frozen=True, slots=True, init=False)
class Cancelled:
    request_id: str
    reason: str = "cancelled by client"

    def __init__(self, request_id: str, reason: str = "cancelled by client") -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "reason", reason)


Event = Union[StepDone, SwitchDone, KvMoved, InstanceLost, KvRefused, InstanceAdded, Cancelled]
