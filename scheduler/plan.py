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


# ---- actions (imperative) ----------------------------------------------------
@dataclass(frozen=True, slots=True)
class Switch:
    """Make `model` the instance's active model: weights in, the previous ones
    out (or kept beside it with `evict=False`, for co-location)."""

    model: str
    reason: str
    evict: bool = True


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Start copying `model`'s weights on a side stream; a later Switch finishes it."""

    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class Prefill:
    """Prefill prompts (plus tokens already produced); each yields one token."""

    request_ids: Ids
    reason: str
    kv_to_host: bool = False  # move the KV to host memory afterwards (P/D split)


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class SwapOut:
    """Move these requests' KV from the device to host memory."""

    request_ids: Ids
    reason: str


@dataclass(frozen=True, slots=True)
class SwapIn:
    """Move these requests' KV from host memory to the device."""

    request_ids: Ids
    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """End the instance's in-flight Decode at the next step boundary."""

    reason: str


Action = Union[Switch, Prefetch, Prefill, Decode, SwapOut, SwapIn, Stop]


@dataclass(frozen=True, slots=True)
class Plan:
    """Per instance, the actions to carry out in order; requests refused."""

    at: float
    actions: dict[str, tuple[Action, ...]] = field(default_factory=dict)
    failed: tuple[tuple[str, str], ...] = ()  # (request_id, why)

    def __bool__(self) -> bool:
        return bool(self.actions or self.failed)

    def to_json(self) -> str:
        return json.dumps(plan_to_dict(self), separators=(",", ":"), sort_keys=True)


_OMITTED_WHEN_EMPTY = frozenset({"prefill_chunks"})  # fields added later: absent from JSON unless used


def action_to_dict(action: Action) -> dict[str, object]:
    out: dict[str, object] = {"op": type(action).__name__}
    for f in fields(action):  # not __slots__: compiled (setup.py), the classes have none
        name, value = f.name, getattr(action, f.name)
        if not value and name in _OMITTED_WHEN_EMPTY:
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
@dataclass(frozen=True, slots=True)
class StepDone:
    """A Prefill or Decode finished: `num_steps` tokens for each of `request_ids`.

    `finished_ids` ended on their last token (max tokens, EOS or a stop string).
    """

    instance_id: str
    kind: Literal["prefill", "decode"]
    request_ids: Ids
    num_steps: int
    finished_ids: Ids = ()


@dataclass(frozen=True, slots=True)
class SwitchDone:
    instance_id: str
    model: str


@dataclass(frozen=True, slots=True)
class KvMoved:
    instance_id: str
    request_ids: Ids
    to: Literal["host", "device"]


@dataclass(frozen=True, slots=True)
class InstanceLost:
    instance_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class InstanceAdded:
    """A (restarted or new) instance is ready; its spec is already registered."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class Cancelled:
    request_id: str
    reason: str = "cancelled by client"


Event = Union[StepDone, SwitchDone, KvMoved, InstanceLost, InstanceAdded, Cancelled]
