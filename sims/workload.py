"""A replayable workload: one columnar, time-sorted table of requests.

`Workload` holds numpy columns (arrival time, model index, input and output
tokens) so the simulator can replay a million requests without a million
Python objects. Transforms (`time_slice`, `scale_rate`, `map_models`,
`fold_models`, `merge`, `head`) return new workloads; nothing mutates one.
Request ids are the 1-based row position ("r0000001"), stable for a given
workload: a transform that drops or reorders rows numbers its rows afresh.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

MAX_TOKENS = 2**31 - 1
Weights = Sequence[float] | np.ndarray | Mapping[str, float]  # per-model popularity, any positive scale
GENERIC_COLUMNS = ("timestamp_s", "model", "input_tokens", "output_tokens")


class TraceError(ValueError):
    """A trace, spec or option that cannot be read; the message says where and why."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload, as a small value for code that wants rows."""

    request_id: str
    arrival_at: float
    model: str
    input_tokens: int
    output_tokens: int


def request_id(row: int) -> str:
    """The id of the request at 0-based `row`: "r0000001" for row 0."""
    return f"r{row + 1:07d}"


def _frozen(values: npt.ArrayLike, dtype: type) -> np.ndarray:
    """A read-only 1-D array of `dtype`; read-only arrays of that dtype are shared, not copied."""
    if isinstance(values, np.ndarray) and values.dtype == dtype and values.ndim == 1 and not values.flags.writeable:
        return values
    array: np.ndarray = np.array(values, dtype=dtype, copy=True).reshape(-1)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Requests sorted by arrival; column i of every array is request i.

    Build one with `Workload.from_columns`, which sorts and clamps; the
    constructor only checks, so a Workload is always valid.
    """

    arrival_s: np.ndarray  # float64, ascending, >= 0: seconds from the workload's origin
    model_index: np.ndarray  # int32 index into `models`
    input_tokens: np.ndarray  # int32 >= 1 (prompt)
    output_tokens: np.ndarray  # int32 >= 1 (tokens to generate)
    models: tuple[str, ...]  # model names; may include models that get no request
    source: str  # where it came from (spec or path), for reports
    duration_s: float = 0.0  # observation window [0, duration_s); >= the last arrival
    num_skipped_rows: int = 0  # malformed rows dropped with skip_bad_rows=True
    num_clamped_tokens: int = 0  # zero token counts raised to 1
    notes: tuple[str, ...] = field(default=())  # modelling choices made while loading

    def __post_init__(self) -> None:
        for name, dtype in (("arrival_s", np.float64), ("model_index", np.int32),
                            ("input_tokens", np.int32), ("output_tokens", np.int32)):
            object.__setattr__(self, name, _frozen(getattr(self, name), dtype))
        num = self.arrival_s.size
        if not all(column.size == num for column in (self.model_index, self.input_tokens, self.output_tokens)):
            raise TraceError(f"{self.source}: workload columns differ in length")
        if len(set(self.models)) != len(self.models):
            raise TraceError(f"{self.source}: duplicate model names in {self.models}")
        if num == 0:
            return
        if not np.all(np.isfinite(self.arrival_s)) or self.arrival_s[0] < 0:
            raise TraceError(f"{self.source}: arrival times must be finite and >= 0")
        if np.any(np.diff(self.arrival_s) < 0):
            raise TraceError(f"{self.source}: arrival times are not sorted (use Workload.from_columns)")
        if self.model_index.min() < 0 or self.model_index.max() >= len(self.models):
            raise TraceError(f"{self.source}: model index outside 0..{len(self.models) - 1}")
        if self.input_tokens.min() < 1 or self.output_tokens.min() < 1:
            raise TraceError(f"{self.source}: token counts must be >= 1 (use Workload.from_columns)")
        if self.duration_s < self.arrival_s[-1]:
            object.__setattr__(self, "duration_s", float(self.arrival_s[-1]))

    @classmethod
    def from_columns(
        cls,
        arrival_s: npt.ArrayLike,
        model_index: npt.ArrayLike,
        input_tokens: npt.ArrayLike,
        output_tokens: npt.ArrayLike,
        models: Sequence[str],
        source: str,
        duration_s: float = 0.0,
        num_skipped_rows: int = 0,
        notes: Sequence[str] = (),
        num_clamped_tokens: int = 0,
    ) -> Workload:
        """Sort rows by arrival (stable, so ties keep their order) and clamp zero token counts to 1."""
        arrivals = np.asarray(arrival_s, dtype=np.float64).reshape(-1)
        columns = [np.asarray(column).reshape(-1) for column in (model_index, input_tokens, output_tokens)]
        if any(column.size != arrivals.size for column in columns):
            raise TraceError(f"{source}: columns differ in length: {[arrivals.size] + [c.size for c in columns]}")
        order = np.argsort(arrivals, kind="stable")
        inputs = columns[1].astype(np.int64)[order]
        outputs = columns[2].astype(np.int64)[order]
        if inputs.size and (min(inputs.min(), outputs.min()) < 0 or max(inputs.max(), outputs.max()) > MAX_TOKENS):
            raise TraceError(f"{source}: token counts must lie in 0..{MAX_TOKENS}")
        num_clamped = int(np.count_nonzero(inputs < 1) + np.count_nonzero(outputs < 1))
        notes = tuple(notes)
        if num_clamped:
            notes += (f"{num_clamped} zero token counts raised to 1",)
        return cls(
            arrival_s=arrivals[order],
            model_index=columns[0][order],
            input_tokens=np.maximum(inputs, 1),
            output_tokens=np.maximum(outputs, 1),
            models=tuple(models),
            source=source,
            duration_s=float(duration_s),
            num_skipped_rows=num_skipped_rows,
            num_clamped_tokens=num_clamped_tokens + num_clamped,
            notes=notes,
        )

    # -- reading -----------------------------------------------------------

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    def model_counts(self) -> dict[str, int]:
        """Requests per model, every model listed (zero when it gets none)."""
        counts = np.bincount(self.model_index, minlength=len(self.models))
        return {name: int(count) for name, count in zip(self.models, counts)}

    def model_rates(self) -> dict[str, float]:
        """Mean arrival rate per model over `duration_s` (requests per second)."""
        return {name: _rate(count, self.duration_s) for name, count in self.model_counts().items()}

    @property
    def rate_per_s(self) -> float:
        """Mean arrival rate of all requests over `duration_s`."""
        return _rate(len(self), self.duration_s)

    def requests(self) -> Iterator[TraceRequest]:
        """The rows as `TraceRequest` values, in arrival order."""
        models = self.models
        columns = zip(self.arrival_s.tolist(), self.model_index.tolist(),
                      self.input_tokens.tolist(), self.output_tokens.tolist())
        for row, (arrival_at, index, num_in, num_out) in enumerate(columns):
            yield TraceRequest(request_id(row), arrival_at, models[index], num_in, num_out)

    # -- transforms ----------------------------------------------------------

    def _take(self, rows: slice | np.ndarray, **changes: object) -> Workload:
        return replace(
            self,
            arrival_s=self.arrival_s[rows],
            model_index=self.model_index[rows],
            input_tokens=self.input_tokens[rows],
            output_tokens=self.output_tokens[rows],
            **changes,  # type: ignore[arg-type]
        )

    def head(self, num_requests: int) -> Workload:
        """The first `num_requests` requests; the window ends at the last one kept."""
        if num_requests < 0:
            raise TraceError(f"head: num_requests must be >= 0, got {num_requests}")
        if num_requests >= len(self):
            return self
        end_s = float(self.arrival_s[num_requests - 1]) if num_requests else 0.0
        return self._take(slice(0, num_requests), duration_s=end_s)

    def time_slice(self, start_s: float, end_s: float | None = None) -> Workload:
        """Requests with start_s <= arrival < end_s (to the end when None), re-based so start_s becomes 0."""
        if not (np.isfinite(start_s) and start_s >= 0) or (end_s is not None and not end_s > start_s):
            raise TraceError(f"time_slice: need 0 <= start_s < end_s, got start_s={start_s}, end_s={end_s}")
        first = int(np.searchsorted(self.arrival_s, start_s, side="left"))
        stop = len(self) if end_s is None else int(np.searchsorted(self.arrival_s, end_s, side="left"))
        window_end_s = self.duration_s if end_s is None else min(end_s, self.duration_s)
        kept = self._take(slice(first, stop), duration_s=0.0)
        return replace(kept, arrival_s=kept.arrival_s - start_s, duration_s=max(window_end_s - start_s, 0.0))

    def scale_rate(self, factor: float) -> Workload:
        """Compress (factor > 1) or stretch (factor < 1) time: factor 2 doubles every rate."""
        if not (np.isfinite(factor) and factor > 0):
            raise TraceError(f"scale_rate: factor must be a positive number, got {factor}")
        return replace(self, arrival_s=self.arrival_s / factor, duration_s=self.duration_s / factor)

    def map_models(self, names: Sequence[str], weights: Weights | None = None, seed: int = 0) -> Workload:
        """Give each request a model drawn from `names` with probability proportional to `weights`.

        Meant for single-model traces: the arrival process is kept and thinned
        at random into per-model processes. Uniform when `weights` is None.
        """
        probabilities = _probabilities(names, weights)
        rng = np.random.default_rng([seed, 0x6D6170])  # own stream: independent of the trace's
        index = rng.choice(len(names), size=len(self), p=probabilities).astype(np.int32)
        source = f"{len(self)} requests of {self.models[0]!r}" if len(self.models) == 1 else f"{len(self)} requests"
        drawn = np.bincount(index, minlength=len(names))
        note = (f"{source} mapped at random onto {len(names)} models (requests each): "
                f"{_listed([f'{name} ({count})' for name, count in zip(names, drawn)])}")
        return replace(self, model_index=index, models=tuple(names), notes=self.notes + (note,))

    def fold_models(self, names: Sequence[str]) -> Workload:
        """Map each of this workload's models onto one of `names`, keeping per-model arrival processes.

        Models are ranked by request count and dealt round-robin, so the
        busiest goes to names[0], the next to names[1], and so on (AlpaServe
        maps functions to models the same way). With fewer trace models than
        names, some names get no requests.
        """
        if not names:
            raise TraceError("fold_models: need at least one model name")
        counts = np.bincount(self.model_index, minlength=len(self.models))
        rank = np.empty(len(self.models), dtype=np.int64)
        rank[np.argsort(-counts, kind="stable")] = np.arange(len(self.models))
        target = (rank % len(names)).astype(np.int32)
        pairs = [f"{self.models[k]} ({counts[k]}) -> {names[target[k]]}" for k in np.argsort(-counts, kind="stable")]
        note = (f"{len(self.models)} trace models dealt round-robin by popularity onto {len(names)} models "
                f"(requests of each trace model): "
                f"{_listed(pairs)}")
        return replace(self, model_index=target[self.model_index], models=tuple(names), notes=self.notes + (note,))

    def merge(self, others: Sequence[Workload]) -> Workload:
        """One workload with every request of self and `others`, models united by name."""
        parts = [self, *others]
        names: dict[str, int] = {}
        for part in parts:
            for name in part.models:
                names.setdefault(name, len(names))
        remapped = [np.array([names[n] for n in part.models], dtype=np.int32)[part.model_index]
                    if part.models else part.model_index for part in parts]
        return Workload.from_columns(
            np.concatenate([part.arrival_s for part in parts]),
            np.concatenate(remapped),
            np.concatenate([part.input_tokens for part in parts]),
            np.concatenate([part.output_tokens for part in parts]),
            models=tuple(names),
            source=" + ".join(part.source for part in parts),
            duration_s=max(part.duration_s for part in parts),
            num_skipped_rows=sum(part.num_skipped_rows for part in parts),
            notes=tuple(dict.fromkeys(note for part in parts for note in part.notes)),
            num_clamped_tokens=sum(part.num_clamped_tokens for part in parts),
        )

    # -- writing (the generic format that sims.traces reads back) -------------

    def to_csv(self, path: Path | str) -> None:
        """Write `timestamp_s,model,input_tokens,output_tokens` with a header row."""
        with open(path, "w", newline="", encoding="utf-8") as out:
            writer = csv.writer(out)
            writer.writerow(GENERIC_COLUMNS)
            writer.writerows((repr(r.arrival_at), r.model, r.input_tokens, r.output_tokens) for r in self.requests())

    def to_jsonl(self, path: Path | str) -> None:
        """Write one JSON object a line with the generic columns."""
        with open(path, "w", encoding="utf-8") as out:
            for r in self.requests():
                row = dict(zip(GENERIC_COLUMNS, (r.arrival_at, r.model, r.input_tokens, r.output_tokens)))
                out.write(json.dumps(row) + "\n")


def _listed(items: Sequence[str], limit: int = 8) -> str:
    """Up to `limit` items, comma-separated, and how many more (a note stays one readable line)."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _rate(count: int, duration_s: float) -> float:
    if count == 0:
        return 0.0
    return count / duration_s if duration_s > 0 else float("inf")


def _probabilities(names: Sequence[str], weights: Weights | None) -> np.ndarray:
    if not names:
        raise TraceError("need at least one model name")
    if weights is None:
        return np.full(len(names), 1.0 / len(names))
    if isinstance(weights, Mapping):
        missing = [name for name in names if name not in weights]
        if missing:
            raise TraceError(f"no weight given for models {missing}")
        weights = [weights[name] for name in names]
    values = np.asarray(weights, dtype=np.float64)
    if values.shape != (len(names),) or not np.all(np.isfinite(values)) or values.min() < 0 or values.sum() <= 0:
        raise TraceError(f"weights must be {len(names)} non-negative numbers, not all zero; got {list(values)}")
    return values / values.sum()
