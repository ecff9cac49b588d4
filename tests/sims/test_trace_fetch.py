"""`modelpool traces` and `traces fetch` against a loopback HTTP server (Range supported) serving local copies."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from RangeHTTPServer import RangeRequestHandler
from typer.testing import CliRunner

from modelpool.cli import app
from modelpool.traces import FetchError, fetch_file
from sims.trace_store import CATALOGUE, TraceFile, locate
from sims.traces import load_workload

REPO = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("MODELPOOL_TRACES", REPO / "../shared/traces")).resolve()
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"production traces not found at {TRACES}")


class Handler(RangeRequestHandler):
    """Serves `directory`; records each request's Range header; can cut the next response short (a dropped link)."""

    ranges: list[str | None]
    cut_after: list[int]  # bytes to send before dropping the connection, for the next responses
    honour_ranges = True

    def send_head(self):  # type: ignore[no-untyped-def]
        self.ranges.append(self.headers.get("Range"))
        if not self.honour_ranges:  # a plain http.server: the whole file, 200
            self.range = None
            return SimpleHTTPRequestHandler.send_head(self)
        return super().send_head()

    def copyfile(self, source, outputfile):  # type: ignore[no-untyped-def]
        if self.cut_after:
            outputfile.write(source.read(self.cut_after.pop(0)))
            outputfile.flush()
            self.close_connection = True
            return
        super().copyfile(source, outputfile)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path, type[Handler]]]:
    """(base URL, served folder, handler class) of a loopback server."""
    served = tmp_path / "served"
    served.mkdir()
    handler = type("Recording", (Handler,), {"ranges": [], "cut_after": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", served, handler
    httpd.shutdown()
    httpd.server_close()


def serve_file(served: Path, relative: str, data: bytes) -> TraceFile:
    (served / relative).parent.mkdir(parents=True, exist_ok=True)
    (served / relative).write_bytes(data)
    return TraceFile(relative, len(data), hashlib.sha256(data).hexdigest())


DATA = bytes(range(256)) * 1000  # 256 kB, several chunks


def test_fetch_verifies_and_skips_a_verified_copy(server, tmp_path: Path) -> None:
    url, served, handler = server
    file = serve_file(served, "azure-llm-2023/x.csv", DATA)
    seen: list[int] = []
    target = fetch_file(file, tmp_path / "cache", url, seen.append)
    assert target == tmp_path / "cache/azure-llm-2023/x.csv" and target.read_bytes() == DATA
    assert sum(seen) == len(DATA) and handler.ranges == [None]
    assert fetch_file(file, tmp_path / "cache", url) == target
    assert handler.ranges == [None]  # nothing downloaded again


def test_an_interrupted_fetch_resumes_with_a_range_request(server, tmp_path: Path) -> None:
    url, served, handler = server
    file = serve_file(served, "mooncake/x.jsonl", DATA)
    handler.cut_after.append(100_000)
    with pytest.raises(FetchError, match="run the fetch again to resume"):
        fetch_file(file, tmp_path, url)
    part = tmp_path / "mooncake/x.jsonl.part"
    kept = part.stat().st_size
    assert 0 < kept <= 100_000 and not (tmp_path / "mooncake/x.jsonl").exists()
    seen: list[int] = []
    assert fetch_file(file, tmp_path, url, seen.append).read_bytes() == DATA
    assert handler.ranges == [None, f"bytes={kept}-"] and sum(seen) == len(DATA)
    assert not part.exists()


def test_a_server_that_ignores_ranges_gets_a_fresh_download(server, tmp_path: Path) -> None:
    url, served, handler = server
    file = serve_file(served, "a/x.csv", DATA)
    (tmp_path / "a").mkdir()
    (tmp_path / "a/x.csv.part").write_bytes(b"stale bytes from another version")
    handler.honour_ranges = False
    assert fetch_file(file, tmp_path, url).read_bytes() == DATA
    assert handler.ranges == ["bytes=32-"]


def test_a_checksum_mismatch_is_refused_and_removed(server, tmp_path: Path) -> None:
    url, served, _ = server
    file = serve_file(served, "azure-llm-2023/x.csv", DATA)
    (served / file.path).write_bytes(DATA[:-1] + b"!")  # same size, other bytes
    with pytest.raises(FetchError, match=r"azure-llm-2023/x.csv: checksum mismatch: .*x.csv gave 256000 bytes "
                                         rf"with sha256 [0-9a-f]{{64}}, expected 256000 bytes with sha256 {file.sha256}"):
        fetch_file(file, tmp_path / "cache", url)
    assert list((tmp_path / "cache").rglob("x.csv*")) == []


def test_a_missing_file_names_the_url_and_status(server, tmp_path: Path) -> None:
    url, _, _ = server
    with pytest.raises(FetchError, match=r"nowhere/x.csv: http://127.0.0.1:\d+/nowhere/x.csv answered HTTP 404"):
        fetch_file(TraceFile("nowhere/x.csv", 10, "0" * 64), tmp_path, url)


@needs_traces
def test_cli_fetches_a_catalogued_trace_that_the_readers_then_use(server, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    url, served, handler = server
    for file in CATALOGUE["azure-conv"].files:
        (served / file.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TRACES / file.path, served / file.path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("MODELPOOL_TRACES_CACHE", str(cache))
    monkeypatch.setenv("MODELPOOL_TRACES", str(tmp_path / "nowhere"))
    listed = CliRunner().invoke(app, ["traces"])
    assert listed.exit_code == 0, listed.output
    assert "azure-conv" in listed.output and "not here: `modelpool traces fetch azure-conv`" in listed.output
    assert "shipped:" in listed.output and "CC-BY-4.0" in listed.output
    res = CliRunner().invoke(app, ["traces", "fetch", "azure-conv", "--mirror", url])
    assert res.exit_code == 0, res.output
    assert "1 file(s) of azure-conv verified" in res.output and handler.ranges == [None]
    assert locate(CATALOGUE["azure-conv"].paths[0]).is_relative_to(cache.resolve())
    assert len(load_workload("azure-conv")) == 19366
    assert f"in {cache.resolve()}" in CliRunner().invoke(app, ["traces"]).output


def test_cli_names_an_unknown_trace_and_a_failed_fetch(server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, _, _ = server
    res = CliRunner().invoke(app, ["traces", "fetch", "azure-conversation"])
    assert res.exit_code == 1 and "unknown trace 'azure-conversation'; known: sharegpt, arxiv, azure-conv" in res.output
    monkeypatch.setenv("MODELPOOL_TRACES_MIRROR", url)  # an empty mirror
    res = CliRunner().invoke(app, ["traces", "fetch", "mooncake", "--dir", str(tmp_path / "mine")])
    assert res.exit_code == 1 and "mooncake/conversation_trace.jsonl" in res.output and "HTTP 404" in res.output
