"""Calibration profiles: the measured efficiencies and overheads the roofline uses.

A profile is JSON shipped as package data (`h200-cudagraph.json`, ...) or any
file on disk. Every number carries its provenance: "measured" on the GPUs it
names (and where), or "estimated". On a GPU the measurement did not cover, a
"measured" number is an extrapolation and reports as "estimated"; `basis` says
how: an efficiency carried by the GPU's datasheet ratios, or a time carried over.
`sims.profiles.fit` regenerates the shipped files from ANCHORS.md's figures.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.fleet import Arch, GpuSpec

Fraction = Annotated[float, Field(gt=0, le=1)]
Seconds = Annotated[float, Field(ge=0)]
Status = Literal["measured", "estimated"]
Basis = Literal["measured", "datasheet ratio", "carried over", "assumed"]
BASES: tuple[Basis, ...] = ("measured", "datasheet ratio", "carried over", "assumed")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProfileTerms(_Frozen):
    """The calibrated terms of the roofline for one GPU type (see sims.costmodel)."""

    eff_compute: Fraction = Field(description="Achieved share of the datasheet BF16 FLOP rate in prefill GEMMs and attention.")
    eff_mem: Fraction = Field(description="Achieved share of datasheet HBM bandwidth when a decode step streams the weights.")
    eff_kv: Fraction = Field(description="Achieved share of datasheet HBM bandwidth when decode attention reads the KV cache.")
    eff_pcie: Fraction = Field(description="Achieved share of nominal host-to-device bandwidth copying from pinned host memory.")
    eff_nvlink: Fraction = Field(description="Ring all-reduce bus bandwidth as a share of the GPU's nvlink_gb_s figure.")
    prefill_fixed_s: Seconds = Field(description="Per prefill step overhead not proportional to layers, FLOPs or bytes.")
    prefill_layer_s: Seconds = Field(description="Per layer overhead of a prefill step (small kernels, gaps between kernels).")
    decode_fixed_s: Seconds = Field(description="Per decode step overhead (graph launch, sampling, synchronisation).")
    launch_s_per_layer: Seconds = Field(description="Host time to launch one layer's kernels eagerly; without CUDA graphs a step "
                                                    "takes at least num_layers times this (the GPU runs behind the host).")
    decode_cuda_graphs: bool = Field(description="Decode steps replay CUDA graphs, so the host launch floor does not apply.")
    prefill_cuda_graphs: bool = Field(description="Prefill steps replay CUDA graphs, so the host launch floor does not apply.")
    switch_fixed_s: Seconds = Field(description="Per switch overhead on top of copying the weight shard (allocation, bookkeeping).")
    allreduce_latency_s: Seconds = Field(description="Latency of one small tensor-parallel all-reduce over NVLink.")
    # Engine overheads fitted on microbenchmark points of several shapes (`modelpool calibrate`); a profile
    # without them charges nothing more (their provenance: DEFAULTED).
    prefill_request_s: Seconds = Field(default=0.0, description="Per prompt overhead of a prefill step (the engine "
                                                                "runs attention and sampling prompt by prompt).")
    decode_ahead: bool = Field(default=False, description="The engine queues each decode step's successor on the "
                               "device before the host has the step's tokens (the torch engine on CUDA): a turn the "
                               "next call does not continue with the same requests leaves that step to run, and "
                               "the instance's next work waits for it (the simulator charges one more step).")
    prefill_padded: bool = Field(default=False, description="The engine pads each prefill's tokens to "
                                 "scheduler.costs.padded_prefill_tokens (the torch engine on CUDA): its matrix work "
                                 "and K/V writes are charged for the padded count, attention for the prompts' own.")
    decode_layer_s: Seconds = Field(default=0.0, description="Per layer GPU time of a decode step on top of its "
                                    "bytes (a CUDA-graph step's small kernels each take a few microseconds however "
                                    "little they do): fitted where the shapes measured tell layers from weight bytes.")
    decode_request_s: Seconds = Field(default=0.0, description="GPU time a decode step takes per request of its "
                                      "batch on top of its KV reads (logits and sampling over the vocabulary, each "
                                      "sequence's attention setup): fitted where batch and context per request vary "
                                      "apart.")
    eff_kv_move: Fraction | None = Field(default=None, description="Achieved share of nominal host link bandwidth "
                                                                   "when KV moves between host and device memory "
                                                                   "(paged block copies); None: eff_pcie.")
    kv_move_fixed_s: Seconds = Field(default=0.0, description="Per move overhead of moving KV (one SwapOut or SwapIn "
                                                              "of several requests, a prefill's KV hand-off).")
    # The pool's own host costs, measured on an idle pool whose engine takes no time (`modelpool calibrate`).
    host_call_s: Seconds = Field(default=0.0, description="Host time the live pool adds to each engine call (a "
                                 "prefill or a decode step): the controller's tick, the backend's hop, the runner; "
                                 "charged after the call's device time (the host waits for each step's tokens).")
    host_token_s: Seconds = Field(default=0.0, description="Host time the live pool adds to an engine call per "
                                  "token it delivers (per request of a decode step's batch): the token out of the "
                                  "engine, through the backend and the controller to the request's stream.")
    request_admit_s: Seconds = Field(default=0.0, description="Time from a client sending a request to the engine "
                                     "call it starts on an idle instance (the gateway's way in, the pool's "
                                     "admission): the simulator hands each request to the scheduler that long after "
                                     "its arrival.")
    request_prompt_token_s: Seconds = Field(default=0.0, description="Time the way in adds per prompt token (the "
                                            "gateway parsing and checking the prompt's ids): the simulator counts a "
                                            "request's first and last tokens that much later per prompt token (a "
                                            "fraction of a millisecond at thousands of tokens, spent before the "
                                            "live pool has the request: charged on the client's times, the "
                                            "scheduler's order kept).")
    token_deliver_s: Seconds = Field(default=0.0, description="Time from an engine call returning a token to the "
                                     "request's client having it (the pool's stream, the gateway's SSE line, the "
                                     "client's read): the simulator counts each token that long after its step.")
    kv_call_host_s: Seconds = Field(default=0.0, description="Host time the live pool adds to each KV move (a "
                                    "SwapOut or SwapIn: its export, import, save or restore calls and the ticks "
                                    "between them), after the move's own time: measured from hand-offs on an idle "
                                    "prefill/decode pool, half of what a hand-off adds beyond its decode call.")
    # How two instances' processes on one device slow each other (`modelpool calibrate`: two engine processes, as
    # serve places a prefill and a decode instance on a GPU, under MPS there); None: the shared budget's 2.
    share_prefill_slowdown: float | None = Field(default=None, ge=1.0, description="How much longer a prefill "
                                                 "takes while another instance's process on the same device "
                                                 "decodes (sims.gpu_share); None: 2 (the device's budget split).")
    share_decode_slowdown: float | None = Field(default=None, ge=1.0, description="How much longer a decode step "
                                                "takes while another instance's process on the same device "
                                                "prefills (sims.gpu_share); None: 2 (the device's budget split).")


TERM_NAMES: tuple[str, ...] = tuple(ProfileTerms.model_fields)
_DEFAULT_WHY = {
    "prefill_padded": "charges each prefill for its own tokens (an engine that does not pad them)",
    "decode_ahead": "charges no step beyond a turn's own (an engine that queues no decode step ahead)",
    "share_prefill_slowdown": "the device's budget split between busy instances (2: each gets half)",
    "share_decode_slowdown": "the device's budget split between busy instances (2: each gets half)",
}
DEFAULTED: dict[str, str] = {  # terms a profile may leave out, and the provenance they then get
    name: f"not measured for this profile: the default ({field.default}) "
          + (_DEFAULT_WHY[name] if name in _DEFAULT_WHY else "charges nothing more" if name.endswith("_s")
             else "takes eff_pcie")
    for name, field in ProfileTerms.model_fields.items() if not field.is_required()}


class Provenance(_Frozen):
    """Where one number of a profile comes from."""

    status: Status = Field(description="'measured' (fitted to measurements on `gpus`) or 'estimated'.")
    source: str = Field(min_length=1, description="The measurement (e.g. the ANCHORS.md line) or the reasoning behind the estimate.")
    gpus: tuple[str, ...] = Field(default=(), description="GPU types the measurement was taken on; elsewhere the number is an extrapolation.")


class CalibrationRun(_Frozen):
    """How `modelpool calibrate` measured a profile: where, when, with what."""

    command: str = Field(min_length=1, description="The command line that measured it.")
    device: str = Field(min_length=1, description="The device measured: torch's name for it (e.g. 'NVIDIA H200') or 'cpu'.")
    gpu: str = Field(min_length=1, description="The GPU type (lower-case catalogue key) the measurements count for.")
    measured_at: str = Field(min_length=1, description="When (ISO 8601, UTC).")
    software: dict[str, str] = Field(default_factory=dict, description="Versions: torch, CUDA, modelpool commit.")
    quick: bool = Field(default=False, description="A --quick smoke run: fewer points, fewer repeats.")
    shapes: tuple[str, ...] = Field(default=(), description="The model shapes measured (fleet arch names).")
    wall_s: float = Field(default=0.0, ge=0, description="Seconds the calibration took.")
    figures: dict[str, float] = Field(default_factory=dict, description="Figures measured alongside that are not "
                                                                        "cost-model terms (graph capture time ...).")
    backend: str | None = Field(default=None, description="Where the idle pool's engine calls ran while its host "
                                "terms were measured (serve's --backend: ray, processes, threads); None: no host "
                                "terms measured.")


class SharePair(_Frozen):
    """The two cross-kind slowdowns measured with a decoder of one shape beside a prefiller of another running
    prompts of `prompt_tokens` (two engine processes on one device, as serve places a prefill and a decode
    instance: `modelpool calibrate`)."""

    decode_shape: str
    prefill_shape: str
    decode_bytes: float = Field(gt=0, description="The decoding shape's weight bytes.")
    prefill_bytes: float = Field(gt=0, description="The prefilling shape's weight bytes.")
    prompt_tokens: int = Field(gt=0, description="The prefills' prompt length.")
    decode_slowdown: float = Field(ge=1.0, description="A decode step's median time beside the prefills, over alone.")
    prefill_slowdown: float = Field(ge=1.0, description="A prefill's median time beside the decode steps, over alone.")


def shape_key(arch: Arch) -> tuple[object, ...]:
    """What sets a model's step costs: its architecture less its name-like fields (published parameter count,
    context limit), so a fleet's model and a shape calibrate timed match when they have the same layers."""
    return (arch.family, arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.dim,
            arch.intermediate_size, arch.vocab_size, arch.tie_embeddings, arch.qkv_bias, arch.num_experts,
            arch.experts_per_token, arch.dtype)


class ShapeScale(_Frozen):
    """A shape `modelpool calibrate` timed, and how its own prefill points stand to the cost model's formula:
    the median over them of measured / predicted (the terms fitted to every shape). A model of this shape, at
    tensor-parallel size 1 on the GPU the profile was measured on, takes its prefill time from the formula times
    this figure: its own microbenchmark, where the formula (one line across shapes) leaves a shape-specific
    cost out - small shapes' eager prefills are bound by the host's kernel launches, which differ by shape."""

    shape: str
    arch: Arch
    prefill: float = Field(gt=0, description="Median of the shape's prefill points' measured / predicted time.")
    points: int = Field(ge=1, description="The prefill points behind it.")
    by_prompts: list[tuple[int, list[tuple[int, float]]]] = Field(
        default_factory=list, description="Measured / predicted of the shape's points by prompt count, then by "
        "tokens per prompt (the median where points share both): a call takes, at each prompt count measured, the "
        "scale at its tokens per prompt (linear in log tokens between the lengths measured, the nearest's beyond), "
        "and between two prompt counts the figure linear in log prompts between theirs (the nearest's beyond). "
        "Where given it replaces `prefill`: a host-bound shape's eager prefill hardly grows with its prompt (the "
        "H100's 0.5B: 10.9 ms at 256 tokens, 11.2 ms at 2048), which one median ratio over the formula cannot "
        "follow (files before 2026-12-07: none).")

    def at(self, tokens: int, prompts: int = 1) -> float:
        """The scale for a call of `prompts` prompts of `tokens` tokens in all."""
        if not self.by_prompts:
            return self.prefill
        per_prompt = tokens / max(1, prompts)
        return _log_interpolated([(count, _log_interpolated(row, per_prompt)) for count, row in self.by_prompts],
                                 prompts)


def _log_interpolated(table: Sequence[tuple[int, float]], x: float) -> float:
    """The figure at `x` of a table of (x, figure) by x: linear in log x between two of them, the nearest's beyond."""
    if x <= table[0][0]:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return table[-1][1]


class DecodePair(_Frozen):
    """A decode step's slowdown measured with a decoder of one shape beside a second process of another decoding
    without pause too (two engine processes on one device, as a prefill instance runs a hand-off's first decode
    steps beside the decode instance: `modelpool calibrate`)."""

    decode_shape: str
    peer_shape: str
    decode_bytes: float = Field(gt=0, description="The decoding shape's weight bytes.")
    peer_bytes: float = Field(gt=0, description="The other process's shape's weight bytes.")
    slowdown: float = Field(ge=1.0, description="A decode step's median time beside the other's decode steps, over "
                                                "alone (the median of the runs that measured it).")


class CalibrationProfile(_Frozen):
    """Roofline terms, per-GPU overrides and the provenance of every number."""

    name: str = Field(min_length=1, description="Profile name (the file stem of a shipped profile).")
    description: str = Field(default="", description="What the profile is for and how it was made.")
    terms: ProfileTerms = Field(description="Terms used on every GPU without an override.")
    gpu_overrides: dict[str, dict[str, float | bool | str]] = Field(
        default_factory=dict, description="Per GPU type (lower-case catalogue name): terms that replace `terms` on that GPU.")
    provenance: dict[str, Provenance] = Field(
        description="For every term, and for every override as '<gpu>.<term>', where the number comes from.")
    calibration: CalibrationRun | None = Field(
        default=None, description="How the profile was measured, when `modelpool calibrate` wrote it.")
    share_pairs: list[SharePair] = Field(
        default_factory=list, description="The share slowdowns measured at pairs of shapes and prompt lengths "
        "(every decoder size beside every prefiller size at every length measured): where given, the simulator "
        "takes a shared GPU's slowdowns from them by the sizes of the two models and the prompt's length "
        "(sims.gpu_share.ShareTable), in place of share_decode_slowdown and share_prefill_slowdown.")
    shape_scales: list[ShapeScale] = Field(
        default_factory=list, description="Per shape calibrate timed, its prefill points over the formula's "
        "figure (median): a model of that shape on the GPU measured takes its prefill time from its own points.")
    decode_pairs: list[DecodePair] = Field(
        default_factory=list, description="A decode step's slowdown beside another process's decode steps, measured "
        "at every shape beside every shape: where given, the simulator takes a decode step's slowdown beside a "
        "decoding peer from them by the sizes of the two models (sims.gpu_share.DecodeShareTable), in place of the "
        "device's budget split (2).")
    device_spec: GpuSpec | None = Field(
        default=None, description="The figures of the device measured that its efficiencies are shares of, where the "
                                  "GPU catalogue has none (a CPU: its peak rates as calibrate measured them).")

    @model_validator(mode="before")
    @classmethod
    def _defaulted_provenance(cls, data: object) -> object:
        """A term left at its default (DEFAULTED) gets the provenance that says so."""
        if not isinstance(data, dict):
            return data
        terms = data.get("terms")
        given = set(terms) if isinstance(terms, dict) else set(getattr(terms, "model_fields_set", ()))
        provenance = data.get("provenance")
        if not isinstance(provenance, dict):
            return data
        added = {term: {"status": "estimated", "source": source} for term, source in DEFAULTED.items()
                 if term not in given and term not in provenance}
        return {**data, "provenance": {**provenance, **added}} if added else data

    @model_validator(mode="after")
    def _check(self) -> CalibrationProfile:
        for gpu, override in self.gpu_overrides.items():
            unknown = sorted(set(override) - set(TERM_NAMES))
            if unknown:
                raise ValueError(f"gpu_overrides.{gpu}: unknown term(s) {unknown}; known: {', '.join(TERM_NAMES)}")
            if gpu != gpu.lower():
                raise ValueError(f"gpu_overrides: GPU key {gpu!r} must be lower-case")
            try:
                ProfileTerms.model_validate(self.terms.model_dump() | override)
            except ValueError as exc:
                raise ValueError(f"gpu_overrides.{gpu}: {exc}") from None
        needed = set(TERM_NAMES) | {f"{gpu}.{term}" for gpu, override in self.gpu_overrides.items() for term in override}
        missing, extra = sorted(needed - set(self.provenance)), sorted(set(self.provenance) - needed)
        if missing or extra:
            raise ValueError(f"provenance: missing {missing}, unexpected {extra}")
        return self

    def prefill_scales(self, gpu: str) -> dict[tuple[object, ...], ShapeScale]:
        """By `shape_key`, the prefill scale of every shape measured on GPU type `gpu` (none on another GPU: a
        shape's own points count where they were timed)."""
        if self.calibration is None or self.calibration.gpu.lower() != gpu.lower():
            return {}
        return {shape_key(scale.arch): scale for scale in self.shape_scales}

    def terms_for(self, gpu: str) -> ProfileTerms:
        """The terms on GPU type `gpu` (its override applied)."""
        override = self.gpu_overrides.get(gpu.lower())
        return ProfileTerms.model_validate(self.terms.model_dump() | override) if override else self.terms

    def entry(self, term: str, gpu: str) -> Provenance:
        """The provenance of `term` on GPU type `gpu` (its override's, if it has one)."""
        key = f"{gpu.lower()}.{term}"
        return self.provenance[key] if key in self.provenance else self.provenance[term]

    def status(self, term: str, gpu: str) -> Status:
        """'measured' only when `term` was measured on `gpu` itself; anything else is an estimate there."""
        entry = self.entry(term, gpu)
        return "measured" if entry.status == "measured" and gpu.lower() in entry.gpus else "estimated"

    def basis(self, term: str, gpu: str) -> Basis:
        """How `term` is known on `gpu`: 'measured' there; 'datasheet ratio' (an efficiency measured on
        other GPUs, applied to this GPU's datasheet figure); 'carried over' (a time or setting measured on
        other GPUs, used unchanged); 'assumed' (measured nowhere)."""
        if self.status(term, gpu) == "measured":
            return "measured"
        if self.entry(term, gpu).status != "measured":
            return "assumed"
        return "datasheet ratio" if term.startswith("eff_") else "carried over"

    def summary(self, gpu: str) -> dict[str, Any]:
        """What a report says of the profile on GPU type `gpu`: which terms were measured on it, and where and
        when `modelpool calibrate` measured it (None for a profile it did not write)."""
        measured = [term for term in TERM_NAMES if self.status(term, gpu) == "measured"]
        run = self.calibration
        return {"name": self.name, "gpu": gpu.lower(), "measured_on_this_gpu": bool(measured),
                "terms_measured_here": measured, "terms_estimated": [t for t in TERM_NAMES if t not in measured],
                "calibration": None if run is None else {"device": run.device, "gpu": run.gpu, "quick": run.quick,
                                                         "measured_at": run.measured_at, "command": run.command}}

    def bases(self, gpu: str) -> dict[Basis, list[str]]:
        """The terms on `gpu` grouped by `basis` (every basis present, possibly empty)."""
        groups: dict[Basis, list[str]] = {basis: [] for basis in BASES}
        for term in TERM_NAMES:
            groups[self.basis(term, gpu)].append(term)
        return groups


def shipped() -> tuple[str, ...]:
    """The profiles shipped as package data, by name: the datasheet-carried `default` and the measurements
    files `modelpool calibrate` wrote on the devices it was run on (`<device>-measured`)."""
    names = (entry.name.removesuffix(".json") for entry in resources.files(__name__).iterdir()
             if entry.name.endswith(".json"))
    return tuple(sorted(names, key=lambda name: (name != "default", name)))


def load_profile(name_or_path: str | Path) -> CalibrationProfile:
    """A shipped profile by name (see `shipped`) or a JSON file by path: a measurements file `modelpool calibrate`
    writes (sims.profiles.measurements), or a profile."""
    text = str(name_or_path)
    if text in shipped():
        return _shipped(text)
    path = Path(text)
    if not path.is_file():
        raise FileNotFoundError(f"no calibration profile {text!r}: not a shipped profile ({', '.join(shipped())}) "
                                f"nor a file")
    try:
        return _from_json(json.loads(path.read_text()), path.stem)
    except ValueError as exc:  # bad JSON, or pydantic's ValidationError: a missing or out-of-range term
        raise ValueError(f"calibration profile {path}: not a valid profile: {exc}") from None


@functools.cache
def _shipped(name: str) -> CalibrationProfile:
    return _from_json(json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text()), name)


def _from_json(data: Any, name: str) -> CalibrationProfile:
    """A profile from parsed JSON: a measurements file (it names its schema) or a profile."""
    if isinstance(data, dict) and "schema" in data:
        from sims.profiles.measurements import Measurements

        return Measurements.model_validate(data).profile(name)
    return CalibrationProfile.model_validate(data)
