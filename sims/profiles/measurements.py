"""The measurements file: what `modelpool calibrate` measured on one device, and the terms fitted to it.

One versioned JSON format (`SCHEMA`), written only by `modelpool calibrate` and read only by shipped code
(`sims.profiles.load_profile` turns it into the cost model's profile). Its fields:

- `schema`: "modelpool.measurements/1"; `device` (torch's name for it, or "cpu"), `gpu` (the GPU type the
  terms count for: a catalogue key, or "cpu"), `measured_at` (ISO 8601, UTC), `command`, `software`, `quick`,
  `wall_s`;
- `spec`: the device figures the efficiencies are shares of (the catalogue's datasheet for a known GPU; on a
  CPU its peak rates as calibrate measured them: a large GEMM, a large copy);
- `shapes`: the model shapes microbenchmarked (random weights), by name, as `scheduler.fleet.Arch` fields;
- `points`: every timed point - prefill (shape, tokens per prompt, prompts), decode steps (shape, batch,
  context per request, CUDA graphs or not), weight copies (shape, bytes), KV moves (shape, requests, bytes,
  out and back), the idle pool's host costs (a zero-time engine on the backend `backend` names - serve's
  default where calibrate ran: per engine call by batch, admission, delivery, hand-offs), and two engine
  processes on the device (`share`: a decoder beside a prefiller; `share_decode`: a decoder beside another
  decoding process, both sides timed; files before it: none);
- `terms`: per cost-model term its value, unit, how it was measured, the points behind it and, for the
  engine terms, the leave-one-shape-out error: each shape's points predicted by the terms fitted without
  that shape (the median and the largest |predicted / measured - 1| over those points). A term nothing
  here measures (the NVLink ones on one GPU) says "assumed" and why.

`build` fits the terms (sims.profiles.fitting) and the held-out errors; no torch here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scheduler.fleet import GPUS, Arch, GpuSpec
from sims.profiles import (CalibrationProfile, CalibrationRun, DecodePair, ProfileTerms, Provenance, SharePair,
                           ShapeScale)
from sims.gpu_share import decode_share_table, share_table
from sims.profiles.fitting import Anchor, fit, predict, sig

SCHEMA = "modelpool.measurements/1"
Unit = Literal["fraction", "s", "setting", "ratio"]
ENGINE_FAMILIES = ("prefill", "decode", "swap", "kv_move")
# Terms no single-device microbenchmark measures: what they are taken as, and why.
ASSUMED: dict[str, tuple[float, str]] = {
    "eff_nvlink": (0.5, "assumed: ring all-reduce bus bandwidth about half the NVLink figure (needs two GPUs to "
                        "measure; calibrate times one device)"),
    "allreduce_latency_s": (1e-5, "assumed: ~10 us per small all-reduce over NVLink (needs two GPUs to measure)"),
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PrefillPoint(_Frozen):
    """One prefill: `batch` prompts of `tokens` tokens each, median of its repeats, each timed after the engine
    idled `gap_s` (as a served prefill instance's engine does between prefills; 0: back to back, as files before
    the gap was measured)."""

    shape: str
    tokens: int = Field(gt=0)
    batch: int = Field(gt=0)
    seconds: float = Field(gt=0)
    gap_s: float = Field(default=0.0, ge=0)


class DecodePoint(_Frozen):
    """One decode step of `batch` requests holding `context` tokens each, median of its steps."""

    shape: str
    batch: int = Field(gt=0)
    context: int = Field(gt=0)
    graphs: bool = Field(description="The step replayed a CUDA graph (else it launched its kernels eagerly).")
    seconds: float = Field(gt=0)


class CopyPoint(_Frozen):
    """One whole-model weight copy from pinned host memory onto the device (a switch)."""

    shape: str
    bytes: float = Field(gt=0)
    seconds: float = Field(gt=0)


class KvMovePoint(_Frozen):
    """KV of `batch` requests of `context` tokens moved to host memory (`save_s`) and back (`restore_s`)."""

    shape: str
    batch: int = Field(gt=0)
    context: int = Field(gt=0)
    bytes: float = Field(gt=0)
    save_s: float = Field(gt=0)
    restore_s: float = Field(gt=0)


class GatewayPoint(_Frozen):
    """One request through the gateway on the idle zero-time pool (`modelpool.measure_live.measure_gateway`), its
    client in another process: the client's send to the pool's submit (`in_s`), and per streamed token the pool's
    sink to the client's read (`out_s`); beside them the pool's own admission and delivery of this request, the
    client's TTFT and the gaps between its tokens at the client and at the pool's sink."""

    prompt_tokens: int = Field(gt=0)
    in_s: float
    out_s: list[float] = Field(min_length=1)
    admit_s: float
    deliver_s: float
    ttft_s: float
    client_gap_s: list[float] = Field(default_factory=list)
    pool_gap_s: list[float] = Field(default_factory=list)


class HostPoints(_Frozen):
    """The live pool's own time on an idle pool whose engine takes none (pool.engines.sim_engine at time scale 0),
    on `backend`, each engine call timed in the pool's process: per decode batch size the median time between its
    engine calls; per request the time from submit to its first engine call (`admit_s`) and from that call's
    answer to the token at the request's stream (`deliver_s`)."""

    backend: Literal["ray", "processes", "threads"] = Field(
        default="threads", description="Where the engine calls ran (pool.config.PoolConfig.backend): serve's default on "
        "the device measured (modelpool.serve.default_backend). Files written before the field: threads.")
    step_s_by_batch: dict[int, float] = Field(default_factory=dict)
    admit_s: list[float] = Field(default_factory=list)
    deliver_s: list[float] = Field(default_factory=list)
    handoff_s: list[float] = Field(default_factory=list, description="per request on an idle prefill/decode pool: "
                                   "its prefill call's return to its first decode call's start on the other instance")
    gateway: list[GatewayPoint] = Field(default_factory=list, description="requests through the gateway, one at "
                                        "a time (files written before the field: none)")


class SharePoints(_Frozen):
    """Two engine processes on the device, as serve places a prefill and a decode instance (under a private MPS
    daemon on a GPU, when `mps`): a decoder of `shape` and a prefiller of `prefill_shape` (None: the same shape);
    each prefill's time alone and while the other process decodes without pause, each decode step's alone and
    while the other prefills without pause."""

    shape: str
    prefill_shape: str | None = None
    prefill_tokens: int = Field(gt=0)
    decode_batch: int = Field(gt=0)
    mps: bool = False
    prefill_alone_s: list[float] = Field(min_length=1)
    prefill_beside_s: list[float] = Field(min_length=1)
    decode_alone_s: list[float] = Field(min_length=1)
    decode_beside_s: list[float] = Field(min_length=1)


class DecodeSharePoints(_Frozen):
    """Two engine processes on the device decoding side by side, as a prefill instance runs a hand-off's first
    decode steps while the decode instance beside it decodes (under a private MPS daemon on a GPU, when `mps`): a
    decoder of `shape` (batches of `decode_batch`) stepping without pause while a second process of `peer_shape`
    (batches of `peer_batch`) steps without pause too; each one's steps alone and those that fell wholly inside
    the other's stepping."""

    shape: str
    peer_shape: str
    decode_batch: int = Field(gt=0)
    peer_batch: int = Field(gt=0)
    mps: bool = False
    alone_s: list[float] = Field(min_length=1)
    beside_s: list[float] = Field(min_length=1)
    peer_alone_s: list[float] = Field(min_length=1)
    peer_beside_s: list[float] = Field(min_length=1)


class Points(_Frozen):
    prefill: list[PrefillPoint] = Field(default_factory=list)
    decode: list[DecodePoint] = Field(default_factory=list)
    swap: list[CopyPoint] = Field(default_factory=list)
    kv_move: list[KvMovePoint] = Field(default_factory=list)
    host: HostPoints = Field(default_factory=HostPoints)
    share: list[SharePoints] = Field(default_factory=list)  # per (decoder, prefiller) pair, same shapes first
    share_decode: list[DecodeSharePoints] = Field(default_factory=list)  # per (decoder, second decoder) pair

    @field_validator("share", mode="before")
    @classmethod
    def _one_pair(cls, value: object) -> object:  # files before the pairs of shapes: one pair, or none
        return [] if value is None else [value] if isinstance(value, dict) else value


class Term(_Frozen):
    """One cost-model term as measured (or assumed)."""

    value: float | bool
    unit: Unit
    how: str = Field(min_length=1, description="What measures it (or why it is assumed).")
    basis: Literal["measured", "assumed"] = "measured"
    points: int = Field(default=0, ge=0, description="The points it was fitted to.")
    loo_error: float | None = Field(default=None, description="Median |error| of held-out shapes' points.")
    loo_max_error: float | None = Field(default=None, description="Largest |error| of held-out shapes' points.")


class Measurements(_Frozen):
    """A measurements file (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    schema_: Literal["modelpool.measurements/1"] = Field(alias="schema", description="The format and its version.")
    device: str = Field(min_length=1)
    gpu: str = Field(min_length=1, description="The GPU type the terms count for (a catalogue key, or 'cpu').")
    measured_at: str = Field(min_length=1)
    command: str = Field(min_length=1)
    software: dict[str, str] = Field(default_factory=dict)
    quick: bool = False
    wall_s: float = Field(default=0.0, ge=0)
    spec: GpuSpec
    shapes: dict[str, Arch]
    points: Points
    terms: dict[str, Term]
    figures: dict[str, float] = Field(default_factory=dict, description="Figures measured alongside that are not "
                                                                        "terms (graph capture time, peak rates).")

    def profile(self, name: str = "") -> CalibrationProfile:
        """The cost model's profile: every term's value, with where it comes from."""
        where = f"modelpool calibrate on {self.device}, {self.measured_at[:10]}" + (", --quick" if self.quick else "")
        provenance = {}
        for term, entry in self.terms.items():
            if entry.basis == "assumed":
                provenance[term] = Provenance(status="estimated", source=entry.how)
                continue
            held_out = ("" if entry.loo_error is None else f"; leave-one-shape-out error median {entry.loo_error:.1%}, "
                        f"max {entry.loo_max_error or 0.0:.1%}")
            provenance[term] = Provenance(status="measured", gpus=(self.gpu,),
                                          source=f"{entry.how} ({entry.points} points{held_out}; {where})")
        run = CalibrationRun(command=self.command, device=self.device, gpu=self.gpu, measured_at=self.measured_at,
                             software=self.software, quick=self.quick, shapes=tuple(self.shapes), wall_s=self.wall_s,
                             figures=self.figures,
                             backend=self.points.host.backend if self.points.host.step_s_by_batch else None)
        values = {term: entry.value for term, entry in self.terms.items()}
        if "decode_ahead" not in values and self.device != "cpu":  # a file before the term: the engine's CUDA default
            values["decode_ahead"] = True                          # then (async decode, 4212c7f) was on
            provenance["decode_ahead"] = Provenance(status="measured", gpus=(self.gpu,), source=(
                f"{_HOW['decode_ahead']}; not in this file (written before the term): on, the engine's CUDA default"))
        profile = CalibrationProfile(
            name=name or f"{self.gpu}-measured", terms=ProfileTerms.model_validate(values),
            provenance=provenance, calibration=run, device_spec=None if self.gpu in GPUS else self.spec,
            share_pairs=share_pairs(self.points.share, self.shapes),
            decode_pairs=decode_pairs(self.points.share_decode, self.shapes),
            description=f"Measured by `{self.command}` on {self.device} ({self.measured_at[:10]}).")
        return profile.model_copy(update={"shape_scales": shape_scales(self.points, self.shapes, self.spec,
                                                                       self.gpu, profile)})

    def anchors(self, shapes: Sequence[str] | None = None) -> list[Anchor]:
        return anchors_of(self.points, shapes)


def anchors_of(points: Points, shapes: Sequence[str] | None = None) -> list[Anchor]:
    """The engine points (of `shapes`, all by default) as fitting anchors; a KV move counts out and back."""
    keep = set(shapes) if shapes is not None else None

    def wanted(shape: str) -> bool:
        return keep is None or shape in keep

    out = [Anchor("prefill", p.shape, p.seconds, p.batch, p.tokens) for p in points.prefill if wanted(p.shape)]
    out += [Anchor("decode", d.shape, d.seconds, d.batch, d.context, cuda_graphs=d.graphs)
            for d in points.decode if wanted(d.shape)]
    out += [Anchor("swap", s.shape, s.seconds, swap_bytes=s.bytes) for s in points.swap if wanted(s.shape)]
    for k in points.kv_move:
        if wanted(k.shape):
            out += [Anchor("kv_move", k.shape, seconds, k.batch, swap_bytes=k.bytes) for seconds in (k.save_s, k.restore_s)]
    return out


_HOW = {
    "eff_compute": "prefill of every shape at several lengths and prompt counts, each after an idle gap as served: "
                   "the FLOPs line's slope",
    "prefill_fixed_s": "prefill: the FLOPs line's intercept",
    "prefill_layer_s": "prefill: per layer, across shapes of different depths",
    "prefill_request_s": "prefill: per prompt, at 1 and several prompts",
    "eff_mem": "decode steps of every shape by batch and context: the weight bytes' slope",
    "eff_kv": "decode steps: the KV bytes read's slope (contexts varied)",
    "decode_fixed_s": "decode steps: the intercept",
    "decode_layer_s": "decode steps: per layer, across shapes of different depths",
    "decode_request_s": "decode steps: per request of the batch (batches varied at fixed context per request)",
    "launch_s_per_layer": "eager decode steps (no CUDA graphs): what they take beyond the graph steps, per layer",
    "decode_cuda_graphs": "the engine's setting on this device (CUDA graphs on CUDA)",
    "prefill_cuda_graphs": "the engine's setting (prefill runs eagerly)",
    "prefill_padded": "the engine's setting on this device (it pads prefill tokens on CUDA)",
    "decode_ahead": "the engine's setting on this device (async decode: on CUDA it queues the next step ahead)",
    "eff_pcie": "whole-model weight copies from pinned host memory of every shape: bytes over time",
    "switch_fixed_s": "weight copies: the intercept",
    "eff_kv_move": "KV moves to host memory and back, by requests and context: bytes over time",
    "kv_move_fixed_s": "KV moves: the intercept (per move)",
    "host_call_s": "an idle live pool on a zero-time engine: time between engine calls, intercept over batch size",
    "host_token_s": "an idle live pool on a zero-time engine: time between engine calls, slope per request",
    "request_admit_s": "requests one at a time through the gateway (a client in another process, streaming) to an "
                       "idle live pool on a zero-time engine: the client's send to the first engine call, the "
                       "intercept of its medians over prompt lengths (files before the gateway probe: the pool's "
                       "submit to the first engine call)",
    "request_prompt_token_s": "requests through the gateway to an idle zero-time pool: the client's send to the "
                              "first engine call, the slope of its medians over prompt lengths (16 to 4096 tokens)",
    "token_deliver_s": "requests through the gateway to an idle zero-time pool: the first call's return to the "
                       "token read by the client (median; files before the gateway probe: to the pool's stream)",
    "kv_call_host_s": "an idle prefill/decode pool on zero-time engines: a hand-off's prefill return to its first "
                      "decode call (median), less host_call_s, over its two KV moves",
    "share_prefill_slowdown": "two engine processes on the device (a prefill and a decode instance, as serve places "
                              "them): a prefill's median time while the other decodes, over its time alone",
    "share_decode_slowdown": "two engine processes on the device: a decode step's median time while the other "
                             "prefills, over its time alone",
}
_FAMILY = {"eff_compute": "prefill", "prefill_fixed_s": "prefill", "prefill_layer_s": "prefill",
           "prefill_request_s": "prefill", "eff_mem": "decode", "eff_kv": "decode", "decode_fixed_s": "decode",
           "decode_layer_s": "decode", "decode_request_s": "decode", "launch_s_per_layer": "decode",
           "eff_pcie": "swap", "switch_fixed_s": "swap", "eff_kv_move": "kv_move", "kv_move_fixed_s": "kv_move"}


def fit_engine(points: Points, shapes: Mapping[str, Arch], spec: GpuSpec) -> dict[str, float | bool]:
    """The engine terms fitted to every point of `shapes` (sims.profiles.fitting)."""
    return dict(fit(anchors_of(points, list(shapes)), spec, shapes.__getitem__).terms)


def leave_one_shape_out(points: Points, shapes: Mapping[str, Arch], spec: GpuSpec, gpu: str,
                        base: Mapping[str, float | bool]) -> dict[str, list[float]]:
    """Per family (prefill, decode, swap, kv_move), the |error| of every point of each shape predicted by the
    terms fitted to the other shapes' points alone (`base`: the terms the fit does not set). Empty with fewer
    than three shapes (two points of a line say nothing held out)."""
    errors: dict[str, list[float]] = {family: [] for family in ENGINE_FAMILIES}
    if len(shapes) < 3:
        return errors
    for held in shapes:
        rest = {name: arch for name, arch in shapes.items() if name != held}
        terms = {**base, **fit_engine(points, rest, spec)}
        profile = CalibrationProfile(name="held-out", terms=ProfileTerms.model_validate(terms),
                                     provenance={t: Provenance(status="estimated", source="held out")
                                                 for t in ProfileTerms.model_fields})
        anchors = anchors_of(points, [held])
        for anchor, check in zip(anchors, predict(profile, anchors, spec, gpu, shapes.__getitem__)):
            errors[anchor.kind].append(abs(check.error))
    return errors


def shape_scales(points: Points, shapes: Mapping[str, Arch], spec: GpuSpec, gpu: str,
                 profile: CalibrationProfile) -> list[ShapeScale]:
    """Per shape with prefill points, measured / predicted by `profile` (its formula, no scales): the median over
    them all, and by prompt count and tokens per prompt (the median of the points of one pair): how the shape's
    cost departs from the formula as its prompts grow."""
    anchors = [a for a in anchors_of(points) if a.kind == "prefill"]
    ratios: dict[str, list[float]] = {}
    grid: dict[str, dict[int, dict[int, list[float]]]] = {}
    for anchor, check in zip(anchors, predict(profile, anchors, spec, gpu, shapes.__getitem__)):
        if check.predicted_s > 0:
            ratio = anchor.measured_s / check.predicted_s
            ratios.setdefault(anchor.arch, []).append(ratio)
            grid.setdefault(anchor.arch, {}).setdefault(anchor.batch, {}).setdefault(anchor.tokens, []).append(ratio)
    return [ShapeScale(shape=shape, arch=shapes[shape], prefill=sig(statistics.median(values)), points=len(values),
                       by_prompts=[(prompts, [(tokens, sig(statistics.median(r))) for tokens, r in sorted(row.items())])
                                   for prompts, row in sorted(grid[shape].items())])
            for shape, values in ratios.items()]


def host_terms(host: HostPoints) -> dict[str, tuple[float, int]]:
    """The pool's host terms (value, points) from the idle pool's points: a + b x batch through the step times."""
    out: dict[str, tuple[float, int]] = {}
    steps = sorted(host.step_s_by_batch.items())
    if len(steps) >= 2:
        call, slope = _line([float(b) for b, _ in steps], [s for _, s in steps])
        out["host_token_s"] = (sig(slope), len(steps))
        out["host_call_s"] = (sig(call), len(steps))
    elif steps:
        out["host_call_s"] = (sig(steps[0][1]), 1)
    if host.gateway:  # through the gateway, as clients measure: its way in and out with the pool's own
        out |= gateway_terms(host.gateway)
    else:  # files written before the gateway probe: the pool's own way in and out
        if host.admit_s:
            out["request_admit_s"] = (sig(statistics.median(host.admit_s)), len(host.admit_s))
        if host.deliver_s:
            out["token_deliver_s"] = (sig(statistics.median(host.deliver_s)), len(host.deliver_s))
    if host.handoff_s:  # a hand-off is a SwapOut and a SwapIn, then the decode call (host_call_s) that follows
        call = out.get("host_call_s", (0.0, 0))[0]
        out["kv_call_host_s"] = (sig(max(0.0, (statistics.median(host.handoff_s) - call) / 2)), len(host.handoff_s))
    return out


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares a + b x with b >= 0 (a time never falls as work grows: a negative slope is noise) and a >= 0."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread) if spread else 0.0
    return max(0.0, mean_y - slope * mean_x), slope


def gateway_terms(points: Sequence[GatewayPoint]) -> dict[str, tuple[float, int]]:
    """The way in and out of a request as its client sees it (value, points), from requests through the gateway:
    per prompt length the median of the client's send to the prefill call's issue (the gateway's way in, then the
    pool's admission), a line over prompt tokens (`request_admit_s` its intercept, `request_prompt_token_s` its
    slope: the body's ids parsed and checked); `token_deliver_s` the median of the prefill call's answer to the
    first token read by the client (the pool's delivery, then the gateway's way out)."""
    by_length: dict[int, list[float]] = {}
    for point in points:
        by_length.setdefault(point.prompt_tokens, []).append(point.in_s + point.admit_s)
    lengths = sorted(by_length)
    intercept, slope = _line([float(n) for n in lengths], [statistics.median(by_length[n]) for n in lengths])
    return {"request_admit_s": (sig(intercept), len(points)),
            "request_prompt_token_s": (sig(slope), len(points)),
            "token_deliver_s": (sig(statistics.median(p.deliver_s + p.out_s[0] for p in points)), len(points))}


def share_slowdowns(pair: SharePoints) -> tuple[float, float]:
    """A pair's (decode, prefill) slowdowns: medians beside over medians alone, at least 1 (a ratio under 1 is
    noise: a process is never helped by another's work)."""

    return _slowdown(pair.decode_beside_s, pair.decode_alone_s), _slowdown(pair.prefill_beside_s, pair.prefill_alone_s)


def decode_share_slowdowns(run: DecodeSharePoints) -> tuple[float, float]:
    """A decode-beside-decode run's slowdowns, (the decoder's, the second process's): medians beside over medians
    alone, at least 1 (as `share_slowdowns`)."""
    return _slowdown(run.beside_s, run.alone_s), _slowdown(run.peer_beside_s, run.peer_alone_s)


def _slowdown(beside: list[float], alone: list[float]) -> float:
    return sig(max(1.0, statistics.median(beside) / statistics.median(alone)))


def share_terms(share: Sequence[SharePoints]) -> dict[str, tuple[float, int]]:
    """The share terms (value, points): the slowdowns of the largest shape measured beside itself (the first pair
    of files before the pairs of shapes); the pairs themselves are the profile's `share_pairs`."""
    longest = max((pair.prefill_tokens for pair in share), default=0)
    same = [pair for pair in share if pair.prefill_shape in (None, pair.shape) and pair.prefill_tokens == longest]
    if not same:
        return {}
    pair = same[-1]
    decode, prefill = share_slowdowns(pair)
    return {"share_prefill_slowdown": (prefill, len(pair.prefill_alone_s) + len(pair.prefill_beside_s)),
            "share_decode_slowdown": (decode, len(pair.decode_alone_s) + len(pair.decode_beside_s))}


def share_pairs(share: Sequence[SharePoints], shapes: Mapping[str, Arch]) -> list[SharePair]:
    """The profile's share table: each measured pair's slowdowns with its two shapes' weight bytes and its prompt
    length; none where the pairs do not cover every decoder shape beside every prefiller shape at every length
    (files with one pair: the terms say it)."""
    pairs = []
    for pair in share:
        prefill_shape = pair.prefill_shape or pair.shape
        decode, prefill = share_slowdowns(pair)
        pairs.append(SharePair(decode_shape=pair.shape, prefill_shape=prefill_shape,
                               decode_bytes=shapes[pair.shape].weight_bytes,
                               prefill_bytes=shapes[prefill_shape].weight_bytes, prompt_tokens=pair.prefill_tokens,
                               decode_slowdown=decode, prefill_slowdown=prefill))
    if len(pairs) < 2:
        return []
    try:
        share_table(pairs)  # the simulator's rule for a whole grid
    except ValueError:
        return []
    return pairs


def decode_pairs(share_decode: Sequence[DecodeSharePoints], shapes: Mapping[str, Arch]) -> list[DecodePair]:
    """The profile's decode share table: per shape beside a shape, the median of the slowdowns its runs measured
    (a run gives both sides': a decoder of A beside a second of B gives A beside B and B beside A), with the two
    shapes' weight bytes; none where they do not cover every shape beside every shape."""
    measured: dict[tuple[str, str], list[float]] = {}
    for run in share_decode:
        mine, peers = decode_share_slowdowns(run)
        measured.setdefault((run.shape, run.peer_shape), []).append(mine)
        measured.setdefault((run.peer_shape, run.shape), []).append(peers)
    pairs = [DecodePair(decode_shape=shape, peer_shape=peer, decode_bytes=shapes[shape].weight_bytes,
                        peer_bytes=shapes[peer].weight_bytes, slowdown=sig(statistics.median(slowdowns)))
             for (shape, peer), slowdowns in measured.items()]
    try:
        decode_share_table(pairs)  # the simulator's rule for a whole grid
    except ValueError:
        return []
    return pairs


def build(points: Points, shapes: Mapping[str, Arch], spec: GpuSpec, *, device: str, gpu: str, measured_at: str,
          command: str, settings: Mapping[str, bool], software: Mapping[str, str] | None = None, quick: bool = False,
          wall_s: float = 0.0, figures: Mapping[str, float] | None = None) -> Measurements:
    """The measurements file of `points`: every term fitted, with its held-out error. `settings`: the engine's
    settings on this device (decode_cuda_graphs, prefill_padded, decode_ahead)."""
    fitted = fit_engine(points, shapes, spec)
    base: dict[str, float | bool] = {term: value for term, (value, _) in ASSUMED.items()}
    base |= {"prefill_cuda_graphs": False, **settings}
    for term in ProfileTerms.model_fields:  # a term the points could not determine: the model's neutral value
        if term not in fitted and term not in base and ProfileTerms.model_fields[term].is_required():
            base[term] = 1.0 if term.startswith("eff_") else 0.0
    errors = leave_one_shape_out(points, shapes, spec, gpu, base)
    counts = {"prefill": len(points.prefill), "decode": len(points.decode), "swap": len(points.swap),
              "kv_move": 2 * len(points.kv_move)}
    terms: dict[str, Term] = {}
    for term, value in {**base, **fitted}.items():
        if term in ASSUMED and term not in fitted:
            terms[term] = Term(value=value, unit=_unit(term), how=ASSUMED[term][1], basis="assumed")
            continue
        family = _FAMILY.get(term)
        held = errors.get(family or "", [])
        terms[term] = Term(value=value, unit=_unit(term), how=_HOW.get(term, "the engine's setting"),
                           points=counts.get(family or "", 0),
                           loo_error=round(statistics.median(held), 4) if held else None,
                           loo_max_error=round(max(held), 4) if held else None)
    for term, (value, count) in host_terms(points.host).items():
        terms[term] = Term(value=value, unit="s", how=f"{_HOW[term]}; engine calls on the {points.host.backend} "
                           "backend", points=count)
    for term, (value, count) in share_terms(points.share).items():
        mps = " under MPS" if points.share and points.share[0].mps else ""
        terms[term] = Term(value=value, unit="ratio", how=_HOW[term] + mps, points=count)
    return Measurements.model_validate({
        "schema": SCHEMA, "device": device, "gpu": gpu, "measured_at": measured_at, "command": command,
        "software": dict(software or {}), "quick": quick, "wall_s": round(wall_s, 1), "spec": spec,
        "shapes": dict(shapes), "points": points, "terms": terms, "figures": dict(figures or {})})


def held_out_errors(measurements: Measurements) -> dict[str, tuple[float, float]]:
    """Per engine family, (median, max) leave-one-shape-out |error|, as recorded on its terms."""
    out: dict[str, tuple[float, float]] = {}
    for term, family in _FAMILY.items():
        entry = measurements.terms.get(term)
        if entry is not None and entry.loo_error is not None and family not in out:
            out[family] = (entry.loo_error, entry.loo_max_error or 0.0)
    return out


def _unit(term: str) -> Unit:
    field = ProfileTerms.model_fields[term]
    if field.annotation is bool:
        return "setting"
    return "fraction" if term.startswith("eff_") else "s"
