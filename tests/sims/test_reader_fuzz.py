"""Fuzzing every trace reader: a Workload, or a `TraceError` that names the file and line (or the spec option).

Each reader gets files of its own format whose header may lose or gain
columns and whose cells are plausible values mixed with garbage (wrong
types, NaN, huge numbers, bad timestamps, quotes, NUL, undecodable bytes),
read with and without `skip_bad_rows`; JSON-lines readers get odd JSON
values and broken lines; the ServeGen reader gets small model folders with
bad trace rows and bad length PDFs. `load_workload` reads each file through
`file:PATH` with random options, and `parse_spec` gets random spec text.
Any other exception, or a TraceError that places nothing, fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sims.servegen import read_servegen
from sims.synthetic import LengthDistribution
from sims.trace_readers import (read_alibaba_genai, read_azure_functions, read_azure_llm, read_generic,
                                read_length_pairs, read_mooncake, read_vidur)
from sims.traces import load_workload, parse_spec
from sims.workload import TraceError, Workload

EXAMPLES = int(os.environ.get("MODELPOOL_FUZZ_EXAMPLES", "150"))  # per fuzzer; more for the long run
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FIXED = LengthDistribution.fixed(100, 10)
NUM_CASES: dict[str, int] = {}
OUTCOMES: dict[str, set[str]] = {}  # reader -> {"read", "refused"}: a fuzzer that only ever sees one is blind


def placed(message: str, place: Path) -> bool:
    """A clear error: names the file (a cell with its line), the spec or option, or the request budget."""
    if "column '" in message and not re.search(r":\d+: column '", message):
        return False
    return (str(place) in message or message.startswith("trace spec ") or "max_requests" in message
            or message.startswith("trace file not found: ")  # lengths=file:PATH names its own file
            or re.match(r"[a-z_]+=", message) is not None)  # an option's value: `lengths='fixed:a': ...`


def check(name: str, read: Callable[[], object], place: Path) -> object | None:
    NUM_CASES[name] = NUM_CASES.get(name, 0) + 1
    try:
        result = read()
    except TraceError as error:
        assert placed(str(error), place), f"unplaced error: {error}"
        OUTCOMES.setdefault(name, set()).add("refused")
        return None
    OUTCOMES.setdefault(name, set()).add("read")
    if isinstance(result, Workload):  # accepted: then it is a sane workload
        assert np.all(np.diff(result.arrival_s) >= 0) and np.all(np.isfinite(result.arrival_s))
        assert result.input_tokens.min(initial=1) >= 1 and result.output_tokens.min(initial=1) >= 1
        assert result.model_index.max(initial=-1) < len(result.models)
    return result


# ---- cells -------------------------------------------------------------------------------------------
garbage = st.one_of(st.text(max_size=6), st.integers(-5, 10**20).map(str), st.floats().map(repr),
                    st.sampled_from(["", " ", "nan", "inf", "-inf", "-0", "1e400", "0x10", "1_000", '"', '""', "\x00",
                                     "a,b", "\n", "\r", "\ufffd", "2023-02-30 10:00:00", "2023-11-16T18:15:46.5",
                                     "9999-12-31 23:59:59", "0001-01-01 00:00:00", "Gamma", "Weibull", "None"]))
KINDS = {
    "int": st.integers(0, 5000).map(str),
    "float": st.floats(0, 1e6, allow_nan=False).map(lambda v: f"{v:.3f}"),
    "ts": st.builds(lambda s, f: f"2023-11-16 18:{s // 60:02d}:{s % 60:02d}.{f}", st.integers(0, 3599),
                    st.integers(0, 9999999)),
    "name": st.sampled_from(["a", "b", "model-x", "2b7b3c5d9e", " spaced "]),
}


def csv_text(draw: st.DrawFn, columns: dict[str, str]) -> str:
    """A CSV with (mostly) the reader's header and rows of plausible or garbage cells."""
    names = list(columns)
    if draw(st.booleans()):
        names = draw(st.permutations(names))
    if draw(st.integers(0, 9)) == 0:
        names = names[:-1]  # a missing column
    if draw(st.integers(0, 4)) == 0:
        names.append(draw(st.sampled_from(["extra", "model", "", "timestamp_s"])))
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        cells = [draw(st.one_of(KINDS[columns.get(name, "name")], garbage) if draw(st.integers(0, 3)) == 0
                      else KINDS[columns.get(name, "name")]) for name in names]
        if draw(st.integers(0, 7)) == 0:
            cells = cells[:draw(st.integers(0, len(cells)))]  # a short row
        rows.append(",".join(cells))
    return "\n".join([",".join(names), *rows]) + draw(st.sampled_from(["", "\n", "\r\n", "\n\n"]))


def to_bytes(draw: st.DrawFn, text: str) -> bytes:
    data = text.encode("utf-8", errors="surrogatepass")
    if data and draw(st.integers(0, 5)) == 0:  # undecodable bytes somewhere
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b"\x00", b"\xef\xbb\xbf"])) + data[at:]
    return data


@st.composite
def csv_file(draw: st.DrawFn, columns: dict[str, str]) -> bytes:
    return to_bytes(draw, csv_text(draw, columns))


json_value = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**19) | st.floats() | st.text(max_size=4),
                          lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=2), inner,
                                                                                       max_size=2), max_leaves=4)


@st.composite
def jsonl_file(draw: st.DrawFn, columns: dict[str, str]) -> bytes:
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        record = {}
        for name, kind in columns.items():
            if draw(st.integers(0, 9)) == 0:
                continue  # a missing key
            plausible = KINDS[kind].map(lambda v, kind=kind: float(v) if kind in ("int", "float") else v)
            record[name] = draw(st.one_of(plausible, json_value) if draw(st.integers(0, 3)) == 0 else plausible)
        line = json.dumps(record)
        if draw(st.integers(0, 9)) == 0:
            line = draw(st.sampled_from([line[:-1], "[1, 2]", "null", "{", line + "}", "", "   "]))
        lines.append(line)
    return to_bytes(draw, "\n".join(lines))


def write(data: bytes, name: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="fuzz-", dir=ROOT))
    path = folder / name
    path.write_bytes(data)
    return path


ROOT = Path(tempfile.mkdtemp(prefix="modelpool-reader-fuzz-"))  # hypothesis runs many cases per test: one folder


@pytest.fixture(scope="module", autouse=True)
def _remove_fuzz_files():
    yield
    shutil.rmtree(ROOT, ignore_errors=True)

# ---- one fuzzer per reader -----------------------------------------------------------------------------
AZURE = {"TIMESTAMP": "ts", "ContextTokens": "int", "GeneratedTokens": "int"}
VIDUR = {"arrived_at": "float", "num_prefill_tokens": "int", "num_decode_tokens": "int"}
LENGTHS = {"num_prefill_tokens": "int", "num_decode_tokens": "int"}
ALIBABA = {"gmt_create": "ts", "checkpoint_model_version_id": "name"}
FUNCTIONS = {"HashFunction": "name", "minute_1": "int", "minute_2": "int", "minute_3": "int"}
GENERIC = {"timestamp_s": "float", "model": "name", "input_tokens": "int", "output_tokens": "int"}
MOONCAKE = {"timestamp": "float", "input_length": "int", "output_length": "int"}

CSV_READERS: dict[str, tuple[dict[str, str], Callable[[Path, bool], object]]] = {
    "azure-llm": (AZURE, lambda path, skip: read_azure_llm([path], skip)),
    "vidur": (VIDUR, lambda path, skip: read_vidur(path, skip_bad_rows=skip)),
    "length-pairs": (LENGTHS, lambda path, skip: read_length_pairs(path, skip)),
    "alibaba-genai": (ALIBABA, lambda path, skip: read_alibaba_genai(path, FIXED, 0, skip)),
    "azure-functions": (FUNCTIONS, lambda path, skip: read_azure_functions(path, FIXED, 0, max_requests=10_000,
                                                                          skip_bad_rows=skip)),
    "generic-csv": (GENERIC, lambda path, skip: read_generic(path, skip)),
}


@pytest.mark.parametrize("reader", list(CSV_READERS))
def test_csv_readers_only_raise_placed_trace_errors(reader: str) -> None:
    columns, read = CSV_READERS[reader]

    @FUZZ
    @given(data=csv_file(columns), skip=st.booleans())
    def fuzz(data: bytes, skip: bool) -> None:
        path = write(data, "trace.csv")
        check(reader, lambda: read(path, skip), path)

    fuzz()


JSONL_READERS: dict[str, tuple[dict[str, str], Callable[[Path, bool], object]]] = {
    "mooncake": (MOONCAKE, lambda path, skip: read_mooncake(path, skip_bad_rows=skip)),
    "generic-jsonl": (GENERIC, lambda path, skip: read_generic(path, skip)),
}


@pytest.mark.parametrize("reader", list(JSONL_READERS))
def test_jsonl_readers_only_raise_placed_trace_errors(reader: str) -> None:
    columns, read = JSONL_READERS[reader]

    @FUZZ
    @given(data=jsonl_file(columns), skip=st.booleans())
    def fuzz(data: bytes, skip: bool) -> None:
        path = write(data, "trace.jsonl")
        check(reader, lambda: read(path, skip), path)

    fuzz()


# ---- ServeGen model folders --------------------------------------------------------------------------
trace_row = st.tuples(st.sampled_from([0, 600, 1200, 3000]).map(str), st.floats(0, 5).map(lambda v: f"{v:.2f}"),
                      st.floats(0, 3).map(lambda v: f"{v:.2f}"), st.sampled_from(["Gamma", "Weibull", ""]),
                      st.floats(0, 3).map(lambda v: f"{v:.2f}"), st.floats(0, 3).map(lambda v: f"{v:.2f}"))
pdf_text = st.one_of(st.just("{10: 0.5, 20: 0.5}"), st.just("{3: 1.0}"), st.just("{}"),
                     st.sampled_from(["{1: -1}", "{1: nan}", "{1:}", "{1 2}", "[1]", "{1e400: 1}", "{a: 1}",
                                      "{1: 0}", "{100000000000: 1.0}", "{0.5: 1}"]),
                     st.text(max_size=8))
window_doc = st.one_of(st.fixed_dictionaries({"input_tokens": pdf_text, "output_tokens": pdf_text},
                                             optional={"text_tokens": pdf_text, "image_count": pdf_text}), json_value)


@st.composite
def servegen_folder(draw: st.DrawFn) -> dict[str, bytes]:
    files = {}
    for client in range(draw(st.integers(1, 2))):
        rows = [",".join(draw(st.one_of(trace_row, st.lists(garbage, max_size=7).map(tuple))
                              if draw(st.integers(0, 3)) == 0 else trace_row)) for _ in range(draw(st.integers(0, 4)))]
        files[f"chunk-{client}-trace.csv"] = to_bytes(draw, "\n".join(rows))
        if draw(st.booleans()):
            doc = draw(st.one_of(st.dictionaries(st.sampled_from(["0", "21600", "x", "-1"]), window_doc, max_size=2),
                                 json_value))
            files[f"chunk-{client}-dataset.json"] = to_bytes(draw, json.dumps(doc))
    return files


@FUZZ
@given(files=servegen_folder(), skip=st.booleans(), by_client=st.booleans())
def test_servegen_reader_only_raises_placed_trace_errors(files: dict[str, bytes], skip: bool, by_client: bool) -> None:
    folder = Path(tempfile.mkdtemp(prefix="fuzz-", dir=ROOT)) / "m-tiny"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    check("servegen", lambda: read_servegen([folder], seed=0, duration_s=1800, by_client=by_client,
                                            max_requests=50_000, skip_bad_rows=skip), folder)


# ---- load_workload: file specs with random options, and random spec text ----------------------------------
option = st.one_of(
    st.tuples(st.sampled_from(["start", "duration", "scale", "max_requests", "clients", "functions"]),
              st.one_of(st.sampled_from(["0", "1", "10", "0.5", "-1", "nan", "inf", "1e400", "x", ""]),
                        st.floats(0, 1e4, allow_nan=False).map(repr))),
    st.tuples(st.sampled_from(["models", "popularity", "lengths", "by", "bogus"]),
              st.sampled_from(["1", "3", "0", "-2", "uniform", "zipf:1.2", "zipf:x", "fixed:10:5", "fixed:0:0",
                               "fixed:a", "sharegpt", "client", "model", "file:/nonexistent", "x"])))
any_file = st.one_of(*(csv_file(columns).map(lambda d: (d, "trace.csv")) for columns, _ in CSV_READERS.values()),
                     *(jsonl_file(columns).map(lambda d: (d, "trace.jsonl")) for columns, _ in JSONL_READERS.values()))


@FUZZ
@given(file=any_file, options=st.lists(option, max_size=3), skip=st.booleans(),
       models=st.sampled_from([None, ("a",), ("a", "b", "c")]))
def test_file_specs_only_raise_placed_trace_errors(file: tuple[bytes, str], options: list[tuple[str, str]],
                                                  skip: bool, models: tuple[str, ...] | None) -> None:
    path = write(*file)
    spec = f"file:{path}" + "".join(f";{key}={value}" for key, value in options)
    check("load_workload file:", lambda: load_workload(spec, models=models, skip_bad_rows=skip), path)


@FUZZ
@given(text=st.lists(st.one_of(st.sampled_from(["poisson", "gamma", "zipf", "file", "servegen", ":", ";", ",", "=",
                                                "rate", "cv", "duration", "total_rate", "models", "2", "0.5", "-1",
                                                "nan", " "]), st.text(max_size=4)), max_size=12).map("".join))
def test_spec_text_only_raises_trace_error(text: str) -> None:
    NUM_CASES["spec text"] = NUM_CASES.get("spec text", 0) + 1
    try:
        spec = parse_spec(text)
    except TraceError as error:
        assert str(error).startswith("trace spec "), error
        return
    if spec.name in ("poisson", "gamma", "zipf"):  # generated: bounded by a small budget
        budgeted = text if "max_requests" in spec.options else f"{text};max_requests=20000"
        try:
            load_workload(budgeted, models=("a", "b"))
        except TraceError as error:
            assert placed(str(error), Path("<none>")) or "rate" in str(error), error


def test_cases_were_tried() -> None:
    """The counts BENCHMARKS.md reports (run after the fuzzers: pytest keeps file order)."""
    print(f"trace reader fuzz cases: {NUM_CASES}")
    assert not NUM_CASES or min(NUM_CASES.values()) >= min(50, EXAMPLES)
    assert all(seen == {"read", "refused"} for seen in OUTCOMES.values()), OUTCOMES
