"""One copy of each model's weights per GPU: the engines on a device share one weights region.

Without it every instance on a GPU holds its own model slots: two instances of the default one-GPU
token-level layout held four copies of the largest model. Engines given the same share directory
(`TorchEngineConfig.shared_weights`) map one *weights region* per device instead, laid out once for the
models they load (`plan_layout`: every model at a fixed offset, sorted by name). A model's weights are
copied into it once per device, by the first engine that needs them; every other engine finds them there
and its switch to that model copies nothing. The offsets never change while the region lives, so the
decode graphs an engine captures at them stay valid.

Who owns the memory. A *keeper* process (`pool.engines.weights_keeper`), started by the first
engine that opens the region, allocates it and publishes how to map it: on CUDA the allocation's IPC
handle (torch.multiprocessing's CUDA tensor sharing, as the KV hand-off arena, `pool.engines.handoff`),
on CPU a shared-memory file the engines map, so the CPU tests run the same path. The keeper runs no model
code: an engine that crashes or is restarted frees nothing another engine reads (an exporting CUDA
process that frees memory an importer still maps is undefined behaviour, so no engine may own it). Each
process that maps the region leaves a mark (its pid); the keeper frees the region and exits once no
marked process has been alive for `grace_s`, deciding under the directory's lock so that no engine maps a
region that is going away. A restarted instance maps the region again and finds its models copied.

The copies. A small table beside the region (JSON, under an fcntl lock) says per model whether its copy
is done (`ready`) or under way and by whom. An engine that finds its model ready uses it; one that finds
it under way by a live copier waits for it (within one process it waits on the copy's event); one that
finds neither claims the copy, makes it and marks it ready once its event has completed: a peer never
reads bytes still being written, and a copier that died mid-copy is replaced by the next engine.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from pool.engines.base import EngineError
from pool.engines.device import ALIGN_BYTES, Streams, align_up, event_done, wait_event
from pool.engines.slots import ModelSlots, Placement
from pool.engines.weights import ModelImage
from pool.engines.weights_keeper import KEEPER_GRACE_S, Files, alive

START_TIMEOUT_S = 180.0  # for the keeper to publish the region (it imports torch and allocates)
COPY_TIMEOUT_S = 600.0  # for another engine's copy of a model to complete
_POLL_S = 0.01


class SharedWeightsError(EngineError):
    """The shared weights region cannot be opened or used as asked (the message says which and where)."""


def plan_layout(sizes: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """Model -> (offset, bytes) in the region: every model once, sorted by name, each aligned."""
    layout, top = {}, 0
    for name in sorted(sizes):
        layout[name] = (top, int(sizes[name]))
        top = align_up(top + int(sizes[name]), ALIGN_BYTES)
    return layout


def layout_bytes(layout: Mapping[str, tuple[int, int]]) -> int:
    """The region's size for `layout` (at least one aligned unit)."""
    return max([align_up(off + n, ALIGN_BYTES) for off, n in layout.values()], default=ALIGN_BYTES)


# ---- the process side: one mapping of each region per process -------------------------------------------------
_MAPPED: dict[tuple[str, str, str], tuple[torch.Tensor, int]] = {}  # (dir, device, generation) -> (bytes, users)
_PENDING: dict[tuple[str, str, str], Any] = {}  # (dir, device, model) -> the event of a copy this process makes
_MAP_LOCK = threading.RLock()


class SharedRegion:
    """An engine's handle on its device's shared weights region (see the module docstring).

    `storage` is the region's bytes; `layout` each model's (offset, bytes). `claim`, `copying`, `mark_ready`
    and `settle` run the copy protocol; `close` gives this engine's use back.
    """

    def __init__(self, share_dir: str | Path, device: torch.device | str, sizes: Mapping[str, int], *,
                 grace_s: float = KEEPER_GRACE_S, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the keeper allocates on this very GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.files = Files(Path(share_dir), str(self.device))
        self.layout = plan_layout(sizes)
        self.nbytes = layout_bytes(self.layout)
        self.token = f"{os.getpid()}:{uuid.uuid4().hex[:8]}"  # names this engine as a copier
        self._closed = False
        with self.files.locked():
            table = self.files.read_table()
            if table is None or not alive(int(table["keeper"])):
                table = self._start_keeper(grace_s, start_timeout_s)
            elif {k: tuple(v) for k, v in table["layout"].items()} != self.layout:
                raise SharedWeightsError(
                    f"{self.files.table}: the engines sharing weights on {self.device} must load the same models; "
                    f"the region holds {sorted(table['layout'])}, this engine loads {sorted(self.layout)} "
                    "(or their sizes differ: dtype, tensor-parallel shard)")
            self.generation = str(table["generation"])
            self.keeper = int(table["keeper"])
            self.storage = self._map()
            self.files.holders.mkdir(exist_ok=True)
            (self.files.holders / str(os.getpid())).touch()

    # ---- opening ----------------------------------------------------------------------------------------
    def _start_keeper(self, grace_s: float, timeout_s: float) -> dict[str, Any]:
        """A fresh region (the table is new: nothing is copied yet), its keeper started; under the lock."""
        files = self.files
        for stale in (files.handle, files.region):
            stale.unlink(missing_ok=True)
        shutil.rmtree(files.holders, ignore_errors=True)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        with open(files.log, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pool.engines.weights_keeper", "--dir", str(files.dir), "--device",
                 str(self.device), "--nbytes", str(self.nbytes), "--grace-s", str(grace_s)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=root, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not files.handle.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                tail = files.log.read_text(errors="replace")[-2000:] if files.log.exists() else ""
                raise SharedWeightsError(f"the weights keeper for {self.device} ({self.nbytes / 1e9:.2f} GB) did not "
                                         f"start (exit code {proc.poll()}); its log {files.log}:\n{tail}")
            time.sleep(_POLL_S)
        table = {"keeper": proc.pid, "generation": uuid.uuid4().hex, "nbytes": self.nbytes,
                 "layout": {k: list(v) for k, v in self.layout.items()}, "copies": {}}
        files.write_table(table)
        return table

    def _map(self) -> torch.Tensor:
        key = (str(self.files.dir), str(self.device), self.generation)
        with _MAP_LOCK:
            held = _MAPPED.get(key)
            if held is not None:
                _MAPPED[key] = (held[0], held[1] + 1)
                return held[0]
            published = pickle.loads(self.files.handle.read_bytes())
            if published["kind"] == "cuda":
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                storage = rebuild_cuda_tensor(*published["ipc"])
            else:
                storage = torch.from_file(published["path"], shared=True, size=published["nbytes"], dtype=torch.uint8)
            if storage.numel() < self.nbytes:
                raise SharedWeightsError(f"{self.files.handle}: region of {storage.numel()} bytes < {self.nbytes}")
            _MAPPED[key] = (storage, 1)
            return storage

    def offset(self, model: str) -> int:
        where = self.layout.get(model)
        if where is None:
            raise SharedWeightsError(f"model {model!r} has no place in the shared weights region of {self.device} "
                                     f"(it holds {sorted(self.layout)})")
        return where[0]

    # ---- the copy protocol ------------------------------------------------------------------------------
    def is_ready(self, model: str) -> bool:
        copy = self._copies().get(model)
        return copy is not None and copy["state"] == "ready"

    def claim(self, model: str, timeout_s: float = COPY_TIMEOUT_S) -> bool:
        """True: this engine must copy `model` in (and `mark_ready` it after); False: its copy is done. Waits
        while another live engine copies it; takes the copy over from one that died."""
        self.offset(model)
        deadline = time.monotonic() + timeout_s
        while True:
            with self.files.locked():
                table = self._table()
                copy = table["copies"].get(model)
                if copy is not None and copy["state"] == "ready":
                    return False
                copier = None if copy is None else str(copy["by"])
                if copier is None or not alive(int(copier.split(":")[0])) or copier == self.token:
                    table["copies"][model] = {"state": "copying", "by": self.token}
                    self.files.write_table(table)
                    return True
            self._settle_local(model)  # a copy by another engine of this process: its event says when
            if time.monotonic() > deadline:
                raise SharedWeightsError(f"model {model!r}: the copy by {copier} into the shared region of "
                                         f"{self.device} did not complete in {timeout_s:.0f} s")
            time.sleep(_POLL_S)

    def copying(self, model: str, event: Any) -> None:
        """The copy of `model` this engine claimed is queued; `event` completes with it."""
        with _MAP_LOCK:
            _PENDING[self._key(model)] = event

    def mark_ready(self, model: str) -> None:
        """The copy of `model` is complete (its event has been waited for): others may read it."""
        with _MAP_LOCK:
            _PENDING.pop(self._key(model), None)
        with self.files.locked():
            table = self._table()
            table["copies"][model] = {"state": "ready", "by": self.token}
            self.files.write_table(table)

    def settle(self) -> list[str]:
        """Mark ready every copy this process queued whose event has completed; returns those models."""
        done: list[str] = []
        if not _PENDING:
            return done
        with _MAP_LOCK:
            mine = [(k, e) for k, e in _PENDING.items() if k[:2] == self._key("")[:2] and event_done(e)]
        for key, _ in mine:
            self.mark_ready(key[2])
            done.append(key[2])
        return done

    def _settle_local(self, model: str) -> None:
        with _MAP_LOCK:
            event = _PENDING.get(self._key(model))
        if event is not None:
            wait_event(event)
            self.mark_ready(model)

    def _key(self, model: str) -> tuple[str, str, str]:
        return str(self.files.dir), str(self.device), model

    def _table(self) -> dict[str, Any]:
        table = self.files.read_table()
        if table is None or str(table["generation"]) != self.generation:
            raise SharedWeightsError(f"the shared weights region of {self.device} under {self.files.dir} is gone "
                                     "(its keeper exited or was replaced)")
        return table

    def _copies(self) -> dict[str, Any]:
        with self.files.locked():
            return dict(self._table()["copies"])

    # ---- closing -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """This engine no longer reads the region; the last user in the process drops the mapping and its mark
        (the keeper frees the region once no marked process is alive)."""
        if self._closed:
            return
        self._closed = True
        key = (str(self.files.dir), str(self.device), self.generation)
        with _MAP_LOCK:
            storage, users = _MAPPED.get(key, (None, 0))
            if users > 1:
                _MAPPED[key] = (storage, users - 1)  # type: ignore[assignment]
                return
            _MAPPED.pop(key, None)
            for pending in [k for k in _PENDING if k[:2] == key[:2]]:
                del _PENDING[pending]
        self.storage = None  # type: ignore[assignment]
        with self.files.locked():
            (self.files.holders / str(os.getpid())).unlink(missing_ok=True)


def mapped_regions() -> dict[tuple[str, str, str], int]:
    """(dir, device, generation) -> engines of this process using it: for tests."""
    with _MAP_LOCK:
        return {key: users for key, (_, users) in _MAPPED.items()}


# ---- an engine's model slots in the shared region -----------------------------------------------------------
class SharedModelSlots(ModelSlots):
    """Model slots whose region is the device's shared one: which models are resident is the engine's own
    (the instance model's rule, within the region's bytes: every loaded model fits at once), where each one
    sits is the region's layout, and a model another engine has copied in is not copied again."""

    def __init__(self, region: SharedRegion, streams: Streams, on_copy: Callable[[int], None] = lambda n: None) -> None:
        super().__init__(region.storage[: region.nbytes], streams, on_copy)
        self.shared = region

    def activate(self, image: ModelImage, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        self.shared.settle()
        took = super().activate(image, evict, keep)
        self.shared.settle()  # its copy, if this engine made it, is done: others may read it now
        return took

    def prefetch(self, image: ModelImage, keep: tuple[str, ...] | None = None) -> bool:
        self.shared.settle()
        return super().prefetch(image, keep)

    def ready_on_device(self, model: str) -> bool:
        self.shared.settle()
        return super().ready_on_device(model)

    def placement(self, model: str) -> Placement:
        # every step asks: a prefetch this engine made is marked ready for the others soon after it lands
        self.shared.settle()
        return super().placement(model)

    def places_of(self, nbytes: int) -> tuple[int, int]:
        raise NotImplementedError("a shared region has one place per model: see graph_places")

    def graph_places(self, images: list[ModelImage]) -> list[tuple[ModelImage, int]]:
        """Every model at its one offset (models of one shape sit at different offsets: a graph each)."""
        return [(image, self.shared.offset(image.name)) for image in images]

    def close(self) -> None:
        self.placed.clear()
        self.shared.close()

    def _check_size(self, image: ModelImage) -> None:
        self.shared.offset(image.name)  # refused when the region has no place for it

    def _offset(self, model: str, nbytes: int) -> int:
        return self.shared.offset(model)

    def _copy(self, image: ModelImage, offset: int) -> None:
        if self.shared.claim(image.name):
            super()._copy(image, offset)
            self.shared.copying(image.name, self.placed[image.name].ready)
            return
        self._num_loads += 1  # copied in by another engine, and complete: nothing to wait for
        self.placed[image.name] = Placement(offset, image.nbytes, None, self._num_loads)


