"""`serve --mps`: a private MPS control daemon for the engine processes, its client environment, and its end.

A fake `nvidia-cuda-mps-control` stands in on CPU machines; like the real one it refuses to start without its
pipe folder and answers `quit` only where a daemon was started, and it logs every call with the environment
it saw; its `quit`, like the real one's, returns only once no client is attached."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from modelpool.cli import app
from pool.mps import LOG_ENV, PIPE_ENV, MpsDaemon, MpsError

FAKE = """#!/bin/sh
echo "$*|$CUDA_MPS_PIPE_DIRECTORY|$CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
if [ "$1" = "-d" ]; then
  [ -n "$FAKE_MPS_FAIL" ] && { echo "$FAKE_MPS_FAIL" >&2; exit 3; }
  [ -d "$CUDA_MPS_PIPE_DIRECTORY" ] || { echo "no pipe folder" >&2; exit 1; }
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read cmd
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || { echo "no daemon here" >&2; exit 1; }
while [ -e "$CUDA_MPS_PIPE_DIRECTORY/client" ]; do sleep 0.05; done  # quit waits for every client to end
echo "stdin $cmd" >> "$FAKE_MPS_LOG"
"""


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-cuda-mps-control"
    script.write_text(FAKE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    for name in (PIPE_ENV, LOG_ENV):  # restored (unset) after the test, whatever serve sets meanwhile
        monkeypatch.delenv(name, raising=False)
    return log


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA client of the daemon, as pool.mps checks one: like a real one it connects only with the daemon's pipe
    folder in its environment (and, here, that folder made by the fake control binary's `-d`)."""
    import pool.mps

    monkeypatch.setattr(pool.mps, "CLIENT_CHECK", [sys.executable, "-c", (
        "import os, sys; pipe = os.environ.get('CUDA_MPS_PIPE_DIRECTORY', ''); "
        "ok = os.path.exists(os.path.join(pipe, 'control')); print('connected' if ok else 'no daemon to connect to', "
        "file=sys.stderr); sys.exit(0 if ok else 4)")])


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_private_daemon_is_started_with_its_own_folders_and_quit(fake_control: Path) -> None:
    daemon = MpsDaemon()
    with daemon as env:
        pipe, logs = Path(env[PIPE_ENV]), Path(env[LOG_ENV])
        assert pipe.is_dir() and logs.is_dir() and pipe.parent == logs.parent and "modelpool-mps-" in pipe.parent.name
        assert _calls(fake_control) == [f"-d|{pipe}|{logs}"]
    assert _calls(fake_control) == [f"-d|{pipe}|{logs}", f"|{pipe}|{logs}", "stdin quit"]
    assert not pipe.parent.exists()  # its folders go with it
    daemon.stop()  # once only
    assert len(_calls(fake_control)) == 3


def test_a_quit_that_waits_for_a_client_does_not_hold_the_serving_process(fake_control: Path) -> None:
    """The serving process is a client of the daemon once it touches CUDA, so `quit` cannot end before it does
    (every H100 server's shutdown sat 30 s in it, then logged TimeoutExpired): stop returns after its wait, and the
    quit and the folders' removal finish once the last client has gone."""
    import time

    daemon = MpsDaemon()
    pipe = Path(daemon.start()[PIPE_ENV])
    (pipe / "client").touch()  # the serving process, still attached
    began = time.monotonic()
    daemon.stop(wait_s=0.5)
    assert time.monotonic() - began < 5 and pipe.parent.exists() and "stdin quit" not in _calls(fake_control)
    (pipe / "client").unlink()  # the serving process ends
    deadline = time.monotonic() + 10
    while pipe.parent.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pipe.parent.exists() and _calls(fake_control)[-1] == "stdin quit"


def test_a_daemon_named_by_the_environment_is_used_and_left_alone(fake_control: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PIPE_ENV, "/somewhere/pipe")
    daemon = MpsDaemon()
    assert daemon.start() == {PIPE_ENV: "/somewhere/pipe"}
    daemon.stop()
    assert _calls(fake_control) == []


def test_no_control_binary_or_a_failed_start_is_an_error_naming_it(fake_control: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MpsError, match="not-there-mps-control is not on PATH"):
        MpsDaemon("not-there-mps-control").start()
    monkeypatch.setenv("FAKE_MPS_FAIL", "An MPS control daemon is already running")
    with pytest.raises(MpsError, match=r"-d exited with 3: An MPS control daemon is already running"):
        MpsDaemon().start()
    folder = Path(_calls(fake_control)[0].split("|")[1]).parent
    assert not folder.exists()  # nothing left behind


def test_serve_mps_refuses_other_backends_and_a_machine_without_a_gpu(fake_control: Path) -> None:
    res = CliRunner().invoke(app, ["serve", "--mps", "--backend", "threads"])
    assert res.exit_code == 2 and "--backend processes" in res.output
    assert _calls(fake_control) == []  # refused before any daemon
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: serve would start serving")
    res = CliRunner().invoke(app, ["serve", "--mps", "--backend", "processes", "--engine", "torch"])
    assert res.exit_code == 2 and "no CUDA GPU" in res.output  # the daemon started first, then quit
    calls = _calls(fake_control)
    assert calls[0].startswith("-d|") and calls[-1] == "stdin quit"
    assert not Path(calls[0].split("|")[1]).parent.exists()


def _dep(devices: dict[str, str], device: str = "cuda", backend: str = "processes"):
    from modelpool.deploy import Deployment

    return Deployment(models=[], instances=[], costs=None, engine=None, backend=backend,  # type: ignore[arg-type]
                      device=device, devices=devices)


def test_serve_notes_the_gpus_whose_instances_are_time_sliced() -> None:
    """Without an MPS daemon, serve's banner names each GPU that engine processes share, and why; on CPU, with
    threads, or with one instance a GPU, there is nothing to say."""
    from modelpool.gpu_sharing import shared_gpus, time_slicing_notes

    shared = _dep({"slot0": "cuda:0", "slot1": "cuda:0", "slot2": "cuda:1"})
    assert shared_gpus(shared) == {"cuda:0": ["slot0", "slot1"]}
    [note] = time_slicing_notes(shared, "--no-mps")
    assert note.startswith("slot0, slot1 share cuda:0") and note.endswith("; --no-mps")
    for alone in (_dep({"slot0": "cuda:0", "slot1": "cuda:1"}), _dep({"slot0": "cpu", "slot1": "cpu"}, device="cpu"),
                  _dep({"slot0": "cuda:0", "slot1": "cuda:0"}, backend="threads")):
        assert shared_gpus(alone) == {} and time_slicing_notes(alone, "x") == []


def test_by_default_engine_processes_sharing_a_gpu_get_a_daemon(fake_control: Path, fake_client: None) -> None:
    """serve's default: a private daemon where instances share a GPU (its environment set for the engine processes
    it starts next), none where they do not; one that cannot start leaves them time-sliced, the note saying why."""
    from modelpool.gpu_sharing import auto_mps

    daemon, notes = auto_mps(_dep({"slot0": "cuda:0", "slot1": "cuda:0", "slot2": "cuda:1"}))
    assert daemon is not None and daemon.folder is not None
    try:
        [note] = notes
        pipe = daemon.env[PIPE_ENV]
        assert os.environ[PIPE_ENV] == pipe and _calls(fake_control) == [f"-d|{pipe}|{daemon.env[LOG_ENV]}"]
        assert note.startswith("slot0, slot1 share cuda:0 side by side") and pipe in note
    finally:
        daemon.stop()
        os.environ.pop(PIPE_ENV, None), os.environ.pop(LOG_ENV, None)
    assert _calls(fake_control)[-1] == "stdin quit"
    assert auto_mps(_dep({"slot0": "cuda:0", "slot1": "cuda:1"})) == (None, [])
    assert auto_mps(_dep({"slot0": "cuda:0", "slot1": "cuda:0"}, backend="threads")) == (None, [])
    assert len(_calls(fake_control)) == 3  # no daemon started for either


def test_by_default_a_daemon_that_cannot_start_leaves_the_instances_time_sliced(
        fake_control: Path, fake_client: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelpool.gpu_sharing import auto_mps

    monkeypatch.setenv("FAKE_MPS_FAIL", "An MPS control daemon is already running")
    daemon, [note] = auto_mps(_dep({"slot0": "cuda:0", "slot1": "cuda:0"}))
    assert daemon is None and PIPE_ENV not in os.environ
    assert "CUDA slices" in note and note.endswith("no MPS daemon: nvidia-cuda-mps-control -d exited with 3: "
                                                   "An MPS control daemon is already running")
    monkeypatch.setenv("PATH", "/nonexistent")
    daemon, [note] = auto_mps(_dep({"slot0": "cuda:0", "slot1": "cuda:0"}))
    assert daemon is None and note.endswith("nvidia-cuda-mps-control is not on PATH: MPS comes with the NVIDIA "
                                            "driver's utilities")


def test_by_default_a_daemon_no_cuda_client_can_use_is_quit_and_the_instances_time_sliced(
        fake_control: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon starts, but a CUDA client cannot run under it (here: the real client check on a machine whose
    clients fail, or a fake one that exits 5): serve's default quits it and goes on time-sliced, saying why."""
    import pool.mps
    from modelpool.gpu_sharing import auto_mps

    monkeypatch.setattr(pool.mps, "CLIENT_CHECK", [sys.executable, "-c",
                                                   "import sys; print('all CUDA-capable devices are busy', "
                                                   "file=sys.stderr); sys.exit(5)"])
    daemon, [note] = auto_mps(_dep({"slot0": "cuda:0", "slot1": "cuda:0"}))
    assert daemon is None and PIPE_ENV not in os.environ
    assert note.endswith("no MPS daemon: a CUDA client of the MPS daemon exited with 5: all CUDA-capable devices "
                         "are busy")
    calls = _calls(fake_control)
    assert calls[0].startswith("-d|") and calls[-1] == "stdin quit"  # started, then quit
    assert not Path(calls[0].split("|")[1]).parent.exists()


def test_serve_mps_is_an_error_when_no_cuda_client_can_run_under_the_daemon(
        fake_control: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import modelpool.serve
    import pool.mps

    monkeypatch.setattr(modelpool.serve, "count_gpus", lambda backend, address: 1)  # as on a GPU machine
    monkeypatch.setattr(pool.mps, "CLIENT_CHECK", [sys.executable, "-c", "import sys; sys.exit(6)"])
    res = CliRunner().invoke(app, ["serve", "--mps", "--backend", "processes", "--engine", "torch"])
    said = " ".join(res.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())  # rich's error box, unwrapped
    assert res.exit_code == 2 and "a CUDA client of the MPS daemon exited with 6: no output" in said
    calls = _calls(fake_control)
    assert calls[0].startswith("-d|") and calls[-1] == "stdin quit"  # started, checked, quit
    assert not Path(calls[0].split("|")[1]).parent.exists()
