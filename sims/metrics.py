"""Latency, SLO and utilisation figures of a simulated run, keyed like `vllm bench serve`.

Two SLO attainments, reported side by side because they disagree on bursty streams:
- `slo_attainment` (standard, vLLM's goodput rule): a request attains when TTFT <= TTFT_SLO
  and its mean TPOT <= TPOT_SLO (a 1-token request passes on TTFT alone); share of all
  submitted requests, failed and unfinished ones counting as misses.
- `aegaeon_slo_attainment` (Aegaeon, SOSP'25): token k is due at
  `arrival + TTFT_SLO + (k-1) * TPOT_SLO`; a request is behind while the next token it has
  not produced is past due; its score is 1 - (time behind) / (finish - arrival), 0 when it
  failed or did not finish; the figure is the mean score.

Everything is computed on numpy arrays built once from the records: per request, and per
segment (a run of tokens at a fixed spacing, see `RequestRecord.segments`), never per token.
Latencies are over completed requests; sets with no samples report 0, as vLLM does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sims.simulator import RequestRecord

PERCENTILES = (50, 90, 99)
_BLOCK = 1 << 18  # segments per block of the per-segment arithmetic
Floats = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class _Columns:
    """One entry per record (input order); NaN where a latency is undefined."""

    request_id: list[str]
    model_names: list[str]  # model code -> name
    model: NDArray[np.int64]
    arrival: Floats
    prompt: Floats
    generated: Floats
    ttft: Floats
    tpot: Floats
    e2el: Floats
    completed: NDArray[np.bool_]
    failed: NDArray[np.bool_]
    ttft_ok: NDArray[np.bool_]
    tpot_ok: NDArray[np.bool_]
    attained: NDArray[np.bool_]
    score: Floats  # Aegaeon's per-request score
    itl: Floats  # inter-token gaps of completed requests, sorted ...
    itl_weight: Floats  # ... and how many gaps have that length


def _sum_positive(c: Floats, b: Floats, m: Floats) -> Floats:
    """Σ_{i=1..m} max(c + i*b, 0) elementwise: the positive terms form one run of i."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        root = np.clip(np.where(b != 0, -c / b, 0.0), -1.0, m + 1)  # c + i*b = 0 at i = root
    lo = np.where(b > 0, np.floor(root) + 1, 1.0)
    hi = np.where(b < 0, np.ceil(root) - 1, np.where((b == 0) & (c <= 0), 0.0, m))
    lo, hi = np.maximum(lo, 1.0), np.minimum(hi, m)
    count = np.maximum(hi - lo + 1, 0.0)
    return count * c + b * (lo + hi) * count / 2


def _sum_clipped(a: Floats, b: Floats, m: Floats, cap: Floats) -> Floats:
    """Σ_{i=1..m} clip(a + i*b, 0, cap) elementwise, cap >= 0.

    Most runs lie wholly below 0, wholly above cap or wholly between (a plain arithmetic
    series); only those that cross a bound take the general form.
    """
    first, last = a + b, a + m * b
    lo, hi = np.minimum(first, last), np.maximum(first, last)
    inside = (lo >= 0) & (hi <= cap)
    out = np.where(lo >= cap, m * cap, np.where(inside, m * (first + last) / 2, 0.0))
    cross = np.flatnonzero((hi > 0) & (lo < cap) & ~inside & (m > 0))
    a, b, m, cap = a[cross], b[cross], m[cross], cap[cross]
    out[cross] = _sum_positive(a, b, m) - _sum_positive(a - cap, b, m)  # clip(x, 0, cap) = x⁺ - (x - cap)⁺
    return out


def _segment_arrays(records: list[RequestRecord]) -> tuple[NDArray[np.int64], Floats, Floats, Floats]:
    """Segments per record, then all segments flattened: first token time, token count, spacing."""
    counts = np.fromiter(map(len, (r.segments for r in records)), np.int64, count=len(records))
    chain = itertools.chain.from_iterable
    # one flat run of numbers (3 per segment): fromiter's fast path, where a structured dtype built each record
    flat = np.fromiter(chain(chain(r.segments for r in records)), np.float64, count=3 * int(counts.sum()))
    t0, n, delta = flat.reshape(-1, 3).T.copy()  # contiguous columns
    return counts, t0, n, delta


def _columns(records: Iterable[RequestRecord] | Mapping[str, RequestRecord],
             slo: Mapping[str, tuple[float, float]]) -> _Columns:
    recs = list(records.values() if isinstance(records, Mapping) else records)
    codes: dict[str, int] = {}
    model = np.fromiter((codes.setdefault(r.model, len(codes)) for r in recs), np.int64, count=len(recs))
    missing = sorted(set(codes) - set(slo))
    if missing:
        raise ValueError(f"no SLO for model(s) {missing}; slo has {sorted(slo)}")
    names = list(codes)
    slo_ttft = np.array([slo[n][0] for n in names], dtype=np.float64)[model]
    slo_tpot = np.array([slo[n][1] for n in names], dtype=np.float64)[model]

    count, nan = len(recs), np.nan
    arrival = np.fromiter(map(attrgetter("arrival_at"), recs), np.float64, count=count)  # column by column:
    first = np.fromiter((nan if r.first_token_at is None else r.first_token_at for r in recs), np.float64, count=count)
    finish = np.fromiter((nan if r.finished_at is None else r.finished_at for r in recs), np.float64, count=count)
    generated = np.fromiter(map(attrgetter("generated"), recs), np.float64, count=count)  # (a list of tuples
    prompt = np.fromiter(map(attrgetter("prompt_tokens"), recs), np.float64, count=count)  # took the slow path)
    failed = np.fromiter((bool(r.failed) for r in recs), np.bool_, count=len(recs))
    completed = ~failed & ~np.isnan(finish) & ~np.isnan(first)
    ttft = np.where(completed, first - arrival, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(completed & (generated > 1), (finish - first) / (generated - 1), np.nan)
    ttft_ok = ttft <= slo_ttft
    tpot_ok = (generated <= 1) | (tpot <= slo_tpot)
    behind, itl, itl_weight = _walk_segments(recs, arrival, slo_ttft, slo_tpot, completed)
    service = finish - arrival
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(service > 0, 1.0 - behind / service, 1.0)
    score = np.where(completed, np.clip(score, 0.0, 1.0), 0.0)
    return _Columns([r.request_id for r in recs], names, model, arrival,
                    prompt, generated, ttft, tpot, np.where(completed, service, np.nan),
                    completed, failed, ttft_ok, tpot_ok, completed & ttft_ok & tpot_ok, score, itl, itl_weight)


def _walk_segments(recs: list[RequestRecord], arrival: Floats, slo_ttft: Floats, slo_tpot: Floats,
                   completed: NDArray[np.bool_]) -> tuple[Floats, Floats, Floats]:
    """Per request: seconds behind Aegaeon's deadlines; and the ITL gaps (value, count) of completed ones.

    Token i of a segment (t0, n, δ) lands at t0 + iδ and is due at D0 + i*TPOT_SLO, so its
    lateness l_i = (t0 - D0) + i(δ - TPOT_SLO) is linear in i. For i >= 1 the request is
    behind for clip(l_i, 0, δ) = max(l_i, 0) - max(l_i - δ, 0) before it, summed in closed
    form by `_sum_clipped`; token 0 waits on the previous segment's last token (or arrival).
    """
    counts, t0, n, delta = _segment_arrays(recs)
    owner = np.repeat(np.arange(len(recs)), counts)
    starts = (np.cumsum(counts) - counts)[counts > 0]  # each record's first segment
    before = np.cumsum(n) - n  # tokens before the segment, counted from the first record
    base = np.zeros(len(recs))
    base[counts > 0] = before[starts]
    prev = np.empty_like(t0)  # the token before the segment's first
    prev[1:] = t0[:-1] + (n[:-1] - 1) * delta[:-1]
    prev[starts] = arrival[counts > 0]
    first_due = arrival + slo_ttft
    seg_behind = np.empty_like(t0)
    for lo in range(0, len(t0), _BLOCK):  # blocks keep the temporaries in cache
        s, o = slice(lo, lo + _BLOCK), owner[lo:lo + _BLOCK]
        tpot, t, spacing = slo_tpot[o], t0[s], delta[s]
        due = first_due[o] + (before[s] - base[o]) * tpot  # of the segment's first token
        seg_behind[s] = np.maximum(t - np.maximum(due, prev[s]), 0.0) + _sum_clipped(
            t - due, spacing - tpot, n[s] - 1, spacing)
    behind = np.bincount(owner, weights=seg_behind, minlength=len(recs)).astype(np.float64)

    done = completed[owner]
    after_gap = done.copy()
    after_gap[starts] = False
    gaps = np.sort((t0 - prev)[after_gap])  # one gap before each later segment: a plain sort
    keep = done & (n > 1)
    order = np.argsort(delta[keep])
    values = np.concatenate([delta[keep][order], gaps])
    weights = np.concatenate([(n[keep] - 1)[order], np.ones(len(gaps))])
    merged = np.argsort(values, kind="stable")  # two sorted runs: timsort merges them in linear time
    return behind, values[merged], weights[merged]


def weighted_percentiles(values: Floats, weights: Floats, qs: Iterable[float]) -> list[float]:
    """np.percentile (linear) of the array where each value repeats `weights` (whole) times."""
    order = np.argsort(values)
    return _sorted_percentiles(values[order], weights[order], qs)


def _sorted_percentiles(values: Floats, weights: Floats, qs: Iterable[float]) -> list[float]:
    cum = np.cumsum(weights)
    if not len(cum) or cum[-1] <= 0:
        return [0.0 for _ in qs]
    ranks = (cum[-1] - 1) * np.asarray(list(qs), dtype=np.float64) / 100
    below = np.floor(ranks)
    lo = values[np.searchsorted(cum, below, side="right")]
    hi = values[np.searchsorted(cum, np.minimum(below + 1, cum[-1] - 1), side="right")]
    return [float(x) for x in lo + (hi - lo) * (ranks - below)]


def _latency(name: str, values: Floats, weights: Floats | None = None) -> dict[str, float]:
    """mean/median/std/p50/p90/p99 in ms, the `vllm bench serve` keys; weighted values come sorted."""
    if weights is None:  # unweighted, unsorted
        values = np.sort(values[~np.isnan(values)])
        weights = np.ones(len(values))
    total = float(weights.sum())
    mean = float(weights @ values) / total if total else 0.0
    std = float(np.sqrt(weights @ (values - mean) ** 2 / total)) if total else 0.0
    p = _sorted_percentiles(values, weights, (50, *PERCENTILES))
    out = {f"mean_{name}_ms": mean * 1e3, f"median_{name}_ms": p[0] * 1e3, f"std_{name}_ms": std * 1e3}
    out.update({f"p{q}_{name}_ms": v * 1e3 for q, v in zip(PERCENTILES, p[1:])})
    return out


def _core(c: _Columns, rows: NDArray[np.int64], span_s: float) -> dict[str, Any]:
    """Counts, throughputs and both attainments over the records `rows`."""
    done = rows[c.completed[rows]]
    num_in, num_out = float(c.prompt[done].sum()), float(c.generated[done].sum())
    return {
        "num_requests": len(rows), "completed": len(done), "failed": int(c.failed[rows].sum()),
        "unfinished": int((~c.completed[rows] & ~c.failed[rows]).sum()),
        "total_input_tokens": int(num_in), "total_output_tokens": int(num_out),
        "request_throughput": len(done) / span_s, "request_goodput": int(c.attained[rows].sum()) / span_s,
        "output_throughput": num_out / span_s, "total_token_throughput": (num_in + num_out) / span_s,
        "slo_attainment": float(c.attained[rows].mean()) if len(rows) else 0.0,
        "aegaeon_slo_attainment": float(c.score[rows].mean()) if len(rows) else 0.0,
    }


def summarize(records: Iterable[RequestRecord] | Mapping[str, RequestRecord],
              slo: Mapping[str, tuple[float, float]], duration_s: float,
              devices: Mapping[str, Any] | None = None, num_gpus: int | None = None, *,
              gpus_per_instance: Mapping[str, int] | None = None, makespan_s: float | None = None) -> dict[str, Any]:
    """JSON-ready figures of a run; `slo` maps model -> (TTFT SLO s, TPOT SLO s).

    Rates (throughput, goodput, busy share, switches per minute) are over the makespan, vLLM's
    `duration`: `makespan_s`, else max(duration_s, the last finish). `devices` are the
    simulator's (busy_s, num_switches, switch_s, kv_moved_bytes per instance); an instance
    spans `gpus_per_instance[id]` GPUs (default 1), and `num_gpus` (default: the GPUs of
    `devices`) should be the pool size, since instances that never ran are absent there.
    """
    c = _columns(records, slo)
    last_finish = float(np.nanmax(c.arrival + c.e2el, initial=0.0))
    span = max(makespan_s if makespan_s is not None else max(duration_s, last_finish), 1e-9)
    everyone = np.arange(len(c.model), dtype=np.int64)
    out: dict[str, Any] = {"duration": span, "trace_duration_s": duration_s, **_core(c, everyone, span)}
    with np.errstate(divide="ignore"):
        rate = 1.0 / c.tpot[c.completed]  # (n - 1) / (finish - first), each stream's own speed
    rate = rate[np.isfinite(rate)]
    out["per_user_output_tokens_per_s"] = float(rate.mean()) if len(rate) else 0.0
    for name, values in (("ttft", c.ttft), ("tpot", c.tpot), ("e2el", c.e2el)):
        out.update(_latency(name, values))
    out.update(_latency("itl", c.itl, c.itl_weight))
    if devices is not None:
        out.update(_device_figures(devices, span, num_gpus, gpus_per_instance or {}))
    out["per_model"] = _per_model(c, span, slo)
    return out


def _device_figures(devices: Mapping[str, Any], span_s: float, num_gpus: int | None,
                    gpus_per_instance: Mapping[str, int]) -> dict[str, Any]:
    gpus = {iid: gpus_per_instance.get(iid, 1) for iid in devices}
    pool = num_gpus if num_gpus is not None else sum(gpus.values())
    busy = sum(dev.busy_s * gpus[iid] for iid, dev in devices.items())
    switches = sum(dev.num_switches for dev in devices.values())
    return {
        "num_gpus": pool, "gpu_busy_share": busy / (pool * span_s) if pool else 0.0,
        "num_switches": int(switches),
        "num_model_switches": int(sum(getattr(dev, "num_model_switches", 0) for dev in devices.values())),
        "num_weight_copies": int(sum(getattr(dev, "num_weight_copies", 0) for dev in devices.values())),
        "num_weight_recopies": int(sum(getattr(dev, "num_weight_copies", 0) - len(getattr(dev, "copied", ()))
                                       for dev in devices.values())),
        "switch_seconds": float(sum(dev.switch_s for dev in devices.values())),
        "kv_bytes_moved": float(sum(dev.kv_moved_bytes for dev in devices.values())),
        "switches_per_gpu_per_minute": switches / pool / (span_s / 60) if pool else 0.0,
        # per instance, the decode steps queued ahead that its next work waited for (costs.decode_ahead)
        "decode_steps_discarded": {iid: int(getattr(dev, "ahead_discarded", 0)) for iid, dev in devices.items()},
    }


def _per_model(c: _Columns, span_s: float, slo: Mapping[str, tuple[float, float]]) -> dict[str, dict[str, Any]]:
    order = np.argsort(c.model, kind="stable")
    bounds = np.searchsorted(c.model[order], np.arange(len(c.model_names) + 1))
    out: dict[str, dict[str, Any]] = {}
    for code, name in sorted(enumerate(c.model_names), key=lambda item: item[1]):
        rows = order[bounds[code]:bounds[code + 1]]
        figures = _core(c, rows, span_s)
        figures.update(ttft_slo_ms=slo[name][0] * 1e3, tpot_slo_ms=slo[name][1] * 1e3)
        for metric, values in (("ttft", c.ttft[rows]), ("tpot", c.tpot[rows])):
            values = values[~np.isnan(values)]
            p = np.percentile(values, PERCENTILES) if len(values) else np.zeros(len(PERCENTILES))
            figures.update({f"p{q}_{metric}_ms": float(v) * 1e3 for q, v in zip(PERCENTILES, p)})
        out[name] = figures
    return out


def request_rows(records: Iterable[RequestRecord] | Mapping[str, RequestRecord],
                 slo: Mapping[str, tuple[float, float]]) -> list[dict[str, Any]]:
    """One CSV-ready row per request; latencies in ms, None where undefined."""
    c = _columns(records, slo)

    def ms(x: float) -> float | None:
        return None if np.isnan(x) else round(x * 1e3, 3)

    return [{"request_id": rid, "model": c.model_names[code], "arrival_at": arrival, "prompt_tokens": int(prompt),
             "output_tokens": int(generated), "ttft_ms": ms(ttft), "tpot_ms": ms(tpot), "e2el_ms": ms(e2el),
             "completed": done, "ttft_attained": done and t_ok, "tpot_attained": done and p_ok,
             "slo_attained": ok, "aegaeon_score": round(score, 6)}
            for rid, code, arrival, prompt, generated, ttft, tpot, e2el, done, t_ok, p_ok, ok, score in zip(
                c.request_id, c.model.tolist(), c.arrival.tolist(), c.prompt.tolist(), c.generated.tolist(),
                c.ttft.tolist(), c.tpot.tolist(), c.e2el.tolist(), c.completed.tolist(), c.ttft_ok.tolist(),
                c.tpot_ok.tolist(), c.attained.tolist(), c.score.tolist())]
