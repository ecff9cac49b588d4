"""Ctrl-C (SIGINT) or SIGTERM while `modelpool serve` starts or warms up stops it within seconds.

Also when the process was started with SIGINT ignored, as a script's background job is: Python then keeps
SIGINT ignored, and before the fix only uvicorn's own handlers, installed once warm-up had ended, saw it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def serve_then_signal(args: list[str], signum: int, tmp_path: Path, *, ignore_sigint: bool,
                      after: str = "Starting", wait_s: float = 2.0) -> tuple[int, float, str]:
    """Start `modelpool serve ARGS`, send `signum` `wait_s` after `after` is printed; (exit code, seconds to exit,
    output)."""
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "modelpool.cli", "serve", *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint
                                else None)
        try:
            deadline = time.monotonic() + 180
            while after not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.05)
            time.sleep(wait_s)
            assert proc.poll() is None, f"serve ended before the signal:\n{log.read_text()[-2000:]}"
            sent = time.monotonic()
            proc.send_signal(signum)
            code = proc.wait(timeout=30)
            return code, time.monotonic() - sent, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# the sim engine with predicted times x1000: the 47 warm-up requests take minutes of wall time
SLOW_SIM = ["--engine", "sim", "--fleet", "models.yaml", "--sim-time-scale", "1000", "--port", "0"]


@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["sigint", "sigint-ignored-at-start"])
def test_ctrl_c_during_warm_up_stops_serve(tmp_path: Path, ignore_sigint: bool) -> None:
    code, seconds, output = serve_then_signal(SLOW_SIM, signal.SIGINT, tmp_path, ignore_sigint=ignore_sigint)
    assert code == 130 and seconds < 5, output
    assert "Interrupted before serving: stopping the pool." in output and "Warmed up" not in output


def test_sigterm_during_warm_up_stops_serve(tmp_path: Path) -> None:
    code, seconds, output = serve_then_signal(SLOW_SIM, signal.SIGTERM, tmp_path, ignore_sigint=False)
    assert code == 130 and seconds < 5, output


@pytest.mark.slow
def test_ctrl_c_while_ray_instances_start_stops_serve(tmp_path: Path) -> None:
    """The default deployment: the torch engine on Ray actors, interrupted while they load their models."""
    code, seconds, output = serve_then_signal(["--port", "0"], signal.SIGINT, tmp_path, ignore_sigint=True,
                                              wait_s=0.5)
    assert code == 130 and seconds < 10, output
    assert "Interrupted before serving" in output
