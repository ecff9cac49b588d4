"""Seeded generators: arrival processes, model popularity and token lengths.

Everything here is a pure function of its arguments and a numpy Generator,
vectorised so that hours of a busy model (millions of requests) take seconds:
- `poisson_arrivals`, `gamma_arrivals`: stationary renewal processes with a
  given rate (and CV of the inter-arrival time for Gamma);
- `onoff_arrivals`: bursts - Poisson in "on" periods, silence in "off" ones;
- `windowed_arrivals`: ServeGen's model of a client, a fitted Gamma or
  Weibull inter-arrival shape per window, rescaled to the window's rate;
- `spread_counts`: per-bin counts (Azure Functions per minute) placed
  uniformly at random inside each bin, i.e. a Poisson process given the counts;
- `zipf_weights` for long-tail popularity; `LengthDistribution` for
  (input, output) token pairs drawn jointly from an empirical table;
- `synthetic_workload`, `zipf_workload`: whole workloads for a list of models.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sims.workload import TraceError, Workload


DEFAULT_MAX_REQUESTS = 10_000_000


def check_request_budget(expected: float, max_requests: int, what: str) -> None:
    """Refuse, before allocating anything, to generate more requests than `max_requests`."""
    if expected > max_requests:
        raise TraceError(f"{what}: about {expected:,.0f} requests exceed max_requests={max_requests:,}; "
                         "shorten duration, select fewer clients or functions, or raise max_requests")


def stream(seed: int, purpose: str) -> np.random.Generator:
    """An independent generator per (seed, purpose), so changing one part of a spec leaves the others' draws alone."""
    return np.random.default_rng([seed, zlib.crc32(purpose.encode())])


@dataclass(frozen=True, slots=True, eq=False)
class LengthDistribution:
    """Empirical (input, output) token-count pairs, sampled jointly with replacement (keeps their correlation)."""

    input_tokens: np.ndarray
    output_tokens: np.ndarray
    name: str

    def __post_init__(self) -> None:
        inputs = np.asarray(self.input_tokens, dtype=np.int64).reshape(-1)
        outputs = np.asarray(self.output_tokens, dtype=np.int64).reshape(-1)
        if inputs.size == 0 or inputs.size != outputs.size:
            raise TraceError(f"length distribution {self.name!r}: need the same non-zero number of inputs and outputs")
        object.__setattr__(self, "input_tokens", np.maximum(inputs, 1))
        object.__setattr__(self, "output_tokens", np.maximum(outputs, 1))

    @classmethod
    def fixed(cls, input_tokens: int, output_tokens: int) -> LengthDistribution:
        return cls(np.array([input_tokens]), np.array([output_tokens]), f"fixed:{input_tokens}:{output_tokens}")

    @classmethod
    def of_workload(cls, workload: Workload, name: str | None = None) -> LengthDistribution:
        return cls(workload.input_tokens, workload.output_tokens, name or workload.source)

    def sample(self, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        rows = rng.integers(0, self.input_tokens.size, size=num)
        return self.input_tokens[rows], self.output_tokens[rows]


def sample_discrete(values: np.ndarray, probabilities: np.ndarray, num: int, rng: np.random.Generator) -> np.ndarray:
    """`num` draws of `values` with the given (unnormalised) probabilities."""
    cdf = np.cumsum(probabilities, dtype=np.float64)
    picks = np.searchsorted(cdf, rng.random(num) * cdf[-1], side="right")
    return values[np.minimum(picks, values.size - 1)]


Pdf = tuple[np.ndarray, np.ndarray]  # (values, probabilities) of a discrete distribution
_MODALITIES = ("image", "audio", "video")


def mix_pdfs(parts: Sequence[tuple[float, Mapping[str, Pdf]]]) -> dict[str, Pdf]:
    """The mixture of per-field PDFs with the given weights (fields present in every part)."""
    total = sum(weight for weight, _ in parts)
    weighted = [(weight / total if total > 0 else 1.0 / len(parts), pdfs) for weight, pdfs in parts]
    fields = set.intersection(*(set(pdfs) for _, pdfs in weighted))
    return {
        name: (np.concatenate([pdfs[name][0] for _, pdfs in weighted]),
               np.concatenate([weight * pdfs[name][1] / pdfs[name][1].sum() for weight, pdfs in weighted]))
        for name in fields
    }


def sample_pdf_lengths(pdfs: Mapping[str, Pdf], num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(input, output) tokens from ServeGen-style per-field PDFs, each field drawn independently.

    Input is `input_tokens` when present; otherwise (multimodal) `text_tokens`
    plus, per modality, `<m>_count` draws of `<m>_tokens`. ServeGen itself
    reuses one uniform draw for every field, which makes input and output
    perfectly rank-correlated; independent draws avoid that artefact.
    """
    outputs = sample_discrete(*pdfs["output_tokens"], num, rng).astype(np.int64)
    if "input_tokens" in pdfs:
        return sample_discrete(*pdfs["input_tokens"], num, rng).astype(np.int64), outputs
    inputs = sample_discrete(*pdfs["text_tokens"], num, rng).astype(np.int64)
    for modality in _MODALITIES:
        count_pdf, token_pdf = pdfs.get(f"{modality}_count"), pdfs.get(f"{modality}_tokens")
        if count_pdf is None or token_pdf is None:
            continue
        counts = sample_discrete(*count_pdf, num, rng).astype(np.int64)
        draws = sample_discrete(*token_pdf, int(counts.sum()), rng)
        inputs += np.bincount(np.repeat(np.arange(num), counts), weights=draws, minlength=num).astype(np.int64)
    return inputs, outputs


def _check_rate(rate_per_s: float, duration_s: float) -> None:
    if not (np.isfinite(rate_per_s) and rate_per_s >= 0):
        raise TraceError(f"rate must be a non-negative number, got {rate_per_s}")
    if not (np.isfinite(duration_s) and duration_s > 0):
        raise TraceError(f"duration must be a positive number of seconds, got {duration_s}")


def poisson_arrivals(rate_per_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival times of a Poisson process on [0, duration_s)."""
    _check_rate(rate_per_s, duration_s)
    num = rng.poisson(rate_per_s * duration_s)
    return np.sort(rng.random(num) * duration_s)


def gamma_arrivals(rate_per_s: float, cv: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrivals of a stationary renewal process with Gamma gaps (mean 1/rate, CV `cv`) on [0, duration_s).

    The first arrival comes from the equilibrium (forward-recurrence)
    distribution, so a short window of a bursty process is not biased by a
    fresh start at t=0. CV 1 is Poisson.
    """
    _check_rate(rate_per_s, duration_s)
    if not (np.isfinite(cv) and cv > 0):
        raise TraceError(f"cv must be a positive number, got {cv}")
    if rate_per_s == 0:
        return np.empty(0)
    shape = 1.0 / cv**2
    scale = 1.0 / (rate_per_s * shape)
    # Forward recurrence time of a renewal process: U * (length-biased gap); length-biased Gamma(k) is Gamma(k+1).
    first = rng.random() * rng.gamma(shape + 1.0, scale)
    chunks = [np.array([first])]
    reached = first
    expected = rate_per_s * duration_s
    while reached < duration_s:
        gaps = rng.gamma(shape, scale, size=int(expected + 6 * np.sqrt(expected * cv**2 + 1) + 16))
        times = reached + np.cumsum(gaps)
        chunks.append(times)
        reached = float(times[-1])
    arrivals = np.concatenate(chunks)
    return arrivals[arrivals < duration_s]


def onoff_arrivals(rate_per_s: float, on_s: float, off_s: float, duration_s: float,
                   rng: np.random.Generator) -> np.ndarray:
    """Sorted arrivals of an on/off (two-state Markov-modulated) Poisson process on [0, duration_s).

    Periods alternate: "on" ones of mean `on_s` seconds (exponential) with
    Poisson arrivals at rate_per_s * (on_s + off_s) / on_s, and silent "off"
    ones of mean `off_s`; the mean rate is `rate_per_s`. The first period is
    on with probability on_s / (on_s + off_s) and, by memorylessness, already
    at equilibrium. A model's bursts come in whole periods, so a pool sees a
    model go quiet for seconds and return - what makes it switch.
    """
    _check_rate(rate_per_s, duration_s)
    if not (np.isfinite(on_s) and on_s > 0 and np.isfinite(off_s) and off_s >= 0):
        raise TraceError(f"on/off periods must be on_s > 0 and off_s >= 0 seconds, got {on_s}, {off_s}")
    if rate_per_s == 0:
        return np.empty(0)
    peak = rate_per_s * (on_s + off_s) / on_s
    on = bool(rng.random() < on_s / (on_s + off_s))
    at, chunks = 0.0, []
    while at < duration_s:
        length = rng.exponential(on_s if on else off_s) if (on_s if on else off_s) > 0 else 0.0
        end = min(at + length, duration_s)
        if on and end > at:
            chunks.append(at + rng.random(rng.poisson(peak * (end - at))) * (end - at))
        at, on = end if length > 0 else at, not on
    return np.sort(np.concatenate(chunks)) if chunks else np.empty(0)


def windowed_arrivals(
    window_start_s: npt.ArrayLike,
    window_s: float,
    rate_per_s: npt.ArrayLike,
    is_weibull: npt.ArrayLike,
    shape: npt.ArrayLike,
    scale: npt.ArrayLike,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """ServeGen-style arrivals for many windows at once: returns (times, window index of each), unsorted.

    Window w gets floor(rate*window_s) requests, plus one with probability
    equal to the fractional part (an unbiased count). Their gaps are drawn
    from Gamma(shape, scale) or Weibull(shape, scale) and rescaled so that
    count+1 gaps span the window exactly (ServeGen rescales the gaps to the
    window's rate; drawing one gap more than arrivals keeps the last arrival
    strictly inside). Only the shape matters after rescaling; it is drawn in
    log space because fitted shapes go down to 0.007, where plain draws
    underflow to 0 (Gamma) or overflow to inf (Weibull).
    """
    starts = np.asarray(window_start_s, dtype=np.float64)
    rates = np.asarray(rate_per_s, dtype=np.float64)
    shapes = np.asarray(shape, dtype=np.float64)
    weibull = np.asarray(is_weibull, dtype=bool)
    del scale  # the rescaling to the window's rate cancels it
    expected = rates * window_s
    counts = np.floor(expected).astype(np.int64)
    counts += rng.random(counts.size) < (expected - counts)
    active = np.flatnonzero(counts > 0)
    if active.size == 0:
        return np.empty(0), np.empty(0, dtype=np.int64)
    gaps_per_window = counts[active] + 1
    owner = np.repeat(np.arange(active.size), gaps_per_window)
    gap_shape = shapes[active][owner]
    log_gaps = np.empty(owner.size)
    is_w = weibull[active][owner]
    # Weibull(c): X = E^(1/c), E ~ Exp(1).  Gamma(a): X = G * U^(1/a), G ~ Gamma(a+1) (Marsaglia-Tsang boost).
    tiny = np.finfo(np.float64).tiny
    log_gaps[is_w] = np.log(np.maximum(rng.standard_exponential(int(is_w.sum())), tiny)) / gap_shape[is_w]
    g_shape = gap_shape[~is_w]
    log_gaps[~is_w] = np.log(rng.standard_gamma(g_shape + 1.0)) + np.log(1.0 - rng.random(g_shape.size)) / g_shape
    firsts = np.concatenate(([0], np.cumsum(gaps_per_window)[:-1]))
    lasts = firsts + gaps_per_window - 1
    log_gaps -= np.maximum.reduceat(log_gaps, firsts)[owner]
    cumulative = np.cumsum(np.exp(log_gaps))
    before = np.concatenate(([0.0], cumulative))[firsts]  # running total before each window's first gap
    within = cumulative - before[owner]  # >= 0: a running sum of non-negatives never decreases
    fraction = within / (cumulative[lasts] - before)[owner]
    keep = np.ones(owner.size, dtype=bool)
    keep[lasts] = False  # the last gap closes the window; it is not an arrival
    window_start = starts[active][owner[keep]]
    # The last arrival can round up onto the window's end; keep it strictly inside.
    times = np.minimum(window_start + fraction[keep] * window_s, np.nextafter(window_start + window_s, -np.inf))
    return times, active[owner[keep]]


def spread_counts(counts: npt.ArrayLike, bin_s: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Place counts[i, j] arrivals uniformly at random in bin j: returns (times, row i of each), unsorted."""
    table = np.asarray(counts, dtype=np.int64)
    if table.ndim != 2 or (table.size and table.min() < 0):
        raise TraceError("spread_counts: need a 2-D table of non-negative counts")
    flat = table.reshape(-1)
    cell = np.repeat(np.arange(flat.size), flat)
    rows, bins = np.divmod(cell, table.shape[1])
    return (bins + rng.random(cell.size)) * bin_s, rows


def zipf_weights(num_models: int, exponent: float) -> np.ndarray:
    """Popularity of ranks 1..num_models proportional to 1/rank**exponent (0 is uniform), summing to 1."""
    if num_models < 1:
        raise TraceError(f"zipf: need at least one model, got {num_models}")
    if not (np.isfinite(exponent) and exponent >= 0):
        raise TraceError(f"zipf: exponent must be >= 0, got {exponent}")
    weights = np.arange(1, num_models + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def synthetic_workload(
    models: Sequence[str],
    rates_per_s: float | Sequence[float] | Mapping[str, float],
    duration_s: float,
    lengths: LengthDistribution,
    seed: int,
    cv: float = 1.0,
    source: str = "synthetic",
) -> Workload:
    """Independent arrivals per model (Poisson when cv == 1, else Gamma with that CV); lengths from `lengths`."""
    if not models:
        raise TraceError(f"{source}: needs at least one model")
    if isinstance(rates_per_s, Mapping):
        missing = [name for name in models if name not in rates_per_s]
        if missing:
            raise TraceError(f"{source}: no rate given for models {missing}")
        rates = [float(rates_per_s[name]) for name in models]
    elif isinstance(rates_per_s, (int, float)):
        rates = [float(rates_per_s)] * len(models)
    else:
        rates = [float(rate) for rate in rates_per_s]
        if len(rates) != len(models):
            raise TraceError(f"{source}: {len(rates)} rates for {len(models)} models")
    per_model = []
    for index, (name, rate) in enumerate(zip(models, rates)):
        rng = stream(seed, f"arrivals/{index}/{name}")
        times = poisson_arrivals(rate, duration_s, rng) if cv == 1 else gamma_arrivals(rate, cv, duration_s, rng)
        per_model.append(times)
    arrivals = np.concatenate(per_model)
    model_index = np.repeat(np.arange(len(models)), [times.size for times in per_model])
    inputs, outputs = lengths.sample(arrivals.size, stream(seed, "lengths"))
    process = "Poisson" if cv == 1 else f"Gamma(cv={cv:g})"
    return Workload.from_columns(
        arrivals, model_index, inputs, outputs, models=models, source=source, duration_s=duration_s,
        notes=(f"{process} arrivals per model; lengths from {lengths.name}",),
    )


def zipf_workload(
    models: Sequence[str],
    total_rate_per_s: float,
    exponent: float,
    duration_s: float,
    lengths: LengthDistribution,
    seed: int,
    cv: float = 1.0,
    source: str = "zipf",
) -> Workload:
    """Long-tail popularity: models[i] gets total_rate * zipf_weights(n, exponent)[i] (the first model is busiest)."""
    rates = total_rate_per_s * zipf_weights(len(models), exponent)
    return synthetic_workload(models, list(rates), duration_s, lengths, seed, cv=cv, source=source)
