"""Named scenarios: a fleet, an arrival process and a length distribution, at a load level.

The validation matrix (`modelpool validate SCENARIO`) serves each scenario
live and simulates the very same requests; the capacity matrix sizes a pool
for them. Every scenario differs from what any cost term was measured on (one
GPU harness: Qwen2.5 1.5B/3B/7B, five models, uniform lengths, Poisson):

| fleet | what |
|---|---|
| eight | 8 Qwen2.5 models, 0.5B-3B, Zipf(1.0) popularity |
| mixed | 5 models mixing qwen2, qwen3 and llama shapes, 1B-4B |
| large | 3 large models (two Qwen2.5-7B, a Yi-1.5-6B of llama shape) |
| small | 12 small models (Qwen2.5-0.5B, Llama-3.2-1B), Zipf(1.2) |
| shipped | the repository's models.yaml (47 models on H20s; simulated only) |

Arrival processes: `poisson` (per model), `onoff` (per model, bursts of a
few seconds with silences between: a model goes quiet and returns), and
`trace` (a production trace's own timings, rate-scaled and split among the
models by popularity). Lengths are real: ShareGPT pairs (shipped with the
package) or the production trace's own prompt/output tokens.

A scenario fixes what is served and how requests come; the load (total
req/s) is given separately: `LOADS` names a light one and one near the knee
as fractions of the knee rate, which `modelpool validate` finds with the
simulator for the GPU at hand. Fleets are random-weight models of real shapes;
`FleetSpec.tiny` swaps each for a tiny model of the same family for CPU runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from scheduler.catalog import ARCHS
from scheduler.fleet import Fleet
from sims.synthetic import LengthDistribution, onoff_arrivals, poisson_arrivals, stream, zipf_weights
from sims.trace_readers import read_length_pairs
from sims.trace_store import CATALOGUE, SHIPPED
from sims.workload import TraceError, Workload

SHIPPED_FLEET = Path(__file__).resolve().parents[1] / "models.yaml"

# Tiny shapes of each family the engine runs (Hugging Face config keys), for CPU runs of a fleet: a few MB each.
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=2048, tie_word_embeddings=False),
    "qwen3": dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=192, vocab_size=2048, tie_word_embeddings=True),
    "llama": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=320, vocab_size=2048, tie_word_embeddings=False),
}


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """Models of real shapes (catalogue arch keys) served together, and how popular each is."""

    name: str
    description: str
    models: tuple[tuple[str, str], ...]  # (model name, scheduler.catalog arch key)
    zipf_s: float = 1.0  # popularity: model i gets weight 1/(i+1)**zipf_s (0: uniform)
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    max_prefill_tokens: int = 4096
    max_batch_size: int = 64  # decode graphs are captured up to it at start: fewer sizes, a quicker start

    def __post_init__(self) -> None:
        unknown = sorted({arch for _, arch in self.models} - ARCHS.keys())
        if unknown:
            raise TraceError(f"fleet {self.name!r}: unknown arch keys {unknown}")
        names = [name for name, _ in self.models]
        if len(set(names)) != len(names):
            raise TraceError(f"fleet {self.name!r}: duplicate model names")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.models)

    def family(self, arch: str) -> str:
        """The engine family of a catalogue arch: qwen2, qwen3 or llama."""
        return str(ARCHS[arch]["family"])

    def weights(self) -> np.ndarray:
        """Each model's share of the requests (sums to 1), in `models` order."""
        return zipf_weights(len(self.models), self.zipf_s)

    def fleet_dict(self, gpu: str, num_gpus: int = 1, archs: Mapping[str, Any] | None = None,
                   gpus: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The fleet file's content (models.yaml schema) on `num_gpus` x `gpu`; `archs` replaces a model's arch
        (a folder path, for served random-weight models) by name; `gpus` describes GPU types the catalogue
        lacks (a CPU a profile was measured on)."""
        archs = archs or {}
        return {**({"gpus": {key: dict(spec) for key, spec in gpus.items()}} if gpus else {}),
            "pool": {"gpu": gpu, "num_gpus": num_gpus, "gpus_per_node": num_gpus, "host_kv_gb": 16.0,
                     "max_prefill_tokens": self.max_prefill_tokens, "max_batch_size": self.max_batch_size,
                     "default_slo": {"ttft_s": self.ttft_slo_s, "tpot_s": self.tpot_slo_s}},
            "models": [{"name": name, "arch": archs.get(name, arch)} for name, arch in self.models],
        }

    def fleet(self, gpu: str, num_gpus: int = 1) -> Fleet:
        """The fleet as the simulator and the capacity search take it (catalogue shapes)."""
        return Fleet.model_validate(self.fleet_dict(gpu, num_gpus))


FLEETS: dict[str, FleetSpec] = {f.name: f for f in (
    FleetSpec("eight", "8 Qwen2.5 models, 0.5B-3B, Zipf(1.0) popularity",
              (("e1-0.5b", "qwen2.5-0.5b"), ("e2-1.5b", "qwen2.5-1.5b"), ("e3-0.5b", "qwen2.5-0.5b"),
               ("e4-3b", "qwen2.5-3b"), ("e5-1.5b", "qwen2.5-1.5b"), ("e6-0.5b", "qwen2.5-0.5b"),
               ("e7-3b", "qwen2.5-3b"), ("e8-1.5b", "qwen2.5-1.5b"))),
    FleetSpec("mixed", "5 models mixing qwen2, qwen3 and llama shapes, 1B-4B, Zipf(0.8)",
              (("x1-llama3b", "llama-3.2-3b"), ("x2-qwen3-4b", "qwen3-4b"), ("x3-qwen2.5-3b", "qwen2.5-3b"),
               ("x4-llama1b", "llama-3.2-1b"), ("x5-qwen3-1.7b", "qwen3-1.7b")), zipf_s=0.8),
    # two 7B and a 6B (llama shape): what fits one 80 GB GPU twice over (a prefill and a decode instance, two
    # model slots each) with KV room left
    FleetSpec("large", "3 large models: two Qwen2.5-7B and a Yi-1.5-6B (llama shape), near-uniform popularity",
              (("l1-7b", "qwen2.5-7b"), ("l2-yi-6b", "yi-1.5-6b"), ("l3-7b", "qwen2.5-7b")), zipf_s=0.5),
    FleetSpec("small", "12 small models (Qwen2.5-0.5B, Llama-3.2-1B), Zipf(1.2): a long tail",
              tuple((f"s{k:02d}-{'llama1b' if k % 3 == 0 else '0.5b'}",
                     "llama-3.2-1b" if k % 3 == 0 else "qwen2.5-0.5b") for k in range(1, 13)), zipf_s=1.2),
)}


def shipped_fleet() -> Fleet:
    """The repository's models.yaml (its own GPU, pool size and traffic hints), for simulation and capacity."""
    import yaml

    if not SHIPPED_FLEET.is_file():
        raise TraceError(f"the shipped fleet file is missing: {SHIPPED_FLEET}")
    return Fleet.model_validate(yaml.safe_load(SHIPPED_FLEET.read_text()))


def shipped_weights(fleet: Fleet) -> np.ndarray:
    """Popularity from the fleet's traffic hints (uniform when it has none)."""
    rates = np.array([m.traffic.rate_rps if m.traffic else 0.0 for m in fleet.models])
    return rates / rates.sum() if rates.sum() > 0 else np.full(len(rates), 1.0 / len(rates))


Process = Literal["poisson", "onoff", "trace"]


@dataclass(frozen=True, slots=True)
class Arrivals:
    """How requests come: per-model Poisson, per-model on/off bursts, or a production trace's timings."""

    process: Process
    on_s: float = 0.0  # onoff: mean burst length
    off_s: float = 0.0  # onoff: mean silence between bursts
    trace: str = ""  # trace: a sims.trace_store catalogue name with timestamps (azure-conv, azure-code, ...)
    start_s: float = 0.0  # trace: where on the trace's clock the window starts

    def describe(self) -> str:
        if self.process == "onoff":
            return f"on/off bursts per model (on {self.on_s:g} s, off {self.off_s:g} s on average)"
        if self.process == "trace":
            return f"{self.trace} timings from {self.start_s:g} s, rate-scaled"
        return "Poisson per model"


@dataclass(frozen=True, slots=True)
class Scenario:
    """A fleet, an arrival process and a length distribution; `workload` draws its requests at a given load."""

    name: str
    fleet: str  # a FLEETS key, or "shipped"
    arrivals: Arrivals
    lengths: str  # "sharegpt" (shipped pairs) or "trace" (the production trace's own prompt/output tokens)
    max_output_tokens: int = 1024  # outputs clipped here, so a run drains soon after its last arrival

    def describe(self) -> str:
        lengths = "ShareGPT lengths" if self.lengths == "sharegpt" else f"{self.arrivals.trace} lengths"
        return f"{self.fleet} fleet, {self.arrivals.describe()}, {lengths} (outputs <= {self.max_output_tokens})"

    def fleet_spec(self) -> FleetSpec:
        if self.fleet not in FLEETS:
            raise TraceError(f"scenario {self.name!r}: fleet {self.fleet!r} is no scenario fleet "
                             f"({', '.join(FLEETS)}); the shipped fleet is for simulation only")
        return FLEETS[self.fleet]

    def model_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in shipped_fleet().models) if self.fleet == "shipped" else FLEETS[self.fleet].names

    def popularity(self) -> np.ndarray:
        return shipped_weights(shipped_fleet()) if self.fleet == "shipped" else FLEETS[self.fleet].weights()

    def workload(self, rate_per_s: float, duration_s: float, seed: int = 0,
                 traces_dir: Path | None = None) -> Workload:
        """The scenario's requests at `rate_per_s` in all over [0, duration_s): the same for the same arguments.

        A trace scenario needs its trace file (`modelpool traces fetch NAME`, or $MODELPOOL_TRACES); without it
        the TraceError says how to get it.
        """
        if not (np.isfinite(rate_per_s) and rate_per_s > 0):
            raise TraceError(f"scenario {self.name!r}: rate must be a positive number, got {rate_per_s}")
        names, weights = self.model_names(), self.popularity()
        if self.arrivals.process == "trace":
            workload = self._trace_workload(rate_per_s, duration_s, seed, traces_dir)
            workload = workload.map_models(names, weights, seed)
        else:
            workload = self._synthetic_workload(names, weights, rate_per_s, duration_s, seed)
        return _clip_outputs(workload, self.max_output_tokens)

    def _synthetic_workload(self, names: Sequence[str], weights: np.ndarray, rate_per_s: float,
                            duration_s: float, seed: int) -> Workload:
        per_model = []
        for index, (name, share) in enumerate(zip(names, weights)):
            rng = stream(seed, f"{self.arrivals.process}/{index}/{name}")
            if self.arrivals.process == "onoff":
                per_model.append(onoff_arrivals(rate_per_s * share, self.arrivals.on_s, self.arrivals.off_s,
                                                duration_s, rng))
            else:
                per_model.append(poisson_arrivals(rate_per_s * share, duration_s, rng))
        arrivals = np.concatenate(per_model)
        model_index = np.repeat(np.arange(len(names)), [times.size for times in per_model])
        inputs, outputs = self._lengths(traces_dir=None).sample(arrivals.size, stream(seed, "lengths"))
        return Workload.from_columns(arrivals, model_index, inputs, outputs, models=names,
                                     source=f"scenario:{self.name}", duration_s=duration_s,
                                     notes=(self.describe(),))

    def _trace_workload(self, rate_per_s: float, duration_s: float, seed: int, traces_dir: Path | None) -> Workload:
        from sims.traces import load_workload

        whole = load_workload(self.arrivals.trace, traces_dir=traces_dir)
        # the next rate * duration requests from start_s, their timing squeezed or stretched to span duration_s:
        # the asked rate holds exactly, the trace's bursts and lulls keep their shape
        wanted = max(1, round(rate_per_s * duration_s))
        after = whole.time_slice(self.arrivals.start_s)
        if len(after) <= wanted:
            raise TraceError(f"scenario {self.name!r}: {duration_s:g} s at {rate_per_s:g} req/s needs {wanted + 1} "
                             f"requests of {self.arrivals.trace} after {self.arrivals.start_s:g} s; it has "
                             f"{len(after)} (shorten --duration or lower the rate)")
        span = float(after.arrival_s[wanted])  # the window ends where the next request would come
        window = after.time_slice(0.0, span).scale_rate(span / duration_s)
        if self.lengths != "trace":
            inputs, outputs = self._lengths(traces_dir).sample(len(window), stream(seed, "lengths"))
            window = replace(window, input_tokens=inputs, output_tokens=outputs)
        return replace(window, source=f"scenario:{self.name}", notes=window.notes + (self.describe(),))

    def _lengths(self, traces_dir: Path | None) -> LengthDistribution:
        if self.lengths == "sharegpt":
            return sharegpt_lengths()
        raise TraceError(f"scenario {self.name!r}: lengths {self.lengths!r} need a trace (lengths: sharegpt or trace)")


@cache
def sharegpt_lengths() -> LengthDistribution:
    """The ShareGPT (prompt, output) pairs that ship with the package."""
    trace = CATALOGUE["sharegpt"]
    return replace(read_length_pairs(SHIPPED / str(trace.shipped)), name="sharegpt")


def _clip_outputs(workload: Workload, limit: int) -> Workload:
    clipped = int(np.count_nonzero(workload.output_tokens > limit))
    if not clipped:
        return workload
    return replace(workload, output_tokens=np.minimum(workload.output_tokens, limit),
                   notes=workload.notes + (f"{clipped} outputs clipped to {limit} tokens",))


# Bursts of ~4 s with ~8 s silences per model: at a light load a model's burst finds the pool serving others.
_ONOFF = Arrivals("onoff", on_s=4.0, off_s=8.0)
_AZURE_CODE = Arrivals("trace", trace="azure-code", start_s=600.0)  # gaps with a CV of 13: the burstiest trace
_AZURE_CONV = Arrivals("trace", trace="azure-conv", start_s=600.0)
_POISSON = Arrivals("poisson")

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    # the validation matrix: four fleets, each with another arrival process and length distribution
    Scenario("eight-poisson", "eight", _POISSON, "sharegpt"),
    Scenario("mixed-onoff", "mixed", _ONOFF, "sharegpt"),
    Scenario("large-azure-conv", "large", _AZURE_CONV, "trace"),
    Scenario("small-azure-code", "small", _AZURE_CODE, "trace"),
    # more of the cross product, for runs with more time
    Scenario("eight-onoff", "eight", _ONOFF, "sharegpt"),
    Scenario("mixed-azure-code", "mixed", _AZURE_CODE, "trace"),
    Scenario("large-poisson", "large", _POISSON, "sharegpt"),
    Scenario("small-poisson", "small", _POISSON, "sharegpt"),
    # the shipped fleet (simulation and capacity only: 47 models on H20s)
    Scenario("shipped-poisson", "shipped", _POISSON, "sharegpt"),
    Scenario("shipped-onoff", "shipped", _ONOFF, "sharegpt"),
    Scenario("shipped-azure-conv", "shipped", _AZURE_CONV, "trace"),
)}

# Load levels as fractions of the knee rate (the highest total rate at which the simulator, costed for the GPU at
# hand, still meets the SLO for 90% of requests): one light, one near the knee (just below it: at the knee itself
# attainment falls steeply, and a rate a few percent off moves it by more than the 3-point target).
KNEE_ATTAINMENT = 0.9
LOADS: dict[str, float] = {"light": 0.3, "knee": 0.9}


def scenario(name: str) -> Scenario:
    """The scenario `name`; a TraceError listing the known ones otherwise."""
    if name not in SCENARIOS:
        raise TraceError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return SCENARIOS[name]
