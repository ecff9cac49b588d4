"""The trace catalogue, the shipped defaults and the folders searched: what a fresh install reads, and from where."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest

from sims.trace_readers import read_length_pairs
from sims.trace_store import CATALOGUE, MANIFEST, SHIPPED, build_manifest, locate, search_dirs, where
from sims.traces import load_workload
from sims.workload import TraceError

REPO = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("MODELPOOL_TRACES", REPO / "../shared/traces")).resolve()
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"production traces not found at {TRACES}")
CONV = "azure-llm-2023/AzureLLMInferenceTrace_conv.csv"


@needs_traces
def test_manifest_matches_the_verified_copy() -> None:
    """Every catalogued file of shared/traces (byte for byte upstream) has its size and sha256 in the manifest."""
    import json

    assert build_manifest(TRACES)["files"] == json.loads(MANIFEST.read_text())["files"]


@needs_traces
def test_shipped_sharegpt_pairs_are_the_upstream_rows_in_order() -> None:
    upstream = read_length_pairs(TRACES / CATALOGUE["sharegpt"].paths[0])
    shipped = read_length_pairs(SHIPPED / str(CATALOGUE["sharegpt"].shipped))
    assert np.array_equal(upstream.input_tokens, shipped.input_tokens)
    assert np.array_equal(upstream.output_tokens, shipped.output_tokens)


def test_default_lengths_need_no_traces_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPOOL_TRACES", str(tmp_path / "nowhere"))
    workload = load_workload("poisson;rate=2;duration=60;lengths=sharegpt", ["a", "b"], seed=1)
    assert len(workload) > 100 and workload.input_tokens.max() > 1000
    assert "lengths from sharegpt" in workload.notes[0]
    with pytest.raises(TraceError, match=r"modelpool traces fetch arxiv"):
        load_workload("poisson;rate=2;duration=60;lengths=arxiv", ["a"])


def test_the_cache_comes_first_then_MODELPOOL_TRACES(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, team = tmp_path / "cache", tmp_path / "team"
    monkeypatch.setenv("MODELPOOL_TRACES_CACHE", str(cache))
    monkeypatch.setenv("MODELPOOL_TRACES", str(team))
    assert search_dirs() == [cache.resolve(), team.resolve()]
    assert search_dirs(tmp_path) == [tmp_path]
    with pytest.raises(TraceError, match=r"AzureLLMInferenceTrace_conv.csv \(looked in .*cache, .*team\); "
                                         r"`modelpool traces fetch azure-conv`"):
        locate(CONV)
    (team / CONV).parent.mkdir(parents=True)
    (team / CONV).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,10,2\n")
    assert locate(CONV) == team.resolve() / CONV
    assert where(CATALOGUE["azure-llm"]) == (team.resolve(), 1)
    (cache / CONV).parent.mkdir(parents=True)
    (cache / CONV).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,10,2\n"
                              "2023-11-16 18:15:47.6,20,3\n")
    assert locate(CONV) == cache.resolve() / CONV
    assert len(load_workload("azure-conv")) == 2


def test_every_catalogued_trace_has_files_and_an_origin() -> None:
    for trace in CATALOGUE.values():
        assert trace.files, trace.name
        assert all(file.url.startswith(f"https://raw.githubusercontent.com/{trace.origin.repo}/{trace.origin.commit}/")
                   for file in trace.files)
        assert trace.origin.license
    assert CATALOGUE["azure-conv"].files[0].url.endswith("/data/AzureLLMInferenceTrace_conv.csv")


GENERIC = "timestamp_s,model,input_tokens,output_tokens\n0.5,a,20,4\n1.0,b,30,3\n"


def test_gzipped_traces_read_like_plain_ones(tmp_path: Path) -> None:
    plain = tmp_path / "t.csv"
    plain.write_text(GENERIC)
    packed = tmp_path / "t.csv.gz"
    packed.write_bytes(gzip.compress(GENERIC.encode()))
    jsonl = tmp_path / "t.jsonl.gz"
    jsonl.write_bytes(gzip.compress(b'{"timestamp_s": 0.5, "model": "a", "input_tokens": 20, "output_tokens": 4}\n'))
    a, b = load_workload(f"file:{plain}"), load_workload(f"file:{packed}")
    assert np.array_equal(a.input_tokens, b.input_tokens) and a.models == b.models == ("a", "b")
    assert load_workload(f"file:{jsonl}").input_tokens.tolist() == [20]
    bad = tmp_path / "bad.csv.gz"
    bad.write_bytes(gzip.compress(b"timestamp_s,model,input_tokens,output_tokens\n0.5,a,x,4\n"))
    with pytest.raises(TraceError, match=r"bad.csv.gz:2: column 'input_tokens'"):
        load_workload(f"file:{bad}")
    broken = tmp_path / "broken.csv.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(TraceError, match=r"cannot read trace file .*broken.csv.gz"):
        load_workload(f"file:{broken}")


# -- a path is a trace ---------------------------------------------------------------


def test_a_bare_path_is_read_like_file_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("mine.csv").write_text(GENERIC)
    bare, prefixed = load_workload("mine.csv;scale=2"), load_workload(f"file:{tmp_path}/mine.csv;scale=2")
    assert np.array_equal(bare.arrival_s, prefixed.arrival_s) and bare.models == ("a", "b")
    Path("kimi.jsonl").write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1]}\n'
                                  '{"timestamp": 1500, "input_length": 7, "output_length": 3, "hash_ids": [1, 2]}\n')
    mooncake = load_workload(f"{tmp_path}/kimi.jsonl", models=["x"])  # sniffed as Mooncake, mapped onto x
    assert mooncake.arrival_s.tolist() == [0.0, 1.5] and mooncake.models == ("x",)
    Path("bad.csv").write_text(GENERIC + "2.0,a,-3,1\n")
    with pytest.raises(TraceError, match=r"bad.csv:4: column 'input_tokens': negative: '-3'"):
        load_workload("bad.csv")
    with pytest.raises(TraceError, match=r"trace file not found: nothere.csv"):
        load_workload("nothere.csv")
    with pytest.raises(TraceError, match=r"unknown trace 'nothere'; known: .*, or a path to a CSV/JSONL file"):
        load_workload("nothere")
