"""Where a tensor-parallel instance's other ranks run: subprocesses of rank 0's process, or Ray actors.

Both answer `send(method, args)` (`method` an unbound `TorchEngine` method) / `recv()` (a dead rank raises `RankLost`),
`ready()`, `stop()` and `kill()` for `pool.engines.tp.TpEngine`. A subprocess
rank talks over a socket pair (nothing on the network) and is started with
`python -m pool.engines.tp_ranks FD`; a Ray rank is an actor in its bundle of
the instance's placement group.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from pool.engines.tp import RankLost, RankMethod, RankSetup, build_rank, run_call


# ---- ranks as subprocesses ---------------------------------------------------------------------------------
class ProcessRank:
    """A remote rank in a subprocess of this one, over a socket pair (no address, nothing on the network)."""

    def __init__(self, setup: RankSetup) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, OMP_NUM_THREADS=str(setup.threads), TOKENIZERS_PARALLELISM="false")
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the `pool` package
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        self.process = subprocess.Popen([sys.executable, "-m", "pool.engines.tp_ranks", str(child.fileno())],
                                        pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.conn = Connection(parent.detach())
        self.rank = setup.rank
        try:
            self.conn.send_bytes(pickle.dumps(setup))
        except OSError as exc:  # it died before it read its setup (a broken interpreter, say)
            self.kill()
            raise RuntimeError(f"tp rank {self.rank} failed to start: its process exited "
                               f"({self.process.returncode}) before it read its setup ({exc!r})") from None

    @property
    def pid(self) -> int:
        return self.process.pid

    def started(self, timeout_s: float = 120.0) -> None:
        """Wait until the rank's process runs (before rank 0 meets it in the process group, which would wait out
        its timeout for a rank that never came up)."""
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"tp rank {self.rank} (pid {self.pid}) did not start within {timeout_s} s")
        try:
            status, _ = self.recv()
        except RankLost as exc:
            raise RuntimeError(f"tp rank {self.rank} failed to start: {exc}") from None
        if status != "alive":
            raise RuntimeError(f"tp rank {self.rank}: unexpected first message {status!r}")

    def ready(self) -> int:
        """Wait until the rank is built; its pid."""
        status, result = self.recv()
        if status != "ok":
            raise RuntimeError(f"tp rank {self.rank}: {result}")
        return self.pid

    def send(self, method: RankMethod, args: tuple[Any, ...]) -> None:
        try:
            self.conn.send_bytes(pickle.dumps((method, args), protocol=5))
        except (OSError, ValueError) as exc:
            raise RankLost(f"rank {self.rank} (pid {self.pid}) is gone: {exc!r}") from None

    def recv(self) -> tuple[str, Any]:
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            code = self.process.poll()
            raise RankLost(f"rank {self.rank} (pid {self.pid}) died (exit code {code}): {exc!r}") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(None))
        except (OSError, ValueError):
            pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self.conn.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def _rank_main(fd: int) -> None:
    """A remote rank's process: build the rank, then answer calls until the instance closes or goes away."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops us in order
    conn = Connection(fd)
    setup: RankSetup = pickle.loads(conn.recv_bytes())
    torch.set_num_threads(setup.threads)
    conn.send_bytes(pickle.dumps(("alive", os.getpid())))
    try:
        engine = build_rank(setup)
    except BaseException as exc:  # noqa: BLE001 - told to rank 0, whose start fails with it
        conn.send_bytes(pickle.dumps(("fatal", RuntimeError(f"rank {setup.rank} failed to start: {exc!r}"))))
        return
    conn.send_bytes(pickle.dumps(("ok", os.getpid())))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # rank 0 is gone
            break
        if message is None:
            break
        status, result = run_call(engine, *message)
        del message
        try:
            conn.send_bytes(pickle.dumps((status, result), protocol=5))
        except (OSError, ValueError):
            break
        if status == "fatal":
            os._exit(1)
    engine.close()


def process_ranks(setups: Sequence[RankSetup]) -> list[ProcessRank]:
    ranks: list[ProcessRank] = []
    try:
        for setup in setups:
            ranks.append(ProcessRank(setup))
    except BaseException:
        for rank in ranks:
            rank.kill()
        raise
    return _started(ranks)


def _started(ranks: list[Any]) -> list[Any]:
    """`ranks` once each runs (all killed when one does not)."""
    try:
        for rank in ranks:
            rank.started()
    except BaseException:
        for rank in ranks:
            rank.kill()
        raise
    return ranks


# ---- ranks as Ray actors ---------------------------------------------------------------------------------------
class RankActor:
    """A remote rank as a Ray actor (in its instance's placement group)."""

    def __init__(self, setup: RankSetup) -> None:
        os.environ["OMP_NUM_THREADS"] = str(setup.threads)
        torch.set_num_threads(setup.threads)
        self.setup = setup
        self.engine: Any = None

    def build(self) -> int:
        """Meet the other ranks in the process group and build the engine (after `pid` said the actor runs)."""
        self.engine = build_rank(self.setup)
        return os.getpid()

    def call(self, method: RankMethod, *args: Any) -> tuple[str, Any]:
        status, result = run_call(self.engine, method, args)
        if status == "fatal":  # answer, then go: the peers' collectives fail at once
            import threading

            threading.Timer(0.5, os._exit, (1,)).start()
        return status, result

    def pid(self) -> int:
        return os.getpid()


class RayRank:
    def __init__(self, setup: RankSetup, placement_group: Any, use_gpus: bool) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pool.placement import rank_bundle

        self._ray, self.rank = ray, setup.rank
        bundle = rank_bundle(use_gpus)
        options: dict[str, Any] = {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0), "max_restarts": 0}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=setup.rank)
        self.actor: Any = ray.remote(RankActor).options(**options).remote(setup)
        self._ref: Any = None
        self._built: Any = None

    def started(self, timeout_s: float = 300.0) -> None:
        """Wait until the actor runs, then have it meet rank 0 in the process group (see `ProcessRank.started`)."""
        try:
            self._ray.get(self.actor.pid.remote(), timeout=timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"tp rank {self.rank} (Ray actor) did not start within {timeout_s} s") from None
        except self._ray.exceptions.RayError as exc:
            raise RuntimeError(f"tp rank {self.rank} (Ray actor) failed to start: {exc}") from None
        self._built = self.actor.build.remote()

    def ready(self) -> int:
        """Wait until the rank is built; its pid."""
        try:
            return int(self._ray.get(self._built))
        except self._ray.exceptions.RayError as exc:
            raise RuntimeError(f"tp rank {self.rank} (Ray actor) failed to start: {exc}") from None

    def send(self, method: RankMethod, args: tuple[Any, ...]) -> None:
        self._ref = self.actor.call.remote(method, *args)

    def recv(self) -> tuple[str, Any]:
        try:
            return self._ray.get(self._ref)
        except self._ray.exceptions.RayError as exc:
            raise RankLost(f"rank {self.rank} (Ray actor) died: {exc}") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        self.kill()

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)


def ray_ranks(setups: Sequence[RankSetup]) -> list[RayRank]:
    """The remote ranks as actors in the bundles 1.. of the calling actor's placement group (rank 0 holds 0)."""
    import ray
    from ray.util import get_current_placement_group

    use_gpus = bool(ray.get_runtime_context().get_accelerator_ids().get("GPU"))
    group = get_current_placement_group()
    ranks = [RayRank(setup, group, use_gpus) for setup in setups]
    return _started(ranks)


if __name__ == "__main__":
    from pool.engines.tp_ranks import _rank_main as main  # the package's module, not this __main__ copy

    main(int(sys.argv[1]))
