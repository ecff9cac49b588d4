"""GPU time-sharing: device work of instances placed on one GPU slows down while they overlap.

The live pool runs each instance in its own OS process; two on one GPU are time-sliced by CUDA (no MPS),
so while both have work in flight each runs slower. Processor sharing: while k instances that share a GPU
are busy, each progresses at share(k) of its rate alone,

    share(1) = 1,  share(k) = 2 / (k * slowdown)  (k >= 2),

`slowdown` how much longer one instance's work takes beside one other busy instance. Below 2 the pair
together gets more done than one alone (each fills the other's gaps); at 2 the GPU is split without gain or
loss, the rule the cost model uses (sims.costmodel.SHARED_GPU_SLOWDOWN: the GPU's budget shared, no fitted
term). Work beside a peer of the other kind may slow by a measured figure of its own: decode beside a peer's
prefill (or mixed iteration) by `decode_slowdown`, prefill beside a peer's decode by `prefill_slowdown` (under
MPS a prefill's large GEMMs take the SMs from the decode steps beside them far more than the other way round);
`modelpool calibrate` measures both (two engine processes on one device, as serve places a prefill and a decode
instance), a profile without them leaves them at `slowdown`. Measured at pairs of shapes (a `ShareTable`: a
decoder of one size beside a prefiller of another, prompts of more than one length), the two slowdowns follow the
sizes of the work's model and of the peer's (per-GPU weight bytes) and the prefill's prompt tokens (multilinear in
their logarithms between the values measured, the nearest measured value's figure beyond them). A decode step
beside a peer's decode steps (a prefill instance running a hand-off's first steps beside the decode instance)
slows by a figure calibrate measures too, by the two models' sizes (a `DecodeShareTable`, bilinear in their
logarithms the same way); a profile without one, or a model of unknown size, leaves it at `slowdown`, as prefill
beside prefill always is. Beside several peers the largest applicable slowdown counts. Each booking carries its work: its kind ("prefill": prefills and
mixed iterations; "decode": turns), its model's size and its prompt tokens.

The executor books each step's device work here (`work_end_at`) when it starts it, and a step's end is
fixed then (its completion is already scheduled). So a step is charged for the sharing its peers will impose
over its whole span, as far as that can be told when it is booked: the work its peers booked before (their
intervals as the simulator runs them), and a peer busy when it starts is taken to stay busy to its end, as
a decode instance booking turn after turn is. (Charging only the peer's booked interval left a prefill's end
early, and what the decode turns booked after its start took from it owed to its next step.) The guess is
settled as the peers book: a peer's later work inside a step that counted on it owes that step nothing, and
where the peer idled instead the step ran faster than booked, a credit for its instance's next step. Work a
step did not count on (a peer that started it after the step began) is owed: processor sharing would have
run the step that much longer. Owed work runs on from the end its instance's work was booked to, alone, and
the instance's next step does what is left of it first (all of it when that step follows at once, as a
decode turn after a Stop does; none after an idle gap as long); a credit counts only for a step that follows
at once. A Stop that cuts a step short (`cut`) gives back what it owed and did not run, and its peers' steps
that counted on it find it idle from there.
Peers are the instances that share any GPU with one (tensor-parallel instances span several).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

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


class _Grid:
    """Figures measured at every combination of the values measured on each of its axes (sizes, prompt tokens:
    all > 0), each figure a slowdown (>= 1). Between the values measured a figure is multilinear in their
    logarithms; beyond them the nearest measured value's figure holds (nothing extrapolated)."""

    def __init__(self, rows: Sequence[tuple[float, ...]], axes: tuple[str, ...], what: str) -> None:
        n = len(axes)
        if not rows:
            raise ValueError(f"a {what} needs at least one measured pair")
        for row in rows:
            if not (min(row[:n]) > 0 and min(row[n:]) >= 1.0):
                raise ValueError(f"a {what} row needs sizes and tokens > 0 and slowdowns >= 1, got {row}")
        self._axes = [sorted({row[axis] for row in rows}) for axis in range(n)]
        self._logs = [[math.log(value) for value in axis] for axis in self._axes]
        self._grid = {tuple(row[:n]): tuple(row[n:]) for row in rows}
        missing = [corner for corner in itertools.product(*self._axes) if corner not in self._grid]
        if missing:
            raise ValueError(f"a {what} needs every combination of the values measured; missing "
                             f"({', '.join(axes)}): {missing}")

    def at(self, point: Sequence[float], which: int) -> float:
        """Figure `which` of the rows at `point` (a value per axis)."""
        corners: list[tuple[tuple[float, ...], float]] = [((), 1.0)]  # the measured points around it, each weighed
        for axis, logs, value in zip(self._axes, self._logs, point):
            low, high, w = _bracket(axis, logs, value)
            corners = [(key + (v,), weight * part) for key, weight in corners
                       for v, part in ((low, 1.0 - w), (high, w)) if part]
        total = 0.0
        for key, weight in corners:
            total += weight * self._grid[key][which]
        return total


class ShareTable:
    """The two cross-kind slowdowns measured at points of a grid: the per-GPU weight bytes of the decoding model,
    those of the prefilling model, and the prefill's prompt tokens. Rows (decode_bytes, prefill_bytes,
    prompt_tokens, decode_slowdown, prefill_slowdown) cover every combination of the values measured on each
    axis (every decoder size beside every prefiller size at every prompt length). Between those values a slowdown
    is multilinear in their logarithms; beyond them the nearest measured value's figure holds (nothing
    extrapolated)."""

    def __init__(self, rows: Sequence[tuple[float, float, float, float, float]]) -> None:
        self._grid = _Grid(rows, ("decode_bytes", "prefill_bytes", "prompt_tokens"), "share table")

    def decode_slowdown(self, decode_bytes: float, prefill_bytes: float, prompt_tokens: float) -> float:
        """How much longer a decode step of a model of `decode_bytes` takes beside a prefill of `prompt_tokens`
        of a model of `prefill_bytes`."""
        return self._grid.at((decode_bytes, prefill_bytes, prompt_tokens), 0)

    def prefill_slowdown(self, decode_bytes: float, prefill_bytes: float, prompt_tokens: float) -> float:
        """How much longer a prefill of `prompt_tokens` of a model of `prefill_bytes` takes beside decode steps of
        a model of `decode_bytes`."""
        return self._grid.at((decode_bytes, prefill_bytes, prompt_tokens), 1)


class DecodeShareTable:
    """A decode step's slowdown beside a peer's decode steps, measured at every size of the decoding model beside
    every size of the peer's (per-GPU weight bytes): rows (decode_bytes, peer_bytes, slowdown). Bilinear in the
    logarithms of the two sizes between the values measured; beyond them the nearest measured value's figure."""

    def __init__(self, rows: Sequence[tuple[float, float, float]]) -> None:
        self._grid = _Grid(rows, ("decode_bytes", "peer_bytes"), "decode share table")

    def slowdown(self, decode_bytes: float, peer_bytes: float) -> float:
        """How much longer a decode step of a model of `decode_bytes` takes beside decode steps of a model of
        `peer_bytes` in another process."""
        return self._grid.at((decode_bytes, peer_bytes), 0)


def share_table(pairs: Sequence[Any]) -> ShareTable | None:
    """The table of a profile's `share_pairs` (sims.profiles.SharePair: sizes, prompt tokens, the two slowdowns),
    None for none; a ValueError where they do not cover the grid."""
    if not pairs:
        return None
    return ShareTable([(p.decode_bytes, p.prefill_bytes, p.prompt_tokens, p.decode_slowdown, p.prefill_slowdown)
                       for p in pairs])


def decode_share_table(pairs: Sequence[Any]) -> DecodeShareTable | None:
    """The table of a profile's `decode_pairs` (sims.profiles.DecodePair: the two sizes, the slowdown), None for
    none; a ValueError where they do not cover every size beside every size."""
    if not pairs:
        return None
    return DecodeShareTable([(p.decode_bytes, p.peer_bytes, p.slowdown) for p in pairs])


def _bracket(values: list[float], logs: list[float], value: float) -> tuple[float, float, float]:
    """The measured values around `value` and its weight toward the upper one (log-linear; clamped at the ends)."""
    if value <= values[0]:
        return values[0], values[0], 0.0
    if value >= values[-1]:
        return values[-1], values[-1], 0.0
    upper = next(k for k, v in enumerate(values) if v >= value)
    return values[upper - 1], values[upper], (math.log(value) - logs[upper - 1]) / (logs[upper] - logs[upper - 1])


Work = tuple[str, float, int]  # what a step runs: its kind, its model's per-GPU weight bytes (0: unknown), and
# its prompt tokens (a prefill's or a mixed iteration's chunks; 0 for a decode turn)


class _Booking:
    """One step's device work as booked: its interval, the owed work (or credit) it paid first, and the peers it
    counted on staying busy, each with the time up to which that guess is settled; `gain`: the rate it runs
    faster at (a share of its rate alone) while one of them idles instead."""

    __slots__ = ("begin", "end", "owed_s", "counted", "gain", "work")

    def __init__(self, begin: float, end: float, owed_s: float, counted: dict[str, float], gain: float,
                 work: Work) -> None:
        self.begin, self.end, self.owed_s, self.counted, self.gain = begin, end, owed_s, counted, gain
        self.work = work

    def idle_credit(self, since: float, until: float) -> float:
        """The work this step ran ahead of its booking while a peer it counted on idled from `since` to `until`."""
        idle = min(until, self.end) - max(since, self.begin)
        return idle * self.gain if idle > 0 else 0.0


class GpuTimeSharing:
    """The device work of one simulation's instances on shared GPUs (a `sims.costmodel.GpuShares`)."""

    def __init__(self, peers: Mapping[str, tuple[str, ...]], slowdown: float,
                 decode_slowdown: float | None = None, prefill_slowdown: float | None = None,
                 table: ShareTable | None = None, model_bytes: Mapping[str, float] | None = None,
                 decode_table: DecodeShareTable | None = None) -> None:
        """`table`: the cross-kind slowdowns by the sizes of the two models (`model_bytes`: per-GPU weight bytes by
        model), in place of `decode_slowdown` and `prefill_slowdown` (which then only count for work of a model
        `model_bytes` does not know); `decode_table`: a decode step's slowdown beside a peer's decode steps by the
        two sizes, in place of `slowdown` there (prefill beside prefill keeps `slowdown`)."""
        for name, value in (("slowdown", slowdown), ("decode_slowdown", decode_slowdown),
                            ("prefill_slowdown", prefill_slowdown)):
            if value is not None and not value >= 1.0:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.peers = dict(peers)
        self.slowdown = slowdown
        self.decode_slowdown = decode_slowdown if decode_slowdown is not None else slowdown
        self.prefill_slowdown = prefill_slowdown if prefill_slowdown is not None else slowdown
        self.table = table
        self.decode_table = decode_table
        self.model_bytes = dict(model_bytes or {})
        self._latest: dict[str, Work] = {iid: ("prefill", 0.0, 0) for iid in self.peers}  # its latest booking's
        self._booked: dict[str, list[_Booking]] = {iid: [] for iid in self.peers}
        self._owed: dict[str, float] = {iid: 0.0 for iid in self.peers}  # < 0: a credit
        self._booked_to: dict[str, float] = {iid: 0.0 for iid in self.peers}  # the end of its latest booking

    def rate(self, work: Work, beside: list[Work]) -> float:
        """The rate (a share of its rate alone) of `work` while peers doing the work `beside` are busy."""
        return share(1 + len(beside), max((self._pair(work, other) for other in beside), default=self.slowdown))

    def _pair(self, work: Work, other: Work) -> float:
        """How much longer `work` takes beside one busy peer doing `other`."""
        (kind, size, tokens), (other_kind, other_size, other_tokens) = work, other
        sized = size > 0 and other_size > 0
        table = self.table if sized else None
        if kind == "decode" and other_kind == "decode":
            return self.decode_table.slowdown(size, other_size) if sized and self.decode_table is not None \
                else self.slowdown
        if kind == "decode" and other_kind == "prefill":
            if table is not None and other_tokens > 0:
                return table.decode_slowdown(size, other_size, other_tokens)
            return self.decode_slowdown
        if kind == "prefill" and other_kind == "decode":
            if table is not None and tokens > 0:
                return table.prefill_slowdown(other_size, size, tokens)
            return self.prefill_slowdown
        return self.slowdown

    def work_end_at(self, instance_id: str, start_at: float, alone_s: float, now: float,
                    kind: str = "prefill", models: Sequence[str] = (), tokens: int = 0) -> float:
        """When device work of `instance_id` that takes `alone_s` alone, started at `start_at` (>= `now`), ends;
        `kind`: "decode" for a decode turn, "prefill" for a prefill or a mixed iteration; `models`: those it runs
        (the largest sets its size); `tokens`: a prefill's prompt tokens (a mixed iteration's chunks)."""
        peers = self.peers.get(instance_id)
        if peers is None:  # a GPU of its own
            return start_at + alone_s
        work: Work = (kind, max((self.model_bytes.get(model, 0.0) for model in models), default=0.0), tokens)
        for iid in (instance_id, *peers):
            self._prune(iid, now)
        self._settle(instance_id, start_at)
        owed = self._take_owed(instance_id, start_at)
        staying = {p for p in peers if _busy(self._booked[p], start_at)}  # counted on to stay busy
        left = max(0.0, alone_s + owed)
        t = start_at
        while left > _DONE:
            busy: dict[str, Work] = {}  # each busy peer, its work at t (past its booked end: its latest)
            for p in peers:
                booking = _at(self._booked[p], t)
                if booking is not None or (p in staying and t >= self._booked_to[p]):
                    busy[p] = booking.work if booking is not None else self._latest[p]
            rate = self.rate(work, list(busy.values()))
            boundary = min((edge for p in peers for b in self._booked[p] for edge in (b.begin, b.end) if edge > t),
                           default=math.inf)
            run = min(left / rate, boundary - t)
            for p in busy:  # each busy peer slows down from its rate beside the others to its rate beside this
                booking = _at(self._booked[p], t)  # work too: it owes the difference, unless it counted on this
                if booking is not None and instance_id not in booking.counted:  # instance staying busy
                    others = [b.work for q in self.peers[p] if q != instance_id
                              for b in (_at(self._booked[q], t),) if b is not None]
                    self._owed[p] += run * (self.rate(booking.work, others) - self.rate(booking.work, [*others, work]))
            left = 0.0 if run == left / rate else left - run * rate
            t += run
        for p in peers:  # this work, up to t, is what the peers' steps that counted on it expected
            for booking in self._booked[p]:
                if instance_id in booking.counted:
                    booking.counted[instance_id] = max(booking.counted[instance_id], t)
        works = [b.work for p in staying for b in (_at(self._booked[p], start_at),) if b is not None]
        gain = self.rate(work, works[1:]) - self.rate(work, works)  # while one of them idles instead
        self._booked[instance_id].append(_Booking(start_at, t, owed, {p: self._booked_to[p] for p in staying}, gain,
                                                  work))
        self._booked_to[instance_id] = t
        self._latest[instance_id] = work
        return t

    def cut(self, instance_id: str, at: float) -> None:
        """`instance_id`'s work booked past `at` ends at `at` (a Stop): what it no longer runs of the work it
        owed is owed again, and peers that counted on that work find it idle from `at`."""
        for booking in self._booked.get(instance_id, ()):
            if booking.end > at:
                kept = max(0.0, at - booking.begin) / (booking.end - booking.begin)
                self._owed[instance_id] += booking.owed_s * (1.0 - kept)
                booking.owed_s *= kept
                booking.end = max(booking.begin, at)
                self._booked_to[instance_id] = booking.end
        for peer in self.peers.get(instance_id, ()):
            for booking in self._booked[peer]:
                if booking.counted.get(instance_id, -math.inf) > at:
                    booking.counted[instance_id] = at

    def _take_owed(self, instance_id: str, start_at: float) -> float:
        """What `instance_id`'s step at `start_at` does first: the owed work an idle gap since its last booked
        end has not run, or a credit (< 0) when the step follows at once."""
        owed, gap = self._owed[instance_id], max(0.0, start_at - self._booked_to[instance_id])
        self._owed[instance_id] = 0.0
        return max(0.0, owed - gap) if owed > 0 or gap > 0 else owed

    def _settle(self, instance_id: str, until: float) -> None:
        """Peers' steps that counted on `instance_id` staying busy: it idled from what they saw up to `until`,
        so they ran faster than booked there (a credit for their next step)."""
        for peer in self.peers[instance_id]:
            for booking in self._booked[peer]:
                since = booking.counted.get(instance_id)
                if since is not None:
                    self._owed[peer] -= booking.idle_credit(since, until)
                    booking.counted[instance_id] = max(since, until)

    def _prune(self, instance_id: str, now: float) -> None:
        booked = self._booked[instance_id]
        while booked and booked[0].end <= now:  # over: no peer can book work inside it any more
            booking = booked.pop(0)
            for peer, since in booking.counted.items():
                self._owed[instance_id] -= booking.idle_credit(since, booking.end)


def _busy(booked: list[_Booking], t: float) -> bool:
    return _at(booked, t) is not None


def _at(booked: list[_Booking], t: float) -> _Booking | None:
    for booking in booked:
        if booking.begin <= t < booking.end:
            return booking
    return None

