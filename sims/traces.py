"""Trace specs and `load_workload`, the one entry point from a spec string to a `Workload`.

Grammar: `NAME[:ARGUMENT][;KEY=VALUE]...`. Options may also follow the name
or argument after commas (`poisson:rate=0.1,cv=4`); `file:PATH` takes
everything up to the first ';' as the path, and so does a bare `PATH` that
is no name below (an existing file or folder, or one with a '/' or a
.csv/.jsonl/.json/.ndjson/.gz suffix). `modelpool traces` lists where each
named trace comes from and fetches it. Names:

| spec | what |
|---|---|
| azure-conv, azure-code, azure-llm | Azure LLM 2023 (one service each; azure-llm = both, two models) |
| vidur-conv, vidur-code | Vidur's re-based copies of the same Azure data |
| mooncake, mooncake-synthetic | Mooncake conversation / synthetic JSONL |
| servegen:CAT/MODEL[,MODEL...] | ServeGen client models, e.g. servegen:language/m-large,m-mid (options clients, by) |
| azure-functions | Azure Functions 2019 sample, one model per function (option functions) |
| alibaba-genai | Alibaba GenAI 2026 (Stable Diffusion): arrivals + base-model ids, lengths from `lengths` |
| PATH, file:PATH | generic CSV/JSONL (gzipped too), any of the formats above (detected by header), or a ServeGen model folder |
| poisson;rate=R | Poisson arrivals, R req/s per model, or R1:R2:... one per model |
| gamma;rate=R,cv=C | Gamma renewal arrivals with inter-arrival CV C |
| zipf;total_rate=R,s=S | Zipf popularity across models (first model busiest), Poisson or cv=C |

Options: `start`, `duration` (seconds, on the source's clock; generated
sources default to duration=3600), `scale` (rate factor, applied after
the window: 2 = twice the rate), `models=N` (map onto the first N given
models, or model-0..N-1), `popularity=uniform|zipf:S` (how a single-model
trace is split), `lengths=sharegpt|arxiv|azure-conv|azure-code|mooncake|
fixed:IN:OUT|file:PATH` (for sources without token counts and synthetic
ones), `max_requests` (guard for generated sources, default 10M), and
`clients` / `by=model|client` (ServeGen), `functions=N` (Azure Functions),
`map=fold` (a generic file: deal its models onto the given ones; without it
its names must be the given ones).

Given models, a trace whose models are all among them is kept as it is; else
a single-model trace is split at random among them (uniform or by
`popularity`), and a multi-model trace has its models dealt round-robin by
popularity onto them (`Workload.fold_models`). The public traces carry no
names of a fleet and are always mapped so. A generic file (the user's own,
with model names) is mapped only under `map=fold`: without it, a name that
is not one of the given models is refused row by row (file, line, the name,
the closest given name), and a file naming none of them as a whole, since a
misspelt name would otherwise send every request to the wrong model. Each
mapping is written to `Workload.notes`, which the commands print.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sims.servegen import client_ids, read_servegen
from sims.synthetic import (
    DEFAULT_MAX_REQUESTS,
    LengthDistribution,
    check_request_budget,
    synthetic_workload,
    zipf_weights,
    zipf_workload,
)
from sims.trace_readers import (
    is_jsonl,
    open_text,
    read_alibaba_genai,
    read_azure_functions,
    read_azure_llm,
    read_generic,
    read_length_pairs,
    read_mooncake,
    read_vidur,
)
from sims.trace_store import CATALOGUE, SHIPPED, locate, search_dirs
from sims.workload import GENERIC_COLUMNS, TraceError, Workload

# -- format detection ---------------------------------------------------------------


def detect_format(path: Path) -> str:
    """Which reader understands `path`: a key of FORMAT_OPTIONS, or "lengths" for a length-only CSV."""
    if path.is_dir():
        if client_ids(path, "trace.csv"):
            return "servegen"
        raise TraceError(f"{path}: a folder, but not a ServeGen model folder (no chunk-<i>-trace.csv)")
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    jsonl = is_jsonl(path)
    try:
        with open_text(path) as file:
            if jsonl:
                line = next((line for line in file if line.strip()), "{}")
            else:
                header = {name.strip() for name in next(csv.reader(file), [])}
    except csv.Error as error:
        raise TraceError(f"{path}:1: column '(row)': unreadable CSV header: {error}") from None
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise TraceError(f"cannot read trace file {path}: {error}") from None
    if jsonl:
        try:
            first = json.loads(line)
        except ValueError:
            return "generic"  # its reader reports the bad line
        mooncake = isinstance(first, dict) and {"timestamp", "input_length", "output_length"} <= first.keys()
        return "mooncake" if mooncake else "generic"
    for fmt, columns in (("azure-llm", {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}),
                         ("vidur", {"arrived_at", "num_prefill_tokens", "num_decode_tokens"}),
                         ("alibaba-genai", {"gmt_create", "checkpoint_model_version_id"}),
                         ("azure-functions", {"HashFunction", "minute_1"}),
                         ("generic", set(GENERIC_COLUMNS)),
                         ("lengths", {"num_prefill_tokens", "num_decode_tokens"})):
        if columns <= header:
            return fmt
    raise TraceError(f"{path}:1: unknown trace format; header {sorted(header)[:8]} matches none of Azure LLM 2023, "
                     f"Vidur, Alibaba GenAI, Azure Functions or the generic {','.join(GENERIC_COLUMNS)}")


# -- trace specs: the one entry point ------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """A parsed spec: `name[:argument][;key=value...]` (see `load_workload`)."""

    name: str
    argument: str  # ServeGen model list or file path; "" when none
    options: Mapping[str, str]
    text: str


def parse_spec(text: str) -> TraceSpec:
    """Split a spec into name, argument and options; `file:PATH` takes everything up to the first ';' as PATH."""
    head, *tail = [part.strip() for part in text.strip().split(";")]
    colon, comma = head.find(":"), head.find(",")
    if colon >= 0 and (comma < 0 or colon < comma):
        name, rest = head[:colon], head[colon + 1:]
    else:
        name, rest = (head[:comma], head[comma + 1:]) if comma >= 0 else (head, "")
    name = name.strip().lower()
    if not name:
        raise TraceError(f"trace spec {text!r}: empty trace name (try one of {', '.join(sorted(SOURCES))})")
    items = [] if name == "file" else [item.strip() for item in rest.split(",") if item.strip()]
    argument = rest.strip() if name == "file" else ",".join(item for item in items if "=" not in item)
    options: dict[str, str] = {}
    for item in [item for item in items if "=" in item] + [i.strip() for part in tail for i in part.split(",")]:
        if not item:
            continue
        key, equals, value = item.partition("=")
        key = key.strip().lower()
        if not equals or not key or not value.strip():
            raise TraceError(f"trace spec {text!r}: expected key=value, got {item!r}")
        if key in options:
            raise TraceError(f"trace spec {text!r}: option {key!r} given twice")
        options[key] = value.strip()
    return TraceSpec(name, argument, options, text.strip())


@dataclass(frozen=True, slots=True)
class _Context:
    spec: TraceSpec
    models: tuple[str, ...] | None
    seed: int
    root: Path | None
    skip_bad_rows: bool

    def number(self, key: str, default: float | None = None, positive: bool = False) -> float:
        raw = self.spec.options.get(key)
        if raw is None:
            if default is None:
                raise TraceError(f"trace spec {self.spec.text!r}: option {key}= is required")
            return default
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not np.isfinite(value) or value < 0 or (positive and value == 0):
            kind = "positive" if positive else "non-negative"
            raise TraceError(f"trace spec {self.spec.text!r}: {key}={raw!r} must be a {kind} number")
        return value

    def path(self, relative: str) -> Path:
        return locate(relative, self.root)

    def window(self) -> tuple[float, float | None]:
        start_s = self.number("start", 0.0)
        return start_s, (start_s + self.number("duration", positive=True) if "duration" in self.spec.options else None)

    def max_requests(self) -> int:
        return int(self.number("max_requests", DEFAULT_MAX_REQUESTS, positive=True))

    def lengths(self) -> LengthDistribution:
        return _lengths(self.spec.options.get("lengths", "sharegpt"), self)

    def targets(self) -> tuple[str, ...]:
        if self.models is None:
            raise TraceError(f"trace spec {self.spec.text!r}: synthetic traces need models (pass models or models=N)")
        return self.models


def _length_pairs(name: str, context: _Context) -> LengthDistribution:
    trace = CATALOGUE[name]
    if trace.shipped:  # the same pairs in the same order as the upstream file: the same draws
        return replace(read_length_pairs(SHIPPED / trace.shipped), name=name)
    return read_length_pairs(context.path(trace.paths[0]))


def _lengths(choice: str, context: _Context) -> LengthDistribution:
    """sharegpt | arxiv | azure-conv | azure-code | mooncake | fixed:IN:OUT | file:PATH (lengths CSV or any trace)."""
    if choice in ("sharegpt", "arxiv"):
        return _length_pairs(choice, context)
    if choice.startswith("fixed:"):
        try:
            num_in, num_out = (int(part) for part in choice.split(":")[1:])
            if min(num_in, num_out) < 1:
                raise ValueError
        except ValueError:
            raise TraceError(f"lengths={choice!r}: expected fixed:INPUT:OUTPUT with integers >= 1") from None
        return LengthDistribution.fixed(num_in, num_out)
    if choice.startswith("file:"):
        path = Path(choice[5:]).expanduser()
        if detect_format(path) == "lengths":
            return read_length_pairs(path, context.skip_bad_rows)
        lengths_only = replace(context, spec=parse_spec("file:"), models=None)  # its model names do not matter here
        return LengthDistribution.of_workload(_read_file(path, lengths_only), choice)
    if choice in ("azure-conv", "azure-code", "mooncake"):
        return LengthDistribution.of_workload(SOURCES[choice].load(replace(context, spec=parse_spec(choice))), choice)
    raise TraceError(f"lengths={choice!r}: expected sharegpt, arxiv, azure-conv, azure-code, mooncake, "
                     f"fixed:IN:OUT or file:PATH")


# Options each detected file format takes on top of the common ones.
FORMAT_OPTIONS: dict[str, frozenset[str]] = {
    "azure-llm": frozenset(),
    "vidur": frozenset(),
    "mooncake": frozenset(),
    "generic": frozenset({"map"}),
    "alibaba-genai": frozenset({"lengths"}),
    "azure-functions": frozenset({"lengths", "functions", "max_requests"}),
    "servegen": frozenset({"clients", "by", "max_requests"}),
}


def _read_file(path: Path, context: _Context) -> Workload:
    fmt = detect_format(path)
    if fmt == "lengths":
        raise TraceError(f"{path}: a length distribution without timestamps; use it as lengths=file:{path}")
    unknown = sorted(set(context.spec.options) - _COMMON - FORMAT_OPTIONS[fmt])
    if unknown:
        raise TraceError(f"trace spec {context.spec.text!r}: option {unknown[0]!r} does not apply to a {fmt} file")
    skip = context.skip_bad_rows
    if fmt == "servegen":
        return _servegen_load(context, [path])
    if fmt == "azure-functions":
        return _functions_load(context, path)
    if fmt == "azure-llm":
        workload = read_azure_llm([path], skip)
    elif fmt == "vidur":
        workload = read_vidur(path, skip_bad_rows=skip)
    elif fmt == "mooncake":
        workload = read_mooncake(path, model=path.stem, skip_bad_rows=skip)
    elif fmt == "alibaba-genai":
        workload = read_alibaba_genai(path, context.lengths(), context.seed, skip)
    else:
        workload = read_generic(path, skip, _strict_names(context))
    return _window(workload, context)


def _strict_names(context: _Context) -> tuple[str, ...] | None:
    """The fleet's names a generic file must keep to, or None under `map=fold` (deal its models onto the fleet)."""
    choice = context.spec.options.get("map")
    if choice not in (None, "fold"):
        raise TraceError(f"trace spec {context.spec.text!r}: map={choice!r}: the one mapping is map=fold")
    return context.models if choice is None else None


def _window(workload: Workload, context: _Context) -> Workload:
    start_s, end_s = context.window()
    return workload.time_slice(start_s, end_s) if start_s > 0 or end_s is not None else workload


def _servegen_load(context: _Context, dirs: Sequence[Path]) -> Workload:
    by = context.spec.options.get("by", "model")
    if by not in ("model", "client"):
        raise TraceError(f"trace spec {context.spec.text!r}: by={by!r} must be model or client")
    start_s = context.number("start", 0.0)
    clients = context.number("clients", positive=True) if "clients" in context.spec.options else None
    return read_servegen(dirs, context.seed, start_s, context.number("duration", 3600.0, positive=True), clients,
                         by == "client", context.max_requests(), context.skip_bad_rows)


def _servegen_dirs(context: _Context) -> list[Path]:
    if not context.spec.argument:
        raise TraceError(f"trace spec {context.spec.text!r}: expected servegen:CATEGORY/MODEL[,MODEL...]")
    dirs, category = [], None
    for entry in context.spec.argument.split(","):
        if "/" in entry:
            category, entry = entry.split("/", 1)
        if category is None:
            found = sorted({path.relative_to(folder).as_posix() for folder in search_dirs(context.root)
                            for path in (folder / "servegen").glob(f"*/{entry}")})
            if len(found) != 1:
                known = ", ".join(name for name in CATALOGUE if name.startswith("servegen:"))
                raise TraceError(f"servegen model {entry!r}: found {len(found)} folders servegen/*/{entry} "
                                 f"(name its category; catalogued: {known})")
            dirs.append(context.path(found[0]))
        else:
            dirs.append(context.path(f"servegen/{category}/{entry}"))
    return dirs


def _functions_load(context: _Context, path: Path) -> Workload:
    start_s = context.number("start", 0.0)
    functions = int(context.number("functions", positive=True)) if "functions" in context.spec.options else None
    return read_azure_functions(path, context.lengths(), context.seed, start_s,
                                context.number("duration", 3600.0, positive=True), functions,
                                context.max_requests(), context.skip_bad_rows)


def _synthetic_load(context: _Context) -> Workload:
    models, name = context.targets(), context.spec.name
    duration_s = context.number("duration", 3600.0, positive=True)
    cv = context.number("cv", 1.0 if name != "gamma" else None, positive=True)
    if name == "zipf":
        total_rate = context.number("total_rate")
        check_request_budget(total_rate * duration_s, context.max_requests(), context.spec.text)
        return zipf_workload(models, total_rate, context.number("s", 1.0), duration_s,
                             context.lengths(), context.seed, cv=cv, source=context.spec.text)
    raw = context.spec.options.get("rate", "")
    try:
        rates = [float(part) for part in raw.split(":")] if raw else []
    except ValueError:
        rates = []
    if len(rates) not in (1, len(models)):
        raise TraceError(f"trace spec {context.spec.text!r}: rate={raw!r} must be one rate or {len(models)} "
                         "rates separated by ':' (requests per second per model)")
    rates = rates * len(models) if len(rates) == 1 else rates
    check_request_budget(sum(rates) * duration_s, context.max_requests(), context.spec.text)
    return synthetic_workload(models, rates, duration_s,
                              context.lengths(), context.seed, cv=cv, source=context.spec.text)


@dataclass(frozen=True, slots=True)
class _Source:
    load: Callable[[_Context], Workload]
    options: frozenset[str]
    windows_itself: bool = False  # applies start/duration while generating


_COMMON = frozenset({"start", "duration", "scale", "models", "popularity"})
_GENERATED = frozenset({"lengths", "max_requests"})


def _azure(*services: str) -> Callable[[_Context], Workload]:
    return lambda c: read_azure_llm([c.path(f"azure-llm-2023/AzureLLMInferenceTrace_{name}.csv") for name in services],
                                    c.skip_bad_rows)


SOURCES: dict[str, _Source] = {
    "azure-conv": _Source(_azure("conv"), _COMMON),
    "azure-code": _Source(_azure("code"), _COMMON),
    "azure-llm": _Source(_azure("conv", "code"), _COMMON),
    "vidur-conv": _Source(lambda c: read_vidur(c.path("vidur-processed-traces/splitwise_conv.csv"),
                                               skip_bad_rows=c.skip_bad_rows), _COMMON),
    "vidur-code": _Source(lambda c: read_vidur(c.path("vidur-processed-traces/splitwise_code.csv"),
                                               skip_bad_rows=c.skip_bad_rows), _COMMON),
    "mooncake": _Source(lambda c: read_mooncake(c.path("mooncake/conversation_trace.jsonl"),
                                                skip_bad_rows=c.skip_bad_rows), _COMMON),
    "mooncake-synthetic": _Source(lambda c: read_mooncake(c.path("mooncake/synthetic_trace.jsonl"),
                                                          "mooncake-synthetic", c.skip_bad_rows), _COMMON),
    "servegen": _Source(lambda c: _servegen_load(c, _servegen_dirs(c)),
                        _COMMON | {"clients", "by", "max_requests"}, windows_itself=True),
    "azure-functions": _Source(lambda c: _functions_load(c, c.path("azure-functions-2019-invitro-sample/1000_inv.csv")),
                               _COMMON | _GENERATED | {"functions"}, windows_itself=True),
    "alibaba-genai": _Source(lambda c: read_alibaba_genai(c.path("alibaba-genai-2026/lora_request_trace.csv"),
                                                          c.lengths(), c.seed, c.skip_bad_rows), _COMMON | {"lengths"}),
    "file": _Source(lambda c: _read_file(Path(c.spec.argument).expanduser(), c),
                    _COMMON.union(*FORMAT_OPTIONS.values()), windows_itself=True),
    "poisson": _Source(_synthetic_load, _COMMON | _GENERATED | {"rate"}, windows_itself=True),
    "gamma": _Source(_synthetic_load, _COMMON | _GENERATED | {"rate", "cv"}, windows_itself=True),
    "zipf": _Source(_synthetic_load, _COMMON | _GENERATED | {"total_rate", "s", "cv"}, windows_itself=True),
}


def load_workload(
    spec: str,
    models: Sequence[str] | None = None,
    seed: int = 0,
    traces_dir: Path | None = None,
    skip_bad_rows: bool = False,
) -> Workload:
    """Read or generate the workload a spec names (grammar in the module docstring), mapped onto `models`.

    Trace files are looked up in `traces_dir` alone when given, else in the
    user cache and then $MODELPOOL_TRACES or ../shared/traces
    (`sims.trace_store.search_dirs`). The same spec, models and seed always
    give the same workload.
    """
    parsed = parse_spec(_file_spec(spec))
    source = SOURCES.get(parsed.name)
    if source is None:
        raise TraceError(f"trace spec {spec!r}: unknown trace {parsed.name!r}; known: {', '.join(SOURCES)}, "
                         "or a path to a CSV/JSONL file")
    unknown = sorted(set(parsed.options) - source.options)
    if unknown:
        raise TraceError(f"trace spec {spec!r}: unknown option {unknown[0]!r} for {parsed.name}; "
                         f"allowed: {', '.join(sorted(source.options))}")
    if parsed.argument and parsed.name not in ("servegen", "file"):
        raise TraceError(f"trace spec {spec!r}: {parsed.name} takes no ':{parsed.argument}' argument")
    if parsed.name == "file" and not parsed.argument:
        raise TraceError(f"trace spec {spec!r}: expected file:PATH")
    context = _Context(parsed, _targets(parsed, models), seed, traces_dir, skip_bad_rows)
    workload = source.load(context)
    if not source.windows_itself:
        workload = _window(workload, context)
    if "scale" in parsed.options:
        workload = workload.scale_rate(context.number("scale", positive=True))
    if context.models is not None:
        workload = _map_onto(workload, context)
    elif "popularity" in parsed.options:
        raise TraceError(f"trace spec {spec!r}: popularity= needs models to split the trace among")
    if len(workload) == 0:
        raise TraceError(f"trace spec {spec!r}: selects no requests")
    return replace(workload, source=parsed.text)


_TRACE_SUFFIXES = (".csv", ".jsonl", ".json", ".ndjson", ".gz")


def _file_spec(spec: str) -> str:
    """`PATH[;options]` as `file:PATH[;options]` when PATH is no trace name and names a file or folder, or looks
    like a path (a '/' or a trace file's suffix): a missing file is then reported as such. Names win over paths."""
    head = spec.strip().split(";")[0].strip()
    name = head.split(":")[0].split(",")[0].strip().lower()
    if name in SOURCES or not head:
        return spec
    path = Path(head).expanduser()
    return f"file:{spec.strip()}" if path.exists() or "/" in head or path.suffix.lower() in _TRACE_SUFFIXES else spec


def _targets(spec: TraceSpec, models: Sequence[str] | None) -> tuple[str, ...] | None:
    if "models" not in spec.options:
        return tuple(models) if models else None
    raw = spec.options["models"]
    if not raw.isdigit() or int(raw) < 1:
        raise TraceError(f"trace spec {spec.text!r}: models={raw!r} must be a positive integer")
    count = int(raw)
    if models is None:
        return tuple(f"model-{i:0{len(str(count - 1))}d}" for i in range(count))
    if count > len(models):
        raise TraceError(f"trace spec {spec.text!r}: models={count} but only {len(models)} models given")
    return tuple(models[:count])


def _map_onto(workload: Workload, context: _Context) -> Workload:
    targets = context.targets()
    popularity = context.spec.options.get("popularity")
    if set(workload.models) <= set(targets) and popularity is None:  # already names the given models
        position = np.array([targets.index(name) for name in workload.models], dtype=np.int32)
        return replace(workload, model_index=position[workload.model_index], models=targets)
    if len(workload.models) == 1:
        return workload.map_models(targets, _popularity(popularity, len(targets), context), context.seed)
    if popularity is not None:
        raise TraceError(f"trace spec {context.spec.text!r}: popularity= only splits single-model traces; "
                         f"this one has {len(workload.models)} models")
    return workload.fold_models(targets)


def _popularity(choice: str | None, num_models: int, context: _Context) -> np.ndarray | None:
    if choice is None or choice == "uniform":
        return None
    if choice.startswith("zipf:"):
        try:
            return zipf_weights(num_models, float(choice[5:]))
        except ValueError:
            pass
    raise TraceError(f"trace spec {context.spec.text!r}: popularity={choice!r} must be uniform or zipf:EXPONENT")
