"""GPU time-sharing: device work of instances placed on one GPU slows down while they overlap.

The live pool runs each instance in its own OS process; two on one GPU are time-sliced by CUDA (no MPS),
so while both have work in flight each runs slower. Processor sharing: while k instances that share a GPU
are busy, each progresses at share(k) of its rate alone,

    share(1) = 1,  share(k) = 2 / (k * slowdown)  (k >= 2),

`slowdown` the profile's `gpu_share_slowdown`: how much longer one instance's work takes beside one other
busy instance (fitted to the H200 probe, benchmarks/gpu_prefill_probe.py). Below 2 the pair together gets
more done than one alone (each fills the other's gaps); at 2 the GPU is split without gain or loss.

The executor books each step's device work here (`work_end_at`) when it starts it. A step's end is fixed
when it is booked, against the work its peers booked before (their intervals as the simulator runs them); a
later step does not move an earlier one's end (its completion is already scheduled). What the later step takes
from an earlier one is owed instead: processor sharing would have run the earlier step that much longer. The
owed work runs on from the end its instance's work was booked to, alone, and the instance's next step does
what is left of it first (all of it when that step follows at once, as a decode turn after a Stop does;
none after an idle gap as long). A Stop that cuts a step short (`cut`) gives back what it owed and did not run.
Peers are the instances that share any GPU with one (tensor-parallel instances span several).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from scheduler.costs import InstanceSpec
from sims.links import gpus_of

_DONE = 1e-12  # seconds of work left that count as finished (float dust)


def share(busy: int, slowdown: float) -> float:
    """The rate, as a share of its rate alone, of each of `busy` instances busy on one GPU."""
    return 1.0 if busy <= 1 else 2.0 / (busy * slowdown)


def gpu_peers(instances: Sequence[InstanceSpec], gpu_of: Mapping[str, int] | None = None) -> dict[str, tuple[str, ...]]:
    """Per instance that shares a GPU (placed by sims.links.gpus_of), the instances it shares one with, in
    the order given; instances with GPUs of their own are left out."""
    placed = gpus_of(instances, gpu_of)
    out: dict[str, tuple[str, ...]] = {}
    for spec in instances:
        mine = set(placed[spec.instance_id])
        peers = tuple(other.instance_id for other in instances
                      if other.instance_id != spec.instance_id and mine.intersection(placed[other.instance_id]))
        if peers:
            out[spec.instance_id] = peers
    return out


class _Booking:
    """One step's device work as booked: its interval and the owed work it paid first."""

    __slots__ = ("begin", "end", "owed_s")

    def __init__(self, begin: float, end: float, owed_s: float) -> None:
        self.begin, self.end, self.owed_s = begin, end, owed_s


class GpuTimeSharing:
    """The device work of one simulation's instances on shared GPUs (a `scheduler.costs.GpuShares`)."""

    def __init__(self, peers: Mapping[str, tuple[str, ...]], slowdown: float) -> None:
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1, got {slowdown}")
        self.peers = dict(peers)
        self.slowdown = slowdown
        self._booked: dict[str, list[_Booking]] = {iid: [] for iid in self.peers}
        self._owed: dict[str, float] = {iid: 0.0 for iid in self.peers}
        self._booked_to: dict[str, float] = {iid: 0.0 for iid in self.peers}  # the end of its latest booking

    def work_end_at(self, instance_id: str, start_at: float, alone_s: float, now: float) -> float:
        """When device work of `instance_id` that takes `alone_s` alone, started at `start_at` (>= `now`), ends."""
        peers = self.peers.get(instance_id)
        if peers is None:  # a GPU of its own
            return start_at + alone_s
        for iid in (instance_id, *peers):
            self._prune(iid, now)
        owed = max(0.0, self._owed[instance_id] - max(0.0, start_at - self._booked_to[instance_id]))
        self._owed[instance_id] = 0.0
        left = alone_s + owed
        t = start_at
        while left > _DONE:
            busy = [p for p in peers if _busy(self._booked[p], t)]
            rate = share(1 + len(busy), self.slowdown)
            boundary = min((edge for p in peers for b in self._booked[p] for edge in (b.begin, b.end) if edge > t),
                           default=math.inf)
            run = min(left / rate, boundary - t)
            for p in busy:  # each busy peer slows down from share(k) to share(k + 1): it owes the difference
                k = 1 + sum(1 for q in self.peers[p] if q != instance_id and _busy(self._booked[q], t))
                self._owed[p] += run * (share(k, self.slowdown) - share(k + 1, self.slowdown))
            left = 0.0 if run == left / rate else left - run * rate
            t += run
        self._booked[instance_id].append(_Booking(start_at, t, owed))
        self._booked_to[instance_id] = t
        return t

    def cut(self, instance_id: str, at: float) -> None:
        """`instance_id`'s work booked past `at` ends at `at` (a Stop): what it no longer runs of the work it
        owed is owed again."""
        for booking in self._booked.get(instance_id, ()):
            if booking.end > at:
                kept = max(0.0, at - booking.begin) / (booking.end - booking.begin)
                self._owed[instance_id] += booking.owed_s * (1.0 - kept)
                booking.owed_s *= kept
                booking.end = max(booking.begin, at)
                self._booked_to[instance_id] = booking.end

    def _prune(self, instance_id: str, now: float) -> None:
        booked = self._booked[instance_id]
        while booked and booked[0].end <= now:
            booked.pop(0)


def _busy(booked: list[_Booking], t: float) -> bool:
    for booking in booked:
        if booking.begin <= t < booking.end:
            return True
    return False
