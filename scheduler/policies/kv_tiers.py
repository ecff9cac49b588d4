"""Admission against both KV tiers: what an instance's device and host memory hold together.

A request admitted to an instance keeps KV there until it ends: on the
device, or in host memory once swapped out to make room. The device budget
alone bounded prefills, so a mixed instance admitted new prompts by moving
running requests out to host memory until the engine's host KV store was
full; the engine then refused the next swap-out, every request there was
re-queued, and the same admissions filled it again (the demo at 1024-token
prompts and concurrency 64 finished 0 of 60 requests in 25 minutes). Where an
instance's host KV is bounded (`InstanceSpec.host_kv_bytes`), a request is
admitted only while the KV of every request homed there - reserved on the
device, or swapped out - plus its own fits the larger of the two tiers: then
host memory holds whatever a swap moves out, even mid-turn, when a batch's KV
goes out before the next batch's comes in (a device's worth out at most, with
everything else already there). A swap-out to make room for a prompt also
happens only when host memory takes it; otherwise the prompt waits in its
queue while the requests admitted run on (back-pressure, never a cycle).
Counted with each request's whole reservation (prompt plus `max_tokens`), as
the device's budget is.

A prefilled request handed over to a decode instance is admitted by the same
rule, and its KV arrives in host memory (the engine's `import_kv` puts it
there before `restore_kv` moves it to the device; KV staged in device memory
goes straight to the device, so counting it there too only errs on the safe
side), so that memory must take it beside what it holds (`in_host`); where no
decode instance's tiers take it, it waits with its KV where it was prefilled,
counted in that instance's tiers (back-pressure on its prompts), and joins
when room frees (token_decode). Before, every hand-off joined a decode
instance unchecked: its homed KV grew without bound, its turn switches swapped
out into a full host store and the engine refused (validate mixed-onoff at the
knee on an H100: 2 and 6 refusals, 157 of 162 and 218 of 228 prompts prefilled
again, attainment 71.6% and 14.0% against 99.4% and 96.5% simulated).

Unbounded host memory (None, the simulator's default) changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from scheduler.request import RUNNING, SWAPPED

if TYPE_CHECKING:
    from scheduler.policies.base import InstanceState, PolicyBase


def host_kv_used(policy: PolicyBase, inst: InstanceState) -> float:
    """KV bytes of the requests swapped out of `inst` or on their way out (planned, not reported yet: still
    RUNNING, no longer on the device); their KV is in its engine's host memory."""
    iid, on_device = inst.instance_id, inst.on_device
    return sum(policy.kv_need_bytes(r) for r in policy.requests.values()
               if r.instance_id == iid and (r.status is SWAPPED or r.status is RUNNING)
               and r.request_id not in on_device)


def tiers_admit(policy: PolicyBase, inst: InstanceState, need_bytes: float, in_host: bool = False) -> bool:
    """Whether one more request of `need_bytes` keeps every request homed on `inst` within its larger KV tier;
    `in_host`: its KV arrives in host memory (a hand-off), which must take it too."""
    if inst.spec.host_kv_bytes is None:
        return True
    return _within(inst, inst.kv_used_bytes, host_kv_used(policy, inst), need_bytes, in_host)


def tiers_ever_admit(inst: InstanceState, need_bytes: float, in_host: bool = False) -> bool:
    """Whether `inst`'s tiers admit a request of `need_bytes` once nothing else is homed there."""
    return inst.spec.host_kv_bytes is None or _within(inst, 0.0, 0.0, need_bytes, in_host)


def _within(inst: InstanceState, device_used: float, host_used: float, need_bytes: float, in_host: bool) -> bool:
    """The tiers' rule (host bounded): a request of `need_bytes` beside what the device and host hold."""
    host = inst.spec.host_kv_bytes
    assert host is not None
    if in_host and host_used + need_bytes > host:
        return False
    return device_used + host_used + need_bytes <= max(inst.kv_capacity_bytes, host)


def host_takes(policy: PolicyBase, inst: InstanceState, request_ids: Iterable[str]) -> bool:
    """Whether `inst`'s host memory takes these device-resident requests' KV on top of what it holds."""
    host = inst.spec.host_kv_bytes
    if host is None:
        return True
    moving = sum(policy.requests[rid].kv_reserved_bytes for rid in request_ids)
    return host_kv_used(policy, inst) + moving <= host
