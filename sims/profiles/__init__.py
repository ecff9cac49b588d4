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
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    # What the live pool pays beyond the engine's microbenchmarks (`modelpool calibrate` measures them). The
    # defaults charge nothing more, so a profile without them reads as before (their provenance: DEFAULTED).
    prefill_request_s: Seconds = Field(default=0.0, description="Per prompt overhead of a prefill step (the engine "
                                                                "runs attention and sampling prompt by prompt).")
    prefill_host_s: Seconds = Field(default=0.0, description="Host time the live pool adds to each prefill step "
                                                             "beyond the engine's own (controller tick, backend hop, "
                                                             "token delivery, contention for the interpreter).")
    prefill_fresh_s: Seconds = Field(default=0.0, description="What a prefill costs on top at a shape (total "
                                     "tokens, prompts) the engine has not run before - the live pool's case for "
                                     "nearly every prompt: the first run of a shape over its repeats (allocator, "
                                     "GEMM heuristics); added to every prefill, with prefill_host_s.")
    prefill_live_scale: float = Field(default=1.0, gt=0.0, description="The engine's prefill in the live pool over "
                                      "what the engine terms predict (the engine's part, launch floor included; the host terms come on top, a "
                                      "neighbour's slowdown by gpu_share_slowdown): fitted to a live run's prefills.")
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
    decode_host_s: Seconds = Field(default=0.0, description="Host time the live pool adds to each decode step beyond "
                                                            "the engine's own: the first token to the next at the "
                                                            "sink, less the engine's decode step.")
    decode_host_request_s: Seconds = Field(default=0.0, description="Host time the live pool adds to a decode step "
                                                                    "for each request in its batch (its token out of "
                                                                    "the engine, through the backend and the "
                                                                    "controller), on top of decode_host_s.")
    request_admit_s: Seconds = Field(default=0.0, description="Time from a request reaching the endpoint to the "
                                     "engine call it starts on an idle instance (the gateway, the pool's loop and the "
                                     "backend's hop): the simulator hands each request to the scheduler that long "
                                     "after its arrival.")
    token_deliver_s: Seconds = Field(default=0.0, description="Time from an engine call returning a token to the "
                                     "client having it (the backend, the pool's loop, the gateway's stream): the "
                                     "simulator counts each token that long after its step.")
    eff_kv_move: Fraction | None = Field(default=None, description="Achieved share of nominal host link bandwidth "
                                                                   "when KV moves between host and device memory "
                                                                   "(paged block copies); None: eff_pcie.")
    kv_move_fixed_s: Seconds = Field(default=0.0, description="Per move overhead of moving KV (one SwapOut or SwapIn "
                                                              "of several requests, a prefill's KV to host memory).")
    kv_handoff_fixed_s: Seconds | None = Field(default=None, description="Per move overhead of a prefill-to-decode "
                                                "hand-off staged in device memory (pool.engines.handoff): the prefill "
                                                "instance's export into its arena and the decode instance's import from "
                                                "it, each one such move, syncs included, as the live pool's kv_timings "
                                                "record them; None: kv_move_fixed_s.")
    kv_handoff_request_s: Seconds = Field(default=0.0, description="What each request of such a move adds on top of "
                                          "its copy (the engine's work per request: its blocks, its rows' indices).")
    eff_pcie_shared: Fraction | None = Field(default=None, description="Achieved share of nominal host link bandwidth, "
                                                                       "all copies together, while two or more copies "
                                                                       "overlap on one link (pool.gpus_per_host_link); "
                                                                       "None: eff_pcie (the link splits without loss).")
    link_sharing: Literal["fifo", "fair"] = Field(default="fifo", description="How copies that overlap on one host "
                                                  "link share it: 'fifo', one at a time in the order they start (the "
                                                  "later one waits), or 'fair', each of n copies at 1/n of the rate.")
    gpu_share_slowdown: float | None = Field(default=None, ge=1.0, description="How many times longer a step's "
                                             "device work takes while another instance on the same GPU (its own "
                                             "process: CUDA time-slices them, less so under MPS, serve --mps) has "
                                             "device work in flight; k "
                                             "instances busy together each run at 2 / (k * this) of their rate "
                                             "alone (processor sharing, sims.gpu_share). None: instances placed on "
                                             "one GPU each run as if they had it to themselves.")
    gpu_share_decode_slowdown: float | None = Field(default=None, ge=1.0, description="How many times longer a "
                                                    "decode step's device work takes while another instance on the "
                                                    "same GPU prefills (its GEMMs take the SMs: 3-4x under MPS on the "
                                                    "H200, where a prefill beside a decoder took 1.1x); None: "
                                                    "gpu_share_slowdown, as every other pairing.")


TERM_NAMES: tuple[str, ...] = tuple(ProfileTerms.model_fields)
_DEFAULT_WHY = {
    "link_sharing": "the order the H200's copy engine served two engines' switches in: the later copy waited (a 3B "
                    "switch 0.11 s alone, 0.39 s behind a 7B one; modelpool calibrate and the live pool, issue 17)",
    "gpu_share_slowdown": "means instances on one GPU do not slow each other (as before GPU sharing was modelled)",
    "gpu_share_decode_slowdown": "means a decode step beside a prefill slows as any other work does "
                                 "(gpu_share_slowdown)",
    "prefill_padded": "charges each prefill for its own tokens (an engine that does not pad them)",
    "kv_handoff_request_s": "charges a staged hand-off's move its one overhead whatever its requests",
    "prefill_live_scale": "charges a prefill in the live pool what the engine's own measurements predict",
    "kv_handoff_fixed_s": "takes kv_move_fixed_s (a staged hand-off's move costs what any KV move does on top of its "
                          "copies)",
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
    measurements: dict[str, Any] = Field(default_factory=dict, description="The raw measurements the terms were "
                                                                           "fitted to (sims.profiles.calibrated refits "
                                                                           "them).")


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


SHIPPED = ("default", "h200-cudagraph", "h200-eager")


def load_profile(name_or_path: str | Path) -> CalibrationProfile:
    """A shipped profile by name (see SHIPPED) or a JSON file by path."""
    text = str(name_or_path)
    if text in SHIPPED:
        return _shipped(text)
    path = Path(text)
    if not path.is_file():
        raise FileNotFoundError(f"no calibration profile {text!r}: not a shipped profile ({', '.join(SHIPPED)}) nor a file")
    try:
        return CalibrationProfile.model_validate_json(path.read_text())
    except ValueError as exc:  # pydantic's ValidationError: bad JSON, a missing or out-of-range term
        raise ValueError(f"calibration profile {path}: not a valid profile: {exc}") from None


@functools.cache
def _shipped(name: str) -> CalibrationProfile:
    data = resources.files(__name__).joinpath(f"{name}.json").read_text()
    return CalibrationProfile.model_validate(json.loads(data))
