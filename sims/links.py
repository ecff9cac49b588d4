"""Shared host links: copies that overlap on one PCIe link share its bandwidth.

A weight switch, a prefetch and a KV move each copy bytes between pinned host
memory and a GPU. Instances on one GPU copy over that GPU's link, and GPUs
behind one PCIe switch share its uplink (`pool.gpus_per_host_link`). Each link
direction (host to device, device to host: PCIe is full duplex) serves its
copies in one of two ways; the cost model uses "fifo" at the one rate the
profile's eff_pcie measured (no fitted sharing term). A copy's work is its
time alone.

- "fifo": one copy at a time, in the order they start, as the H200's copy
  engine ran two engines' switches (the copy started second waited for the
  first: 3B alone 0.11 s, behind a 7B 0.39 s). The link keeps the intervals
  booked on it; a new copy fills the gaps from its start on, so a copy booked
  earlier to start later (a KV move after a prefill) keeps its interval.
- "fair": processor sharing, n copies each at rate(n) / n of one copy's rate
  alone. A copy's end is fixed when it starts, against the copies already on
  its link as processor sharing runs them from there; a later copy does not
  move an earlier one's end (booked early by the overlap), but the link's
  state keeps the earlier copy's bytes, so later copies pay for them. Two
  equal copies started together end at d and 2d/rate (both 2d/rate ideally).

rate(1) = 1; with copies overlapping, the link moves `shared_rate` of one
copy's rate (1 in the cost model: the link's bytes are a budget that sharing
neither grows nor shrinks). A tensor-parallel instance copies one shard per GPU in parallel;
its shards on one link are one copy of that many times the work (`link_spans`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from scheduler.costs import InstanceSpec

_DONE = 1e-12  # seconds of work left that count as finished (float dust)


class _Job:
    __slots__ = ("left",)

    def __init__(self, left: float) -> None:
        self.left = left


class _Queue:
    """One direction of one link served first come, first served: the intervals booked on it (sorted)."""

    __slots__ = ("busy", "rate")

    def __init__(self, rate: float) -> None:
        self.busy: list[tuple[float, float]] = []
        self.rate = rate

    def add(self, now: float, start_at: float, work_s: float) -> float:
        """Book a copy of `work_s` seconds alone from `start_at` (>= now) in the link's free time; its end."""
        busy = self.busy
        while busy and busy[0][1] <= now:
            busy.pop(0)
        if not busy or busy[-1][1] <= start_at:  # the link is free from start_at on
            busy.append((start_at, start_at + work_s))
            return start_at + work_s
        if any(end > start_at and begin < start_at + work_s for begin, end in busy):
            work_s /= self.rate  # it overlaps other copies: the link's shared rate
        t, left, k, booked = start_at, work_s, 0, []
        while k < len(busy) and busy[k][1] <= t:
            k += 1
        while left > _DONE:
            if k < len(busy) and busy[k][0] <= t:  # inside a booked interval: wait for its end
                t = max(t, busy[k][1])
                k += 1
                continue
            run = min(left, (busy[k][0] if k < len(busy) else math.inf) - t)
            booked.append((t, t + run))
            t, left = t + run, left - run
        self.busy = sorted(busy + booked)
        return t


class _Channel:
    """One direction of one link shared fairly: the copies in flight at `at`, and those starting later."""

    __slots__ = ("at", "active", "pending", "rate")

    def __init__(self, rate: float) -> None:
        self.at = 0.0
        self.active: list[_Job] = []
        self.pending: list[tuple[float, _Job]] = []  # (start, job), sorted by start
        self.rate = rate

    def add(self, now: float, start_at: float, work_s: float) -> float:
        """Book a copy of `work_s` seconds alone starting at `start_at` (>= now); return when it ends."""
        if now > self.at:
            _run(self, self.active, self.pending, now, None)
        job = _Job(work_s)
        index = len(self.pending)
        while index and self.pending[index - 1][0] > start_at:
            index -= 1
        self.pending.insert(index, (start_at, job))
        if not self.active and len(self.pending) == 1:  # alone on the link: no sweep needed
            return start_at + work_s
        copies = {id(j): _Job(j.left) for j in self.active}
        copies.update((id(j), _Job(j.left)) for _, j in self.pending)
        watch = copies[id(job)]
        active = [copies[id(j)] for j in self.active]
        pending = [(at, copies[id(j)]) for at, j in self.pending]
        probe = _Channel(self.rate)
        probe.at = self.at
        return _run(probe, active, pending, math.inf, watch)


def _run(channel: _Channel, active: list[_Job], pending: list[tuple[float, _Job]], until: float,
         watch: _Job | None) -> float:
    """Advance `channel` (its lists given) to `until`, or until `watch` finishes; returns the time reached."""
    t = channel.at
    while True:
        while pending and pending[0][0] <= t:
            active.append(pending.pop(0)[1])
        if not active:
            if not pending or pending[0][0] >= until:
                t = max(t, until) if math.isfinite(until) else t
                break
            t = pending[0][0]
            continue
        each = (1.0 if len(active) == 1 else channel.rate) / len(active)
        smallest = min(active, key=lambda j: j.left)
        done_at = t + smallest.left / each
        step_to = min(done_at, pending[0][0] if pending else math.inf, until)
        moved = (step_to - t) * each
        for job in active:
            job.left -= moved
        if step_to == done_at:
            smallest.left = 0.0
        t = step_to
        finished = [job for job in active if job.left <= _DONE]
        if finished:
            active[:] = [job for job in active if job.left > _DONE]
            if watch is not None and any(job is watch for job in finished):
                channel.at = t
                return t
        if t >= until:
            break
    channel.at = t
    channel.active, channel.pending = active, pending
    return t


class HostLinks:
    """The copies of one simulation on the host links of its instances (a `sims.costmodel.CopyLinks`)."""

    def __init__(self, spans: Mapping[str, tuple[tuple[int, int], ...]], shared_rate: float = 1.0,
                 sharing: str = "fifo") -> None:
        if not shared_rate > 0:
            raise ValueError(f"shared_rate must be > 0, got {shared_rate}")
        if sharing not in ("fifo", "fair"):
            raise ValueError(f"sharing must be 'fifo' or 'fair', got {sharing!r}")
        self.spans = dict(spans)
        self.shared_rate = shared_rate
        self.sharing = sharing
        self._channels: dict[tuple[int, bool], _Queue | _Channel] = {}

    def copy_end_at(self, instance_id: str, to_device: bool, start_at: float, alone_s: float, now: float) -> float:
        """When a copy of `instance_id` that takes `alone_s` alone, started at `start_at`, ends."""
        spans = self.spans.get(instance_id)
        if spans is None or alone_s <= 0.0:  # an instance the placement does not know has a link of its own
            return start_at + alone_s
        end = start_at
        for link, shards in spans:
            channel = self._channels.get((link, to_device))
            if channel is None:
                channel = self._channels[(link, to_device)] = (_Queue(self.shared_rate) if self.sharing == "fifo"
                                                               else _Channel(self.shared_rate))
            end = max(end, channel.add(now, start_at, alone_s * shards))
        return end


def gpus_of(instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> dict[str, range]:
    """The GPUs (by index) each instance runs on: consecutive GPUs in order, `tp` each (as `make_instances` and
    the capacity layouts cut them), unless `gpu_of` gives an instance's first GPU: instances given the same GPU
    share it (the live pool's prefill and decode instances on one device)."""
    out: dict[str, range] = {}
    next_gpu = 0
    for spec in instances:
        first = gpu_of[spec.instance_id] if gpu_of and spec.instance_id in gpu_of else next_gpu
        out[spec.instance_id] = range(first, first + spec.tp)
        next_gpu = max(next_gpu, first + spec.tp)
    return out


def link_spans(instances: Sequence[InstanceSpec], gpus_per_link: int,
               gpu_of: Mapping[str, int] | None = None) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per instance (placed by `gpus_of`), the links its GPUs sit behind and how many of its GPUs each, as
    (link, GPUs) pairs. GPU g sits behind link g // gpus_per_link."""
    if gpus_per_link < 1:
        raise ValueError(f"gpus_per_link must be >= 1, got {gpus_per_link}")
    out: dict[str, tuple[tuple[int, int], ...]] = {}
    for instance_id, gpus in gpus_of(instances, gpu_of).items():
        counts: dict[int, int] = {}
        for gpu in gpus:
            counts[gpu // gpus_per_link] = counts.get(gpu // gpus_per_link, 0) + 1
        out[instance_id] = tuple(sorted(counts.items()))
    return out
