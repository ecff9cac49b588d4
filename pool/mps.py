"""CUDA MPS for the engine processes of one `modelpool serve`: instances on one GPU run side by side, not in turns.

Two processes on one GPU get its time in slices: CUDA switches between their contexts, so a prefill beside a
decoding process ran 1.80x its time alone on the H200. Under MPS (NVIDIA's Multi-Process Service) their
kernels share the GPU at once, as one process's streams do: 1.07x (a 7B prefill 28.9 ms alone, 30.9 ms beside
the decoder: the share probe on the H200, in the benchmark diary, git show 1476354:BENCHMARKS.md). vLLM's docs
suggest MPS for several engines on one GPU too.

`MpsDaemon` starts a private MPS control daemon (`nvidia-cuda-mps-control -d`, its pipe and log folders under
a fresh temporary folder, so it neither needs nor touches a system-wide one) and gives the environment that
makes a CUDA process its client; `stop` quits it. A process picks the daemon up when it first touches CUDA,
so the environment must be set before any engine process starts (and before the serving process uses CUDA).
Where CUDA_MPS_PIPE_DIRECTORY is already set, a daemon is taken to be running there, and is neither started
nor stopped.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
# a CUDA client of the daemon: the daemon starts its server only when one connects, and that can still fail (a
# GPU in exclusive mode, no room for the server, a container without the IPC it needs)
CLIENT_CHECK = [sys.executable, "-c", "import torch; torch.empty(1, device='cuda'); torch.cuda.synchronize()"]


# the quit, in a process of its own: the control binary's `quit` waits for every client, then the folders go
QUIT = ("import shutil, subprocess, sys; "
        "subprocess.run([sys.argv[1]], input='quit\\n', text=True, capture_output=True); "
        "shutil.rmtree(sys.argv[2], ignore_errors=True)")
log = logging.getLogger(__name__)


class MpsError(RuntimeError):
    """The MPS control daemon could not be found, started or stopped."""


class MpsDaemon:
    """A private MPS control daemon, for `with` or start/stop; `env` is what a client process needs."""

    def __init__(self, control: str = CONTROL) -> None:
        self.control = control
        self.env: dict[str, str] = {}
        self.folder: Path | None = None  # ours to remove; None: not started here (or an outside daemon)

    def start(self) -> dict[str, str]:
        """Start the daemon (or find one already named by the environment); its client environment."""
        if os.environ.get(PIPE_ENV):
            self.env = {name: os.environ[name] for name in (PIPE_ENV, LOG_ENV) if name in os.environ}
            return self.env
        binary = shutil.which(self.control)
        if binary is None:
            raise MpsError(f"{self.control} is not on PATH: MPS comes with the NVIDIA driver's utilities")
        folder = Path(tempfile.mkdtemp(prefix="modelpool-mps-"))
        env = {PIPE_ENV: str(folder / "pipe"), LOG_ENV: str(folder / "log")}
        for path in env.values():
            Path(path).mkdir()
        done = subprocess.run([binary, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            raise MpsError(f"{self.control} -d exited with {done.returncode}: {(done.stderr or done.stdout).strip()}")
        self.folder, self.env = folder, env
        return env

    def check_client(self, timeout_s: float = 120.0) -> None:
        """Start a CUDA client under the daemon (CLIENT_CHECK) and wait for it: MpsError, with what it said, when
        it cannot run there."""
        try:
            done = subprocess.run(CLIENT_CHECK, env={**os.environ, **self.env}, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise MpsError(f"a CUDA client of the MPS daemon did not finish within {timeout_s:g} s") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise MpsError(f"a CUDA client of the MPS daemon exited with {done.returncode}: "
                           f"{said[-1] if said else 'no output'}")

    def stop(self, wait_s: float = 10.0) -> None:
        """Quit a daemon started here; nothing otherwise. `quit` returns only once every client has ended, and the
        serving process is one where it touched CUDA (counting GPUs does), so the quit and the removal of the
        daemon's folders run in a process of their own that outlives this one: stop waits `wait_s` for it, then
        leaves it to finish when this process's CUDA context ends (never an error at shutdown)."""
        folder, self.folder = self.folder, None
        if folder is None:
            return
        quitter = subprocess.Popen([sys.executable, "-c", QUIT, shutil.which(self.control) or self.control,
                                    str(folder)], env={**os.environ, **self.env}, start_new_session=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            quitter.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            log.info("the MPS daemon in %s quits once its clients end (pid %d waits for it)", folder, quitter.pid)

    def __enter__(self) -> dict[str, str]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
