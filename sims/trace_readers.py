"""Readers for the public per-request traces (`sims.trace_store` catalogues them) and for the generic format.

Every reader returns a `Workload` with arrivals re-based to the first request
(except the generic format, whose timestamps are kept as written). A row that
cannot be used raises `TraceError` naming the file, the 1-based line, the
column and the value; with `skip_bad_rows=True` it is dropped and counted in
`Workload.num_skipped_rows`. Unsorted rows are sorted; zero token counts
become 1 (counted in `Workload.num_clamped_tokens`).

| reader | files | models |
|---|---|---|
| read_azure_llm | azure-llm-2023/AzureLLMInferenceTrace_{conv,code}.csv | one per file |
| read_vidur | vidur-processed-traces/splitwise_{conv,code}.csv | one |
| read_mooncake | mooncake/*.jsonl (timestamp in ms) | one |
| read_length_pairs | sharegpt / arxiv length CSVs: lengths only | - |
| read_alibaba_genai | alibaba-genai-2026/lora_request_trace.csv (no tokens) | one per base model |
| read_azure_functions | azure-functions-2019-invitro-sample/1000_inv.csv | one per function |
| read_generic | CSV/JSONL: timestamp_s, model, input_tokens, output_tokens | as written |

Any file may be gzip-compressed (`.gz`, e.g. `trace.csv.gz`). `Rows`,
`Cells`, `read_csv_rows` and `read_jsonl_rows` are the shared machinery that
turns cells into checked numpy columns (sims.servegen uses them).
"""

from __future__ import annotations

import csv
import difflib
import gzip
import io
import json
import re
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from sims.synthetic import DEFAULT_MAX_REQUESTS, LengthDistribution, check_request_budget, spread_counts, stream
from sims.workload import GENERIC_COLUMNS, MAX_TOKENS, TraceError, Workload

csv.field_size_limit(1 << 24)


# -- rows and per-cell validation ------------------------------------------------


class Rows:
    """Raw cells of a row-oriented file, column by column, with each row's 1-based line number."""

    def __init__(self, path: Path, columns: Sequence[str]) -> None:
        self.path = path
        self.columns: dict[str, list[Any]] = {name: [] for name in columns}
        self.lines: list[int] = []
        self.num_unreadable = 0  # rows dropped before any cell was looked at

    def __len__(self) -> int:
        return len(self.lines)


class Cells:
    """Converts and checks the columns of `Rows`; remembers the earliest bad cell.

    `finish()` raises for the earliest bad row, or (skip_bad_rows) returns
    the mask of good rows and how many were dropped.
    """

    def __init__(self, rows: Rows, skip_bad_rows: bool) -> None:
        self.rows = rows
        self.skip_bad_rows = skip_bad_rows
        self.bad = np.zeros(len(rows), dtype=bool)
        self.first: tuple[int, str, Any, str] | None = None

    def flag(self, column: str, bad: np.ndarray, reason: str) -> None:
        if not bad.any():
            return
        self.bad |= bad
        row = int(np.argmax(bad))
        if self.first is None or row < self.first[0]:
            self.first = (row, column, self.rows.columns[column][row], reason)

    def number(self, column: str, integer: bool = False, positive: bool = False) -> np.ndarray:
        """The column as float64; missing, non-numeric, non-finite or negative cells are flagged."""
        raw = self.rows.columns[column]
        try:
            values = np.array(raw, dtype=np.float64)
            if values.shape != (len(raw),):
                raise ValueError("cells are not scalars")
        except (ValueError, TypeError, OverflowError):
            values = np.array([to_float(cell) for cell in raw], dtype=np.float64)
        bad = ~np.isfinite(values)
        missing = np.array([cell is None or cell == "" for cell in raw], dtype=bool) if bad.any() else bad
        self.flag(column, missing, "missing value")
        self.flag(column, bad & ~missing, "not a finite number")
        values = np.where(bad, 0.0, values)
        self.flag(column, values < 0, "negative")
        if positive:
            self.flag(column, values == 0, "must be > 0")
        if integer:
            not_integer = (values != np.floor(values)) | (values > MAX_TOKENS)
            self.flag(column, not_integer, f"not an integer in 0..{MAX_TOKENS}")
        return values

    def text(self, column: str, allowed: Sequence[str] | None = None, allow_empty: bool = False) -> list[str]:
        """The column as stripped strings (integers become digits); flags missing, undecodable or unknown cells."""
        raw = self.rows.columns[column]
        values = [_as_text(cell) for cell in raw]
        self.flag(column, np.array([cell is None for cell in raw], bool), "missing value")
        self.flag(column, np.array([v is None and c is not None for v, c in zip(values, raw)], bool), "not text")
        texts = [v or "" for v in values]
        if allowed is not None:
            self.flag(column, np.array([v not in allowed for v in texts], bool), f"not one of {list(allowed)}")
        elif not allow_empty:
            self.flag(column, np.array([v == "" for v in values], bool), "missing value")
        self.flag(column, np.array(["\ufffd" in v for v in texts], bool), "not valid UTF-8")
        return texts

    def timestamp(self, column: str) -> np.ndarray:
        """`YYYY-MM-DD HH:MM:SS[.fraction]` (any number of fraction digits) as UTC epoch seconds."""
        whole_seconds: dict[str, float] = {}
        values = np.array([_epoch_s(cell, whole_seconds) for cell in self.rows.columns[column]], dtype=np.float64)
        self.flag(column, np.isnan(values), "not a YYYY-MM-DD HH:MM:SS timestamp")
        return np.nan_to_num(values)

    def finish(self) -> tuple[np.ndarray, int]:
        if self.first is not None and not self.skip_bad_rows:
            row, column, value, reason = self.first
            raise TraceError(f"{self.rows.path}:{self.rows.lines[row]}: column {column!r}: {reason}: {value!r}")
        return ~self.bad, int(self.bad.sum()) + self.rows.num_unreadable


def _as_text(cell: Any) -> str | None:
    if isinstance(cell, str):
        return cell.strip()
    return str(cell) if isinstance(cell, int) and not isinstance(cell, bool) else None


def to_float(cell: Any) -> float:
    """A cell as a float; NaN when it is not a number."""
    if isinstance(cell, (str, int, float)) and not isinstance(cell, bool):
        try:
            return float(cell)
        except (ValueError, OverflowError):
            pass
    return float("nan")


_TIMESTAMP = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?")


def _epoch_s(cell: Any, cache: dict[str, float]) -> float:
    match = _TIMESTAMP.fullmatch(cell.strip()) if isinstance(cell, str) else None
    if match is None:
        return float("nan")
    whole, fraction = match.groups()
    if whole not in cache:
        try:
            cache[whole] = datetime.fromisoformat(whole).replace(tzinfo=timezone.utc).timestamp()
        except ValueError:
            cache[whole] = float("nan")
    return cache[whole] + (float("0." + fraction) if fraction else 0.0)


# -- file access ------------------------------------------------------------------


def _compressed(path: Path) -> bool:
    return path.suffix.lower() == ".gz"


def text_of(path: Path) -> str:
    try:
        data = path.read_bytes()
        if _compressed(path):
            data = gzip.decompress(data)
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise TraceError(f"cannot read trace file {path}: {error}") from None
    # Undecodable bytes become U+FFFD, which the cell checks then report with their line.
    return data.decode("utf-8-sig", errors="replace")


def read_csv_rows(path: Path, required: Sequence[str] | None, skip_bad_rows: bool) -> Rows:
    """The `required` columns (all when None) of a CSV file with a header row."""
    reader = csv.reader(io.StringIO(text_of(path), newline=""))
    wanted: list[str] | None = None
    positions: list[int] = []
    records: list[list[str]] = []
    lines: list[int] = []
    num_unreadable = 0

    def columns_of(names: list[str], line: int) -> list[str]:
        chosen = list(required) if required is not None else names
        missing = [name for name in chosen if name not in names]
        if missing:
            raise TraceError(f"{path}:{line}: column {missing[0]!r}: missing from the header: {names[:8]!r}")
        positions.extend(names.index(name) for name in chosen)
        return chosen

    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as error:
            if wanted is None or not skip_bad_rows:
                raise TraceError(f"{path}:{reader.line_num}: column '(row)': unreadable CSV: {error}") from None
            num_unreadable += 1
            continue
        if wanted is None:
            wanted = columns_of([name.strip() for name in cells], reader.line_num)
        elif any(cell.strip() for cell in cells):
            lines.append(reader.line_num)
            records.append(cells)
    if wanted is None:
        raise TraceError(f"{path}: empty file (no header row)")
    rows = Rows(path, wanted)
    rows.lines, rows.num_unreadable = lines, num_unreadable
    for name, position in zip(wanted, positions):  # a short row's missing cells are None
        rows.columns[name] = [record[position] if position < len(record) else None for record in records]
    return rows


def read_jsonl_rows(path: Path, required: Sequence[str], skip_bad_rows: bool) -> Rows:
    """The `required` keys of a JSON-lines file (one object a line; blank lines ignored)."""
    rows = Rows(path, required)
    for line_number, line in enumerate(text_of(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as error:
            if not skip_bad_rows:
                raise TraceError(f"{path}:{line_number}: column '(row)': not a JSON object ({error}): {line[:80]!r}")
            rows.num_unreadable += 1
            continue
        rows.lines.append(line_number)
        for name in required:
            rows.columns[name].append(record.get(name))
    return rows


def open_text(path: Path) -> io.TextIOWrapper:
    """A (possibly gzipped) trace file as a text stream, for sniffing its format; bad bytes become U+FFFD."""
    try:
        raw = gzip.open(path) if _compressed(path) else open(path, "rb")
    except OSError as error:
        raise TraceError(f"cannot read trace file {path}: {error}") from None
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline="")


def is_jsonl(path: Path) -> bool:
    suffix = Path(path.stem).suffix if _compressed(path) else path.suffix
    if suffix.lower() in (".jsonl", ".json", ".ndjson"):
        return True
    try:
        with open_text(path) as file:
            return file.read(4096).lstrip()[:1] == "{"
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise TraceError(f"cannot read trace file {path}: {error}") from None


# -- per-request traces ---------------------------------------------------------


def _model_name(path: Path) -> str:
    stem = path.stem
    for known, name in (("AzureLLMInferenceTrace_", "azure-"), ("splitwise_", "vidur-")):
        if stem.startswith(known):
            return name + stem[len(known):]
    return stem


def read_azure_llm(paths: Sequence[Path], skip_bad_rows: bool = False) -> Workload:
    """Azure LLM 2023 (Splitwise): one model per file ("azure-conv", "azure-code"), one common time origin."""
    parts = []
    for path in paths:
        rows = read_csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), skip_bad_rows)
        cells = Cells(rows, skip_bad_rows)
        at = cells.timestamp("TIMESTAMP")
        inputs = cells.number("ContextTokens", integer=True)
        outputs = cells.number("GeneratedTokens", integer=True)
        keep, num_skipped = cells.finish()
        parts.append((at[keep], inputs[keep], outputs[keep], num_skipped))
    origin = min((float(at.min()) for at, *_ in parts if at.size), default=0.0)
    return Workload.from_columns(
        np.concatenate([at - origin for at, *_ in parts]),
        np.repeat(np.arange(len(parts)), [at.size for at, *_ in parts]),
        np.concatenate([part[1] for part in parts]),
        np.concatenate([part[2] for part in parts]),
        models=[_model_name(path) for path in paths],
        source=", ".join(str(path) for path in paths),
        num_skipped_rows=sum(part[3] for part in parts),
    )


def _single_model(path: Path, at: np.ndarray, inputs: np.ndarray, outputs: np.ndarray,
                  cells: Cells, model: str | None) -> Workload:
    """One model's workload from checked columns, re-based to its first arrival."""
    keep, num_skipped = cells.finish()
    at = at[keep]
    if at.size:
        at = at - at.min()
    return Workload.from_columns(at, np.zeros(at.size, np.int32), inputs[keep], outputs[keep],
                                 models=[model or _model_name(path)], source=str(path), num_skipped_rows=num_skipped)


def read_vidur(path: Path, model: str | None = None, skip_bad_rows: bool = False) -> Workload:
    """Vidur's processed Azure traces (`arrived_at` in seconds, prefill/decode token counts)."""
    rows = read_csv_rows(path, ("arrived_at", "num_prefill_tokens", "num_decode_tokens"), skip_bad_rows)
    cells = Cells(rows, skip_bad_rows)
    return _single_model(path, cells.number("arrived_at"), cells.number("num_prefill_tokens", integer=True),
                         cells.number("num_decode_tokens", integer=True), cells, model)


def read_mooncake(path: Path, model: str = "mooncake", skip_bad_rows: bool = False) -> Workload:
    """Mooncake FAST'25 JSONL (`timestamp` in ms). Prefix `hash_ids` are not kept."""
    rows = read_jsonl_rows(path, ("timestamp", "input_length", "output_length"), skip_bad_rows)
    cells = Cells(rows, skip_bad_rows)
    return _single_model(path, cells.number("timestamp") / 1000.0, cells.number("input_length", integer=True),
                         cells.number("output_length", integer=True), cells, model)


def read_generic(path: Path, skip_bad_rows: bool = False, fleet_models: Sequence[str] | None = None) -> Workload:
    """The generic format (CSV with a header, or JSONL): timestamp_s, model, input_tokens, output_tokens.

    Timestamps are seconds, kept as written (not re-based); models are
    numbered in order of first appearance. Given `fleet_models`, every name
    must be one of them: a row with another name is a bad row (file, line,
    the name, the closest fleet name, the fleet's names), and a file naming
    none of them is refused as a whole, since a misspelt name would otherwise
    have the whole file dealt onto the fleet and send every request to the
    wrong model. `sims.traces` passes None where the user asked for a mapping
    (`;map=fold`), which it then reports.
    """
    reader = read_jsonl_rows if is_jsonl(path) else read_csv_rows
    rows = reader(path, GENERIC_COLUMNS, skip_bad_rows)
    cells = Cells(rows, skip_bad_rows)
    at = cells.number("timestamp_s")
    names = cells.text("model")
    if fleet_models is not None:
        _check_fleet_names(path, cells, names, fleet_models)
    inputs = cells.number("input_tokens", integer=True)
    outputs = cells.number("output_tokens", integer=True)
    keep, num_skipped = cells.finish()
    kept_names = [name for name, ok in zip(names, keep) if ok]
    models = list(dict.fromkeys(kept_names))
    index_of = {name: index for index, name in enumerate(models)}
    model_index = np.array([index_of[name] for name in kept_names], dtype=np.int32)
    return Workload.from_columns(at[keep], model_index, inputs[keep], outputs[keep], models=models,
                                 source=str(path), num_skipped_rows=num_skipped)


def _check_fleet_names(path: Path, cells: Cells, names: list[str], fleet_models: Sequence[str]) -> None:
    """Flag each row whose model is not one of `fleet_models`; refuse a file that names none of them."""
    known = set(fleet_models)
    unknown = [name for name in dict.fromkeys(names) if name and name not in known]
    if not unknown:
        return
    how = (f"the fleet's {len(fleet_models)} models: {', '.join(fleet_models)}. To deal the file's models onto "
           f"the fleet by popularity instead, add ;map=fold to the trace spec (the mapping is printed)")
    if not known & set(names):
        shown = ", ".join(repr(name) for name in unknown[:5])
        shown += f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise TraceError(f"{path}: none of the file's {len(unknown)} model names is a model of the fleet "
                         f"({shown}; {how})")
    for name in unknown:
        close = difflib.get_close_matches(name, fleet_models, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        cells.flag("model", np.array([cell == name for cell in names], dtype=bool),
                   f"not a model of the fleet ({hint}{how})")


def read_length_pairs(path: Path, skip_bad_rows: bool = False) -> LengthDistribution:
    """A length-only CSV (ShareGPT, arxiv: num_prefill_tokens, num_decode_tokens) as a distribution."""
    rows = read_csv_rows(path, ("num_prefill_tokens", "num_decode_tokens"), skip_bad_rows)
    cells = Cells(rows, skip_bad_rows)
    inputs = cells.number("num_prefill_tokens", integer=True)
    outputs = cells.number("num_decode_tokens", integer=True)
    keep, _ = cells.finish()
    if not keep.any():
        raise TraceError(f"{path}: no length pairs")
    return LengthDistribution(inputs[keep].astype(np.int64), outputs[keep].astype(np.int64), path.stem)


def read_alibaba_genai(path: Path, lengths: LengthDistribution, seed: int, skip_bad_rows: bool = False) -> Workload:
    """Alibaba GenAI 2026 (Stable Diffusion + LoRA): arrivals and base-model ids, with token lengths from `lengths`.

    The trace has no tokens (it serves images), so input/output lengths are
    drawn from `lengths`. Timestamps have 1 s resolution; each request gets a
    seeded uniform offset inside its second so that requests logged in the
    same second do not arrive at the same instant. Rows with an empty
    checkpoint_model_version_id (25 PENDING requests in the published file)
    name no model; they are left out and counted in the notes.
    """
    rows = read_csv_rows(path, ("gmt_create", "checkpoint_model_version_id"), skip_bad_rows)
    cells = Cells(rows, skip_bad_rows)
    at = cells.timestamp("gmt_create")
    names = cells.text("checkpoint_model_version_id", allow_empty=True)
    keep, num_skipped = cells.finish()
    unrecorded = keep & np.array([name == "" for name in names], dtype=bool)
    keep &= ~unrecorded
    kept = [name for name, ok in zip(names, keep) if ok]
    models = sorted(set(kept))
    index_of = {name: index for index, name in enumerate(models)}
    at = at[keep]
    at = at - at.min() + stream(seed, "alibaba/jitter").random(at.size) if at.size else at
    inputs, outputs = lengths.sample(at.size, stream(seed, "lengths"))
    return Workload.from_columns(
        at, np.array([index_of[name] for name in kept], dtype=np.int32), inputs, outputs, models=models,
        source=str(path), num_skipped_rows=num_skipped,
        notes=(f"Stable Diffusion trace: token lengths drawn from {lengths.name}",
               "1 s timestamps spread uniformly within their second",
               f"{int(unrecorded.sum())} requests without a base model id (never scheduled) left out"),
    )


def read_azure_functions(
    path: Path,
    lengths: LengthDistribution,
    seed: int,
    start_s: float = 0.0,
    duration_s: float | None = None,
    num_functions: int | None = None,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    skip_bad_rows: bool = False,
) -> Workload:
    """Azure Functions 2019 per-minute invocation counts: each function becomes one model (AlpaServe's mapping).

    A minute's invocations are placed uniformly at random within the minute
    (a Poisson process given the count). Models are named "fn-" plus the
    first 10 hex digits of HashFunction. `num_functions` keeps a seeded
    random subset of the functions. Lengths come from `lengths`.
    """
    rows = read_csv_rows(path, None, skip_bad_rows)
    minutes = sorted((name for name in rows.columns if re.fullmatch(r"minute_\d+", name)), key=lambda n: int(n[7:]))
    if "HashFunction" not in rows.columns or not minutes:
        raise TraceError(f"{path}:1: column 'HashFunction' or 'minute_1': missing from the header")
    cells = Cells(rows, skip_bad_rows)
    names = cells.text("HashFunction")
    counts = np.stack([cells.number(minute, integer=True) for minute in minutes], axis=1)
    keep, num_skipped = cells.finish()
    functions = [name for name, ok in zip(names, keep) if ok]
    counts = counts[keep].astype(np.int64)
    if num_functions is not None and num_functions < len(functions):
        chosen = np.sort(stream(seed, "functions").choice(len(functions), size=num_functions, replace=False))
        functions, counts = [functions[i] for i in chosen], counts[chosen]
    first_minute = int(start_s // 60)
    last_minute = len(minutes) if duration_s is None else int(np.ceil((start_s + duration_s) / 60))
    selected = counts[:, first_minute:last_minute]
    check_request_budget(float(selected.sum()), max_requests, f"{path} (minutes {first_minute}..{last_minute})")
    at, row = spread_counts(selected, 60.0, stream(seed, "functions/arrivals"))
    at += first_minute * 60.0
    inputs, outputs = lengths.sample(at.size, stream(seed, "lengths"))
    models = [f"fn-{name[:10]}" for name in functions]
    if len(set(models)) != len(models):
        models = [f"fn-{i:04d}-{name[:10]}" for i, name in enumerate(functions)]
    workload = Workload.from_columns(
        at, row, inputs, outputs, models=models, source=str(path), duration_s=len(minutes) * 60.0,
        num_skipped_rows=num_skipped,
        notes=("per-minute counts spread uniformly within each minute", f"token lengths drawn from {lengths.name}"),
    )
    end_s = None if duration_s is None else start_s + duration_s
    return workload.time_slice(start_s, end_s)
