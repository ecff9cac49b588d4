"""Workloads, trace readers, generators and specs: real traces against SOURCE.md, errors, statistics."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sims.servegen import read_servegen
from sims.synthetic import (
    LengthDistribution,
    gamma_arrivals,
    poisson_arrivals,
    synthetic_workload,
    windowed_arrivals,
    zipf_weights,
    zipf_workload,
)
from sims.trace_readers import read_alibaba_genai, read_azure_llm, read_generic, read_length_pairs, read_mooncake
from sims.traces import load_workload, parse_spec
from sims.workload import TraceError, Workload

REPO = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("MODELPOOL_TRACES", REPO / "../shared/traces")).resolve()
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"production traces not found at {TRACES} "
                                  "(set MODELPOOL_TRACES to the shared/traces folder)")
FIXED = LengthDistribution.fixed(100, 10)


def make_workload(arrivals: list[float], models: tuple[str, ...] = ("a",), index: list[int] | None = None) -> Workload:
    num = len(arrivals)
    return Workload.from_columns(arrivals, index or [0] * num, range(1, num + 1), [7] * num, models, "test")


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# -- real traces against SOURCE.md -------------------------------------------------


@needs_traces
def test_azure_llm_2023_matches_source() -> None:
    conv = load_workload("azure-conv", traces_dir=TRACES)
    code = load_workload("azure-code", traces_dir=TRACES)
    assert (len(conv), len(code)) == (19_366, 8_819)
    assert conv.models == ("azure-conv",) and code.models == ("azure-code",)
    assert 57 * 60 < conv.duration_s < 59 * 60 and 56 * 60 < code.duration_s < 58 * 60
    assert np.median(conv.input_tokens) == 1020 and round(conv.input_tokens.mean()) == 1155
    assert np.median(conv.output_tokens) == 129 and round(conv.output_tokens.mean()) == 211
    assert np.median(code.input_tokens) == 1469 and np.median(code.output_tokens) == 13
    assert conv.num_skipped_rows == 0 and conv.num_clamped_tokens == 0
    both = load_workload("azure-llm", traces_dir=TRACES)
    assert both.model_counts() == {"azure-conv": 19_366, "azure-code": 8_819}
    # One time origin: the code service starts 18:17:03.97996 - 18:15:46.68059 = 77.29937 s after conv.
    first_code = both.arrival_s[both.model_index == 1][0]
    assert first_code == pytest.approx(77.29937, abs=1e-6)


@needs_traces
def test_vidur_copies_equal_azure() -> None:
    azure = load_workload("azure-conv", traces_dir=TRACES)
    vidur = load_workload("vidur-conv", traces_dir=TRACES)
    assert len(vidur) == len(azure)
    np.testing.assert_allclose(vidur.arrival_s, azure.arrival_s, atol=1e-5)
    assert np.array_equal(vidur.input_tokens, azure.input_tokens)
    assert vidur.duration_s == pytest.approx(3501.721937)
    assert load_workload("vidur-code", traces_dir=TRACES).duration_s == pytest.approx(3435.948056)


@needs_traces
def test_mooncake_matches_source() -> None:
    conversation = load_workload("mooncake", traces_dir=TRACES)
    assert len(conversation) == 12_031 and conversation.duration_s == pytest.approx(3536.999)
    assert round(conversation.input_tokens.mean()) == 12_035 and round(conversation.output_tokens.mean()) == 343
    synthetic = read_mooncake(TRACES / "mooncake/synthetic_trace.jsonl")
    assert len(synthetic) == 3_993 and synthetic.duration_s == pytest.approx(1022.025)


@needs_traces
def test_length_distributions_match_source() -> None:
    sharegpt = read_length_pairs(TRACES / "sharegpt-lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
    assert sharegpt.input_tokens.size == 30_731
    assert (np.median(sharegpt.input_tokens), np.median(sharegpt.output_tokens)) == (1730, 415)
    arxiv_csv = "vidur-processed-traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
    arxiv = read_length_pairs(TRACES / arxiv_csv)
    assert arxiv.input_tokens.size == 28_257
    assert (np.median(arxiv.input_tokens), np.median(arxiv.output_tokens)) == (2730, 167)
    with pytest.raises(TraceError, match="length distribution without timestamps"):
        load_workload(f"file:{TRACES}/sharegpt-lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv")


@needs_traces
def test_alibaba_genai_is_multi_model_with_drawn_lengths() -> None:
    workload = load_workload("alibaba-genai", seed=3, traces_dir=TRACES)
    # 26,823 rows; 25 PENDING rows name no base model and are left out (noted).
    assert len(workload) == 26_823 - 25 and any("25 requests" in note for note in workload.notes)
    counts = workload.model_counts()
    assert max(counts, key=counts.__getitem__) == "M0002" and counts["M0002"] == 8_234
    assert len(counts) > 80
    # 2024-11-15 16:57:50 to 2024-12-08 17:33:57, plus under 1 s of jitter.
    assert 1_989_367 <= workload.duration_s < 1_989_368
    assert any("sharegpt" in note for note in workload.notes)
    again = read_alibaba_genai(TRACES / "alibaba-genai-2026/lora_request_trace.csv", FIXED, seed=3)
    assert np.array_equal(again.arrival_s, workload.arrival_s) and set(again.input_tokens.tolist()) == {100}


@needs_traces
def test_azure_functions_keep_per_minute_counts() -> None:
    with open(TRACES / "azure-functions-2019-invitro-sample/1000_inv.csv", newline="") as file:
        rows = list(csv.reader(file))[1:]
    counts = np.array([row[3:] for row in rows], dtype=np.int64)
    assert counts.shape == (1000, 1440) and counts.sum() == pytest.approx(11.64e6, rel=1e-3)
    workload = load_workload("azure-functions;start=120;duration=300;lengths=fixed:5:5", seed=1, traces_dir=TRACES)
    assert len(workload.models) == 1000 and workload.duration_s == 300
    per_minute = np.bincount((workload.arrival_s // 60).astype(int), minlength=5)
    assert per_minute.tolist() == counts[:, 2:7].sum(axis=0).tolist()
    folded = load_workload("azure-functions;duration=60;lengths=fixed:5:5", models=["x", "y"], traces_dir=TRACES)
    assert folded.models == ("x", "y") and len(folded) == counts[:, 0].sum()


@needs_traces
def test_servegen_rates_follow_the_published_windows() -> None:
    model_dir = TRACES / "servegen/multimodal/mm-image"
    expected = sum(
        float(row[1]) * 600 for path in model_dir.glob("chunk-*-trace.csv") for row in csv.reader(open(path))
    )
    day = read_servegen([model_dir], seed=5, duration_s=86_400)
    assert len(day) == pytest.approx(expected, rel=0.002)
    assert day.rate_per_s == pytest.approx(9.5, rel=0.02)  # SOURCE.md: mean 9.5 req/s
    assert day.input_tokens.min() >= 1 and day.output_tokens.min() >= 1
    hour = load_workload("servegen:reason/deepseek-r1;start=3600;duration=3600;by=client", seed=2, traces_dir=TRACES)
    assert len(hour.models) == 73 and hour.models[0].startswith("deepseek-r1/c")
    assert hour.duration_s == 3600 and 0 <= hour.arrival_s.min() and hour.arrival_s.max() < 3600
    same = load_workload("servegen:reason/deepseek-r1;start=3600;duration=3600;by=client", seed=2, traces_dir=TRACES)
    assert np.array_equal(same.arrival_s, hour.arrival_s) and np.array_equal(same.output_tokens, hour.output_tokens)
    other = load_workload("servegen:reason/deepseek-r1;start=3600;duration=3600", seed=9, traces_dir=TRACES)
    assert not np.array_equal(other.arrival_s[:100], hour.arrival_s[:100])


@needs_traces
def test_servegen_lengths_come_from_client_pdfs_and_pool() -> None:
    model_dir = TRACES / "servegen/language/m-large"
    workload = read_servegen([model_dir], seed=1, start_s=64_800, duration_s=600, by_client=True)
    pdf = json.loads((model_dir / "chunk-104-dataset.json").read_text())["64800"]["output_tokens"]
    support = {int(key.split(":")[0]) for key in pdf.strip("{}").split(",")}
    mine = workload.output_tokens[workload.model_index == workload.models.index("m-large/c104")]
    assert mine.size > 300 and set(mine.tolist()) <= support  # 1.06 req/s in that window
    assert any("pooled length PDFs" in note for note in workload.notes)  # most m-large clients have no dataset.json
    few = load_workload("servegen:language/m-large,m-mid;duration=600;clients=3", seed=1, traces_dir=TRACES)
    assert few.models == ("m-large", "m-mid")
    with pytest.raises(TraceError, match="max_requests"):
        load_workload("servegen:m-mid;duration=86400", traces_dir=TRACES)


@needs_traces
def test_specs_map_single_model_traces_onto_models() -> None:
    models = [f"m{i}" for i in range(4)]
    spec = "azure-conv;start=600;duration=1200;scale=2;popularity=zipf:1.5"
    workload = load_workload(spec, models=models, seed=7, traces_dir=TRACES)
    assert workload.models == tuple(models) and workload.duration_s == pytest.approx(600)
    counts = list(workload.model_counts().values())
    assert counts == sorted(counts, reverse=True) and counts[-1] > 0
    assert np.array_equal(load_workload(spec, models=models, seed=7, traces_dir=TRACES).model_index,
                          workload.model_index)
    assert load_workload("azure-conv;models=2", models=models, traces_dir=TRACES).models == ("m0", "m1")


def test_missing_traces_folder_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPOOL_TRACES", str(tmp_path / "nowhere"))
    with pytest.raises(TraceError, match="nowhere"):
        load_workload("azure-conv")
    with pytest.raises(TraceError, match="azure-llm-2023"):
        load_workload("azure-conv", traces_dir=tmp_path)


# -- generic format, malformed rows ---------------------------------------------------


GOOD = "timestamp_s,model,input_tokens,output_tokens\n2.5,b,10,5\n0.5,a,20,0\n1.0,a,30,3\n"


def test_generic_csv_sorts_clamps_and_round_trips(tmp_path: Path) -> None:
    workload = read_generic(write(tmp_path / "w.csv", GOOD))
    assert workload.arrival_s.tolist() == [0.5, 1.0, 2.5] and workload.models == ("b", "a")
    assert workload.output_tokens.tolist() == [1, 3, 5] and workload.num_clamped_tokens == 1
    assert [r.request_id for r in workload.requests()] == ["r0000001", "r0000002", "r0000003"]
    assert next(workload.requests()).model == "a"
    workload.to_csv(tmp_path / "out.csv")
    workload.to_jsonl(tmp_path / "out.jsonl")
    for path in (tmp_path / "out.csv", tmp_path / "out.jsonl"):
        back = load_workload(f"file:{path}")
        assert list(back.requests()) == list(workload.requests())


@pytest.mark.parametrize(("text", "line", "column", "value"), [
    ("0,a,1,1\n1,a,x7,1\n", 3, "input_tokens", "'x7'"),
    ("0,a,1,1\n1,a,1,1\n2,a,-4,1\n", 4, "input_tokens", "'-4'"),
    ("0,a,1,1\n1,a,1\n", 3, "output_tokens", "None"),
    ("0,a,1,1\nnan,a,1,1\n", 3, "timestamp_s", "'nan'"),
    ("0,a,1,1\n1,,1,1\n", 3, "model", "''"),
    ("0,a,1.5,1\n", 2, "input_tokens", "'1.5'"),
    ("0,a,1,99999999999\n", 2, "output_tokens", "'99999999999'"),
])
def test_malformed_rows_name_file_line_column_value(tmp_path: Path, text: str, line: int, column: str,
                                                    value: str) -> None:
    path = write(tmp_path / "bad.csv", "timestamp_s,model,input_tokens,output_tokens\n" + text)
    with pytest.raises(TraceError) as error:
        read_generic(path)
    message = str(error.value)
    assert f"{path}:{line}:" in message and repr(column) in message and value in message
    assert len(read_generic(path, skip_bad_rows=True)) + 1 == text.count("\n")


def test_skip_bad_rows_counts(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.csv", GOOD + "x,a,1,1\n3,a,-1,1\n4,a,1\n5,a,1,1\n")
    workload = read_generic(path, skip_bad_rows=True)
    assert len(workload) == 4 and workload.num_skipped_rows == 3
    assert load_workload(f"file:{path}", skip_bad_rows=True).num_skipped_rows == 3


def test_bad_timestamps_headers_json_and_bytes(tmp_path: Path) -> None:
    azure = write(tmp_path / "azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                  "2023-11-16 18:15:46.6805900,374,44\n2023-13-16 18:15:50.99,396,109\n")
    with pytest.raises(TraceError, match=r"azure\.csv:3: column 'TIMESTAMP'.*'2023-13-16 18:15:50\.99'"):
        read_azure_llm([azure])
    assert len(read_azure_llm([azure], skip_bad_rows=True)) == 1
    with pytest.raises(TraceError, match=r"header\.csv:1: column 'model'"):
        read_generic(write(tmp_path / "header.csv", "timestamp_s,input_tokens,output_tokens\n1,2,3\n"))
    jsonl = write(tmp_path / "w.jsonl", '{"timestamp_s": 1, "model": "a", "input_tokens": 3, "output_tokens": 4}\n'
                  '{"timestamp_s": 2, "model": "a", "input_tokens": 3\n'
                  '{"timestamp_s": 3, "model": "a", "input_tokens": [3], "output_tokens": 4}\n')
    with pytest.raises(TraceError, match=r"w\.jsonl:2: column '\(row\)'"):
        read_generic(jsonl)
    assert read_generic(jsonl, skip_bad_rows=True).num_skipped_rows == 2
    binary = tmp_path / "bytes.csv"
    binary.write_bytes(b"timestamp_s,model,input_tokens,output_tokens\n1,a,2,3\n2,\xff\xfe,2,3\n")
    with pytest.raises(TraceError, match=r"bytes\.csv:3: column 'model': not valid UTF-8"):
        read_generic(binary)
    with pytest.raises(TraceError, match="not found: .*missing.csv"):
        load_workload(f"file:{tmp_path}/missing.csv")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_workload("file:" + str(write(tmp_path / "other.csv", "a,b\n1,2\n")))


HEADER = "timestamp_s,model,input_tokens,output_tokens\n"
cell = st.one_of(st.text(max_size=6), st.integers(-5, 10**12).map(str), st.floats(allow_nan=True).map(repr),
                 st.sampled_from(["", " ", "nan", "inf", "-0", "1e400", '"', "\x00", "a,b", "\n"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(cell, min_size=0, max_size=6), max_size=6), skip=st.booleans())
def test_garbage_rows_only_raise_trace_error(tmp_path: Path, rows: list[list[str]], skip: bool) -> None:
    path = tmp_path / "garbage.csv"
    path.write_text(HEADER + "\n".join(",".join(row) for row in rows), encoding="utf-8", errors="surrogatepass")
    try:
        workload = read_generic(path, skip_bad_rows=skip)
    except TraceError:
        return
    assert workload.input_tokens.min(initial=1) >= 1 and np.all(np.diff(workload.arrival_s) >= 0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), jsonl=st.booleans())
def test_garbage_bytes_only_raise_trace_error(tmp_path: Path, data: bytes, jsonl: bool) -> None:
    path = tmp_path / ("garbage.jsonl" if jsonl else "garbage.csv")
    path.write_bytes((b"" if jsonl else HEADER.encode()) + data)
    for skip in (False, True):
        try:
            read_generic(path, skip_bad_rows=skip)
        except TraceError:
            pass


def test_file_specs_keep_named_models_and_check_options(tmp_path: Path) -> None:
    path = write(tmp_path / "w.csv", GOOD)
    kept = load_workload(f"file:{path}", models=["a", "b", "c"])
    assert kept.models == ("a", "b", "c") and kept.model_counts() == {"a": 2, "b": 1, "c": 0}
    with pytest.raises(TraceError, match="none of the file's 2 model names is a model of the fleet"):
        load_workload(f"file:{path}", models=["x"])  # a generic file's names are the fleet's unless asked to map
    folded = load_workload(f"file:{path};map=fold", models=["x"])
    assert folded.model_counts() == {"x": 3} and folded.notes
    with pytest.raises(TraceError, match="'clients' does not apply to a generic file"):
        load_workload(f"file:{path};clients=3")
    with pytest.raises(TraceError, match="max_requests"):
        load_workload("poisson:rate=1000;models=2;duration=100000;lengths=fixed:1:1")


def make_servegen(folder: Path) -> Path:
    """Two clients of a tiny ServeGen model: client 0 has a dataset.json, client 1 borrows its PDFs."""
    folder.mkdir(parents=True)
    write(folder / "chunk-0-trace.csv", "0,2.0,1.0,Gamma,1.0,0.5\n600,0,0,,0,0\n")
    write(folder / "chunk-1-trace.csv", "0,1.0,2.0,Weibull,0.5,1.0\n600,3.0,1.0,Gamma,1.0,0.3\n")
    pdfs = {"input_tokens": "{10: 0.5, 20: 0.5}", "output_tokens": "{3: 1.0}"}
    write(folder / "chunk-0-dataset.json", json.dumps({"0": pdfs, "21600": {"input_tokens": "{}",
                                                                              "output_tokens": "{}"}}))
    return folder


def test_servegen_on_a_small_model(tmp_path: Path) -> None:
    folder = make_servegen(tmp_path / "tiny")
    workload = load_workload(f"file:{folder};duration=1200;by=client", seed=4)
    assert workload.models == ("tiny/c0", "tiny/c1")
    assert workload.model_counts() == {"tiny/c0": 1200, "tiny/c1": 600 + 1800}
    assert set(workload.input_tokens.tolist()) == {10, 20} and set(workload.output_tokens.tolist()) == {3}
    assert any("2400 of 3600 requests use pooled" in note for note in workload.notes)
    write(folder / "chunk-1-trace.csv", "0,1.0,2.0,Weibull,0.5,1.0\n600,3.0,1.0,Lognormal,1.0,0.3\n")
    with pytest.raises(TraceError, match=r"chunk-1-trace\.csv:2: column 'pattern'.*'Lognormal'"):
        read_servegen([folder], seed=0, duration_s=1200)
    skipped = read_servegen([folder], seed=0, duration_s=1200, skip_bad_rows=True)
    assert skipped.num_skipped_rows == 1 and len(skipped) == 1200 + 600


json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                          lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=2), inner,
                                                                                       max_size=2), max_leaves=4)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(st.dictionaries(st.sampled_from(["timestamp_s", "model", "input_tokens", "output_tokens"]),
                                        json_value), max_size=5))
def test_odd_json_values_only_raise_trace_error(tmp_path: Path, records: list[dict[str, object]]) -> None:
    path = tmp_path / "odd.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in records), encoding="utf-8")
    for skip in (False, True):
        try:
            read_generic(path, skip_bad_rows=skip)
        except TraceError:
            pass


# -- workload transforms -------------------------------------------------------------


def test_time_slice_rebases_and_keeps_the_window() -> None:
    workload = make_workload([0.0, 1.0, 2.0, 3.0, 4.0])
    part = workload.time_slice(1.0, 3.0)
    assert part.arrival_s.tolist() == [0.0, 1.0] and part.duration_s == 2.0
    assert part.input_tokens.tolist() == [2, 3]
    assert workload.time_slice(3.0).arrival_s.tolist() == [0.0, 1.0]
    assert len(workload.time_slice(10.0)) == 0
    with pytest.raises(TraceError):
        workload.time_slice(2.0, 1.0)


def test_scale_rate_head_merge() -> None:
    workload = make_workload([0.0, 2.0, 4.0])
    faster = workload.scale_rate(2.0)
    assert faster.arrival_s.tolist() == [0.0, 1.0, 2.0] and faster.rate_per_s == pytest.approx(2 * workload.rate_per_s)
    assert len(workload.head(2)) == 2 and workload.head(2).duration_s == 2.0
    other = make_workload([1.0, 3.0], models=("b", "a"), index=[0, 1])
    merged = workload.merge([other])
    assert merged.models == ("a", "b") and merged.arrival_s.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [r.model for r in merged.requests()] == ["a", "b", "a", "a", "a"]
    with pytest.raises(TraceError):
        workload.scale_rate(0.0)


def test_map_and_fold_models() -> None:
    workload = make_workload(list(np.linspace(0, 100, 20_000)))
    mapped = workload.map_models(["x", "y", "z"], weights=[6, 3, 1], seed=4)
    shares = np.bincount(mapped.model_index) / len(mapped)
    np.testing.assert_allclose(shares, [0.6, 0.3, 0.1], atol=0.015)
    assert np.array_equal(mapped.arrival_s, workload.arrival_s)
    assert np.array_equal(workload.map_models(["x", "y", "z"], seed=4).model_index,
                          workload.map_models(["x", "y", "z"], seed=4).model_index)
    many = make_workload([0, 1, 2, 3, 4, 5], models=("p", "q", "r"), index=[2, 2, 2, 1, 1, 0])
    folded = many.fold_models(["A", "B"])
    assert folded.model_counts() == {"A": 4, "B": 2}  # r (3) -> A, q (2) -> B, p (1) -> A


# -- generators -------------------------------------------------------------------------


def test_poisson_and_gamma_rates_and_cv() -> None:
    rng = np.random.default_rng(11)
    for arrivals, cv in ((poisson_arrivals(5.0, 20_000.0, rng), 1.0), (gamma_arrivals(5.0, 3.0, 20_000.0, rng), 3.0)):
        gaps = np.diff(arrivals)
        assert arrivals.size / 20_000.0 == pytest.approx(5.0, rel=0.03 * cv)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
        assert arrivals.min() >= 0 and arrivals.max() < 20_000.0 and np.all(gaps >= 0)


def test_windowed_arrivals_hit_rate_and_shape() -> None:
    rng = np.random.default_rng(2)
    num = 300
    for weibull, shape, cv in ((False, 0.25, 2.0), (True, 0.5, np.sqrt(5.0)), (False, 0.007, None)):
        times, window = windowed_arrivals(np.arange(num) * 600.0, 600.0, np.full(num, 2.0), np.full(num, weibull),
                                          np.full(num, shape), np.ones(num), rng)
        assert np.bincount(window, minlength=num).tolist() == [1200] * num
        assert np.all((times >= window * 600.0) & (times < window * 600.0 + 600.0))
        if cv is not None:
            cvs = [np.diff(np.sort(times[window == w])) for w in range(50)]
            assert np.median([g.std() / g.mean() for g in cvs]) == pytest.approx(cv, rel=0.1)


def test_zipf_popularity_and_determinism() -> None:
    weights = zipf_weights(4, 1.0)
    np.testing.assert_allclose(weights, np.array([1, 1 / 2, 1 / 3, 1 / 4]) / (25 / 12))
    models = [f"m{i}" for i in range(8)]
    workload = zipf_workload(models, 20.0, 1.2, 2_000.0, FIXED, seed=3)
    counts = np.bincount(workload.model_index, minlength=8)
    assert counts[0] > counts[1] > counts[2] > counts[7] > 0
    assert len(workload) / 2_000.0 == pytest.approx(20.0, rel=0.03)
    again = zipf_workload(models, 20.0, 1.2, 2_000.0, FIXED, seed=3)
    assert np.array_equal(again.arrival_s, workload.arrival_s)
    rates = synthetic_workload(["a", "b"], {"a": 1.0, "b": 4.0}, 5_000.0, FIXED, seed=1).model_rates()
    assert rates["a"] == pytest.approx(1.0, rel=0.1) and rates["b"] == pytest.approx(4.0, rel=0.05)


def test_synthetic_specs() -> None:
    gamma = load_workload("gamma:rate=2,cv=2;duration=5000;lengths=fixed:8:9", models=["a", "b"], seed=1)
    assert gamma.models == ("a", "b") and gamma.duration_s == 5000 and set(gamma.output_tokens.tolist()) == {9}
    assert gamma.model_rates()["a"] == pytest.approx(2.0, rel=0.15)
    assert load_workload("poisson:rate=1:3;models=2;lengths=fixed:1:1;duration=2000").model_counts()["model-1"] > 5000
    zipf = load_workload("zipf:total_rate=5,s=2;models=3;lengths=fixed:1:1;scale=2", seed=0)
    assert zipf.duration_s == 1800 and zipf.rate_per_s == pytest.approx(10.0, rel=0.05)


@pytest.mark.parametrize(("spec", "match"), [
    ("", "empty trace name"),
    ("nope", "unknown trace 'nope'"),
    ("poisson:rate=1", "need models"),
    ("poisson:rate=fast;models=2", "rate='fast'"),
    ("poisson:rate=1,rate=2;models=2", "given twice"),
    ("poisson:rate=1;models=2;lengths=fixed:0:1", "fixed:INPUT:OUTPUT"),
    ("poisson:rate=1;models=two", "models='two'"),
    ("gamma:rate=1;models=1", "cv= is required"),
    ("zipf:total_rate=1;models=2;duration=-5", "duration='-5'"),
    ("zipf:total_rate=1;models=2;bogus=3", "unknown option 'bogus'"),
    ("azure-conv:x", "takes no ':x' argument"),
    ("azure-conv;start", "expected key=value"),
    ("file:", "expected file:PATH"),
    ("servegen", "expected servegen:CATEGORY/MODEL"),
])
def test_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(TraceError, match=match):
        load_workload(spec, traces_dir=TRACES)


def test_parse_spec_forms() -> None:
    spec = parse_spec("servegen:language/m-large,m-mid,clients=0.5;duration=60,start=5")
    assert (spec.name, spec.argument) == ("servegen", "language/m-large,m-mid")
    assert spec.options == {"clients": "0.5", "duration": "60", "start": "5"}
    assert parse_spec("azure-conv,scale=2").options == {"scale": "2"}
    assert parse_spec("file:/a,b/c.csv;scale=2").argument == "/a,b/c.csv"
    assert parse_spec("poisson:rate=1;lengths=fixed:1:2").options["lengths"] == "fixed:1:2"
