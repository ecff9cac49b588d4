"""Every command of the README's quick start and of its simulate and capacity sections runs as written.

Commands are read from README.md itself, so an edit there is tested as it stands. Durations are cut to at most
60 s of traffic (`--duration`, `duration=` in a trace spec); `--out` and `--plan-log` land in a temporary working
folder that holds models.yaml and examples/ as the repository's root does. `modelpool traces fetch` fetches from a
loopback server serving ../shared/traces (`--mirror`'s variable), into an empty cache; it and the commands that
need its trace are skipped where there is no ../shared/traces.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from RangeHTTPServer import RangeRequestHandler

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
TRACES = Path(os.environ.get("MODELPOOL_TRACES", REPO / "../shared/traces")).resolve()
MAX_DURATION_S = 60


def section(heading: str) -> str:
    """The README text from `heading` to the next heading of the same level."""
    level = heading.split(" ")[0]
    start = README.index(heading + "\n") if heading.startswith("#") else 0
    end = README.find(f"\n{level} ", start + len(heading))
    return README[start:end if end >= 0 else None]


def commands(text: str) -> list[str]:
    """The `$ modelpool ...` lines of the code blocks in `text`, comments dropped."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    return [line[2:] for block in blocks for line in block.splitlines() if line.startswith("$ modelpool")]


SIMULATE = commands(section("## Simulating a trace: `modelpool simulate`"))
CAPACITY = commands(section("## Capacity: `modelpool capacity`").split("\n### ")[0])


def shortened(line: str) -> list[str]:
    """The command's arguments, with `--duration` and `duration=` cut to MAX_DURATION_S."""
    args = shlex.split(line, comments=True)
    for index, arg in enumerate(args):
        if index and args[index - 1] == "--duration":
            args[index] = str(min(float(arg), MAX_DURATION_S))
        args[index] = re.sub(r"duration=(\d+(\.\d+)?)",
                             lambda m: f"duration={min(float(m.group(1)), MAX_DURATION_S):g}", args[index])
    if args[:2] in (["modelpool", "simulate"], ["modelpool", "capacity"]) and "--duration" not in args \
            and not any("duration=" in arg for arg in args):
        args += ["--duration", str(MAX_DURATION_S)]
    return args


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """(working folder, environment): an empty trace cache, a loopback mirror of ../shared/traces when present."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copy(REPO / "models.yaml", root / "models.yaml")
    shutil.copytree(REPO / "examples", root / "examples")
    env = {**os.environ, "MODELPOOL_TRACES_CACHE": str(root / "cache"), "MODELPOOL_TRACES": str(root / "no-traces"),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    httpd = None
    if TRACES.is_dir():
        handler = functools.partial(RangeRequestHandler, directory=str(TRACES))
        handler.log_message = lambda *args: None  # type: ignore[attr-defined]
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        env["MODELPOOL_TRACES_MIRROR"] = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield root, env
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()


def run_readme_command(line: str, workspace: tuple[Path, dict[str, str]]) -> str:
    root, env = workspace
    if ("traces fetch" in line or "azure-conv" in line) and not TRACES.is_dir():
        pytest.skip(f"needs a copy of the public traces to serve on loopback ({TRACES})")
    args = shortened(line)
    out = subprocess.run([sys.executable, "-m", "modelpool.cli", *args[1:]], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"$ {shlex.join(args)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_the_sections_have_the_commands_the_tests_run() -> None:
    assert len(SIMULATE) >= 5 and any("--trace examples/traces/sample.csv" in line for line in SIMULATE)
    assert any(line.startswith("modelpool traces fetch") for line in SIMULATE)
    assert CAPACITY and all(line.startswith("modelpool capacity") for line in CAPACITY)


def ids(lines: list[str]) -> list[str]:
    return [" ".join(shlex.split(line, comments=True)[1:])[:80] for line in lines]


@pytest.mark.parametrize("line", SIMULATE, ids=ids(SIMULATE))
def test_readme_simulate_command(line: str, workspace: tuple[Path, dict[str, str]]) -> None:
    out = run_readme_command(line, workspace)
    if line.startswith("modelpool simulate"):
        assert "completed / failed" in out and "simulated in" in out
        if "--policy dedicated" in line:
            assert "one instance per model" in out and "dedicated on 57 GPUs" in out
    else:
        assert "verified in" in out
    for flag in ("--out", "--plan-log"):
        if flag in line:
            args = shlex.split(line, comments=True)
            target = workspace[0] / args[args.index(flag) + 1]
            assert target.exists() and (target.is_file() or any(target.iterdir()))


@pytest.mark.slow  # the whole shipped fleet, every policy, on a local Ray: ~2 min on 2 idle cores, 10 under load
@pytest.mark.parametrize("line", CAPACITY, ids=ids(CAPACITY))
def test_readme_capacity_command(line: str, workspace: tuple[Path, dict[str, str]]) -> None:
    out = run_readme_command(line, workspace)
    assert "wrote" in out and (workspace[0] / "capacity-report/report.html").is_file()


QUICK_START = [line.split("#")[0].strip() for line in re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
               .splitlines() if line.strip()]


def test_the_quick_start_test_command_is_what_ci_runs() -> None:
    """CI (.ci/run) runs the set-up, exactly the README's test command (the default suite), then the slow tests."""
    ci = (REPO / ".ci/run").read_text()
    assert QUICK_START[1] == "./scripts/setup.sh && .venv/bin/python -m pytest -q"
    assert "bash scripts/setup.sh" in ci and "\n.venv/bin/python -m pytest -q\n" in ci
    assert "\n.venv/bin/python -m pytest -q -m slow\n" in ci


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
def test_the_quick_start_serve_command_answers(tmp_path: Path) -> None:
    """`.venv/bin/modelpool serve` as the README runs it (after the set-up CI has run), on a free port."""
    setup, serve = QUICK_START[0].split(" && ")
    assert setup == "./scripts/setup.sh" and serve == ".venv/bin/modelpool serve"
    executable = REPO / ".venv/bin/modelpool"
    if not executable.exists():
        pytest.skip("no .venv: run ./scripts/setup.sh")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    log = tmp_path / "serve.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen([str(executable), "serve", "--port", str(port)], cwd=REPO, env=env, stdout=handle,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "OpenAI-compatible endpoint" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert "smollm2-135m" in {entry["id"] for entry in models["data"]}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-3000:]
