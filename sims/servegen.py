"""ServeGen (Alibaba Bailian) per-client workload models turned into requests.

ServeGen publishes no request log: each client of a model has one trace.csv
row per 600 s window (rate, CV, fitted Gamma/Weibull inter-arrival shape) and,
for some clients, a dataset.json with token-length PDFs per 6 h window.
`read_servegen` draws arrivals per client and window as ServeGen's own
generator does (gaps from the fitted shape, rescaled to the window's rate,
see `sims.synthetic.windowed_arrivals`) and draws lengths from the client's
PDF for the window, or from the model's pooled PDF when the client has none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sims.synthetic import (
    DEFAULT_MAX_REQUESTS,
    Pdf,
    check_request_budget,
    mix_pdfs,
    sample_pdf_lengths,
    stream,
    windowed_arrivals,
)
from sims.trace_readers import Cells, Rows, text_of, to_float
from sims.workload import TraceError, Workload


SERVEGEN_WINDOW_S = 600.0  # one trace.csv row
SERVEGEN_LENGTH_WINDOW_S = 21600.0  # one dataset.json entry
_COLUMNS = ("timestamp_s", "rate_per_s", "cv", "pattern", "shape", "scale")
_PDF_FIELDS = ("input_tokens", "output_tokens", "text_tokens", *(f"{m}_{k}" for m in ("image", "audio", "video")
                                                                 for k in ("tokens", "count")))


@dataclass(frozen=True, slots=True, eq=False)
class _Client:
    """The fitted windows of one client that have requests (one entry per 600 s window)."""

    start_s: np.ndarray
    rate_per_s: np.ndarray
    is_weibull: np.ndarray
    shape: np.ndarray
    scale: np.ndarray
    num_skipped_rows: int

    def volume(self, start_s: float, end_s: float) -> float:
        """Expected requests in [start_s, end_s)."""
        window_end_s = self.start_s + SERVEGEN_WINDOW_S
        overlap = np.clip(np.minimum(window_end_s, end_s) - np.maximum(self.start_s, start_s), 0.0, None)
        return float(np.sum(self.rate_per_s * overlap))


def _read_client(path: Path, start_s: float, end_s: float, skip_bad_rows: bool) -> _Client:
    """The windows of a headerless chunk-<i>-trace.csv that start in [start_s, end_s).

    Only those rows are parsed and checked (a 14-day file has 2016 rows, and
    a replay usually needs a few); a row whose timestamp does not parse is
    kept so that the checks report it.
    """
    rows = Rows(path, _COLUMNS)
    lines = text_of(path).split("\n")
    heads = [line.partition(",")[0] for line in lines]
    try:
        at = np.array(heads, dtype=np.float64)
    except ValueError:
        at = np.array([to_float(head) for head in heads], dtype=np.float64)
    wanted = ((at >= start_s) & (at < end_s)) | ~np.isfinite(at)
    for index in np.flatnonzero(wanted).tolist():
        if lines[index].strip():
            fields = lines[index].rstrip("\r").split(",")
            rows.lines.append(index + 1)
            for position, column in enumerate(rows.columns.values()):
                column.append(fields[position] if position < len(fields) else None)
    cells = Cells(rows, skip_bad_rows)
    start, rate = cells.number("timestamp_s"), cells.number("rate_per_s")
    cells.number("cv")
    pattern = np.array(cells.text("pattern", allowed=("", "Gamma", "Weibull")), dtype=np.str_)
    shape, scale = cells.number("shape"), cells.number("scale")
    fitted = (pattern != "") & (rate > 0)
    cells.flag("shape", fitted & (shape <= 0), "must be > 0 when a pattern is fitted")
    cells.flag("scale", fitted & (scale <= 0), "must be > 0 when a pattern is fitted")
    keep, num_skipped = cells.finish()
    used = keep & fitted
    return _Client(start[used], rate[used], pattern[used] == "Weibull", shape[used], scale[used], num_skipped)


def _servegen_pdfs(path: Path, window_keys: set[int] | None, skip_bad_rows: bool) -> dict[int, dict[str, Pdf]]:
    """The length PDFs of one client for the given 6 h windows (all when None); empty PDFs are left out."""
    try:
        document = json.loads(text_of(path))
    except ValueError as error:
        raise TraceError(f"{path}: not JSON: {error}") from None
    if not isinstance(document, dict):
        raise TraceError(f"{path}: expected a JSON object keyed by window start")
    result: dict[int, dict[str, Pdf]] = {}
    for key, fields in document.items():
        if not key.isdigit() or (window_keys is not None and int(key) not in window_keys):
            continue
        try:
            pdfs = {name: _parse_pdf(text) for name, text in fields.items() if name in _PDF_FIELDS}
            if "output_tokens" not in pdfs or not ({"input_tokens", "text_tokens"} & pdfs.keys()):
                raise ValueError(f"needs output_tokens and input_tokens (or text_tokens), has {sorted(fields)}")
        except (ValueError, TypeError, AttributeError) as error:
            if skip_bad_rows:
                continue
            raise TraceError(f"{path}: window {key!r}: {error}") from None
        if pdfs and all(values.size for values, _ in pdfs.values()):
            result[int(key)] = pdfs
    return result


def _parse_pdf(text: str) -> Pdf:
    """ServeGen writes a PDF as a Python dict literal, "{62: 0.0001, 66: 0.0002}"; parse it without eval."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError(f"not a {{value: probability}} PDF: {text[:60]!r}")
    body = body[1:-1].strip()
    if not body:
        return np.empty(0), np.empty(0)
    pairs = np.array(body.replace(":", ",").split(","), dtype=np.float64).reshape(-1, 2)
    if not (np.all(np.isfinite(pairs)) and pairs.min() >= 0 and pairs[:, 1].sum() > 0):
        raise ValueError(f"PDF has negative or non-finite entries: {text[:60]!r}")
    return pairs[:, 0], pairs[:, 1]


def client_ids(model_dir: Path, kind: str) -> dict[int, Path]:
    """{client id: path} of the chunk-<i>-<kind> files in a ServeGen model folder."""
    pattern = re.compile(rf"chunk-(\d+)-{kind}")
    return {int(m.group(1)): p for p in model_dir.iterdir() if (m := pattern.fullmatch(p.name))}


def read_servegen(
    model_dirs: Sequence[Path],
    seed: int,
    start_s: float = 0.0,
    duration_s: float = 3600.0,
    clients: float | None = None,
    by_client: bool = False,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    skip_bad_rows: bool = False,
) -> Workload:
    """Generate requests from ServeGen per-client models over [start_s, start_s + duration_s), re-based to 0.

    Per client and 600 s window, arrivals follow the fitted Gamma/Weibull
    shape rescaled to the window's rate (`sims.synthetic.windowed_arrivals`).
    Lengths come from the client's own PDF for the 6 h window; a client or
    window without one borrows the model's pooled PDF for that window (the
    mixture of its clients' PDFs, weighted by their expected requests in
    it), else the pool of every PDF of the model.
    `clients` keeps a seeded random subset: a fraction in (0, 1) or a count
    (rates are not scaled up, so the load shrinks). Each model dir is a
    model named after it ("m-large"), or each client is ("m-large/c61")
    when `by_client`. Raises TraceError if the expected number of requests
    exceeds `max_requests`.
    """
    end_s = start_s + duration_s
    # Parse the 6 h length windows around the range too: they weight the pooled PDFs.
    first_s = min(np.floor(start_s / SERVEGEN_LENGTH_WINDOW_S) * SERVEGEN_LENGTH_WINDOW_S, start_s - SERVEGEN_WINDOW_S)
    last_s = np.ceil(end_s / SERVEGEN_LENGTH_WINDOW_S) * SERVEGEN_LENGTH_WINDOW_S
    plans = []
    for model_dir in model_dirs:
        traces = client_ids(model_dir, "trace.csv") if model_dir.is_dir() else {}
        if not traces:
            raise TraceError(f"{model_dir}: no ServeGen chunk-<i>-trace.csv files here")
        chosen = sorted(traces)
        if clients is not None:
            count = int(round(clients * len(chosen))) if clients < 1 else int(clients)
            rng = stream(seed, f"servegen/clients/{model_dir}")
            chosen = sorted(rng.choice(chosen, size=max(1, min(count, len(chosen))), replace=False).tolist())
        datasets = client_ids(model_dir, "dataset.json")
        parsed = {cid: _read_client(traces[cid], first_s, last_s, skip_bad_rows)
                  for cid in sorted(set(chosen) | (set(datasets) & set(traces)))}
        plans.append((model_dir, {cid: parsed[cid] for cid in chosen}, datasets, parsed))
    expected = sum(client.volume(start_s, end_s) for _, chosen_clients, _, _ in plans
                   for client in chosen_clients.values())
    check_request_budget(expected, max_requests, f"servegen ({duration_s:g} s)")
    parts = [_generate(model_dir, chosen_clients, datasets, parsed, seed, start_s, end_s, by_client, skip_bad_rows)
             for model_dir, chosen_clients, datasets, parsed in plans]
    workload = parts[0].merge(parts[1:]) if len(parts) > 1 else parts[0]
    return replace(workload, source=", ".join(str(d) for d in model_dirs), duration_s=duration_s)


def _generate(model_dir: Path, chosen: dict[int, _Client], datasets: dict[int, Path], parsed: dict[int, _Client],
              seed: int, start_s: float, end_s: float, by_client: bool, skip_bad_rows: bool) -> Workload:
    ids = list(chosen)
    in_range = [(c.start_s < end_s) & (c.start_s + SERVEGEN_WINDOW_S > start_s) for c in chosen.values()]
    column = {name: np.concatenate([getattr(c, name)[mask] for c, mask in zip(chosen.values(), in_range)])
              for name in ("start_s", "rate_per_s", "is_weibull", "shape", "scale")}
    slot = np.repeat(np.arange(len(ids)), [int(mask.sum()) for mask in in_range])
    at, window = windowed_arrivals(column["start_s"], SERVEGEN_WINDOW_S, column["rate_per_s"], column["is_weibull"],
                                   column["shape"], column["scale"], stream(seed, f"servegen/arrivals/{model_dir}"))
    keep = (at >= start_s) & (at < end_s)
    at, slot = at[keep], slot[window[keep]]
    inputs, outputs, num_borrowed = _lengths(model_dir, ids, slot, at, datasets, parsed, seed, skip_bad_rows)
    models = [f"{model_dir.name}/c{cid}" for cid in ids] if by_client else [model_dir.name]
    return Workload.from_columns(
        at - start_s, slot if by_client else np.zeros(at.size, np.int32), inputs, outputs, models=models,
        source=str(model_dir), duration_s=end_s - start_s,
        num_skipped_rows=sum(client.num_skipped_rows for client in parsed.values()),
        notes=(f"{model_dir.name}: {len(ids)} clients; {num_borrowed} of {at.size} requests use pooled length PDFs",),
    )


def _lengths(model_dir: Path, ids: list[int], slot: np.ndarray, at: np.ndarray, datasets: dict[int, Path],
             parsed: dict[int, _Client], seed: int, skip_bad_rows: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """(inputs, outputs, number of requests that used a pooled PDF) for requests of client ids[slot] at `at`."""
    inputs, outputs = np.ones(at.size, np.int64), np.ones(at.size, np.int64)
    if at.size == 0:
        return inputs, outputs, 0
    key_of = (np.floor(at / SERVEGEN_LENGTH_WINDOW_S) * SERVEGEN_LENGTH_WINDOW_S).astype(np.int64)
    keys = set(np.unique(key_of).tolist())
    own = {cid: _servegen_pdfs(path, keys, skip_bad_rows) for cid, path in sorted(datasets.items())}
    if not any(own.values()):  # no client has PDFs for these windows: pool every window of every client
        own = {cid: _servegen_pdfs(path, None, skip_bad_rows) for cid, path in sorted(datasets.items())}
    pooled = _pooled_pdfs(own, parsed)
    if -1 not in pooled:
        raise TraceError(f"{model_dir}: no chunk-<i>-dataset.json with length PDFs to draw lengths from")
    rng = stream(seed, f"servegen/lengths/{model_dir}")
    num_borrowed = 0
    group = slot.astype(np.int64) * (1 << 32) + key_of
    order = np.argsort(group, kind="stable")
    values, firsts = np.unique(group[order], return_index=True)
    for value, rows in zip(values.tolist(), np.split(order, firsts[1:])):
        cid, key = ids[value >> 32], value & 0xFFFFFFFF
        pdfs = own.get(cid, {}).get(key)
        if pdfs is None:
            pdfs, num_borrowed = pooled.get(key, pooled[-1]), num_borrowed + rows.size
        inputs[rows], outputs[rows] = sample_pdf_lengths(pdfs, rows.size, rng)
    return inputs, outputs, num_borrowed


def _pooled_pdfs(own: dict[int, dict[int, dict[str, Pdf]]], parsed: dict[int, _Client]) -> dict[int, dict[str, Pdf]]:
    """Per 6 h window, the mixture of the clients' PDFs weighted by their expected requests then; key -1: all."""
    by_key: dict[int, list[tuple[float, dict[str, Pdf]]]] = {}
    for cid, pdfs_by_key in own.items():
        client = parsed.get(cid)
        for key, pdfs in pdfs_by_key.items():
            weight = client.volume(key, key + SERVEGEN_LENGTH_WINDOW_S) if client is not None else 0.0
            by_key.setdefault(key, []).append((weight, pdfs))
    pooled = {key: mix_pdfs(parts) for key, parts in by_key.items()}
    everything = [part for parts in by_key.values() for part in parts]
    if everything:
        pooled[-1] = mix_pdfs(everything)
    return pooled
