"""Where each model's weights sit in the engine's device model region, by the instance model.

Which models are resident (usable by compute), which one is active and which
one waits in the spare slot is decided by `scheduler.instance.ModelSlots`, the
rule the simulator's executor and every engine share: a switch to a resident
model or to the spare only changes roles, any other copies its host image in
one piece; `evict=False` keeps the models already resident beside it (spatial
co-location), within the region's bytes. This module places those copies in
the region: a copy goes flush against the region's start or end when the free
gap there holds it (so with two models held, as switching keeps it, the free
bytes stay one gap and each model has two places, for which CUDA graphs are
captured), else into the first gap that holds it. Copies run on the weight
stream after the compute queued so far (the old bytes may still be read);
compute waits on the copy's event. A copy is one host-to-device copy of the
whole image, at the link's full rate: the steps' small inputs do not queue
behind it on the copy engine, since a kernel reads them from pinned memory
(`device.InputStage`). (Copying in pieces with a kernel between them let them
in too, but halved the copy's rate while the other instance computed: the
kernel waits for the GPU's time slice; benchmarks/gpu_copy_hol.py.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pool.engines.base import EngineError
from pool.engines.device import ALIGN_BYTES, Streams, event_done, wait_event
from pool.engines.weights import ModelImage
from scheduler import ModelSlots as SlotRule
from scheduler import RefusedAction

@dataclass(slots=True)
class Placement:
    """One model's weights in the region: bytes [offset, offset + nbytes), the copy's event and its number."""

    offset: int
    nbytes: int
    ready: Any
    load: int  # names the copy: a later copy to the same offset has another number


class ModelSlots:
    def __init__(self, region: torch.Tensor, streams: Streams,
                 on_copy: Callable[[int], None] = lambda nbytes: None) -> None:
        self.region = region
        self.streams = streams
        self.on_copy = on_copy
        self.sizes: dict[str, float] = {}  # model -> bytes, of every model asked for so far
        self.rule = SlotRule(capacity_bytes=region.numel(), model_bytes=self.sizes)
        self.placed: dict[str, Placement] = {}
        self._images: dict[str, ModelImage] = {}  # the host image of each model copied in (a repack copies again)
        self._num_loads = 0

    @property
    def region_bytes(self) -> int:
        return self.region.numel()

    @property
    def active_model(self) -> str | None:
        return self.rule.active

    @property
    def prefetched(self) -> str | None:
        return self.rule.spare

    @property
    def resident(self) -> set[str]:
        return self.rule.resident

    def placement(self, model: str) -> Placement:
        """The placement of a resident `model` (EngineError when it is not resident)."""
        try:
            self.rule.require_resident(model, "compute")
        except RefusedAction as err:
            raise EngineError(str(err)) from None
        return self.placed[model]

    def ready_on_device(self, model: str) -> bool:
        where = self.placed.get(model)
        return where is not None and event_done(where.ready)

    def activate(self, image: ModelImage, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        """Make `image` active (`evict=False`: resident beside the others; `keep`: the cached models that stay);
        returns the seconds until its weights are usable."""
        start = time.perf_counter()
        self._apply(image, lambda: self.rule.switch(image.name, 0.0, evict, keep))
        event = self.placed[image.name].ready
        self.streams.compute_waits(event)
        wait_event(event)  # the caller is told when the weights are really there
        return time.perf_counter() - start

    def prefetch(self, image: ModelImage, keep: tuple[str, ...] | None = None) -> bool:
        """Start copying `image` in; False when there is nothing to copy."""
        return bool(self._apply(image, lambda: self.rule.prefetch(image.name, 0.0, keep)))

    def deactivate(self, model: str) -> None:
        self.rule.deactivate(model)  # the weights stay where they are, as the spare

    def drop(self, model: str) -> None:
        """Forget the device copy of a model that is not resident (its next activation copies it again)."""
        try:
            self.rule.drop(model)
        except RefusedAction as err:
            raise EngineError(str(err)) from None
        self._free_unheld()

    def places_of(self, nbytes: int) -> tuple[int, int]:
        """The two offsets a copy of `nbytes` takes when the region holds at most one other model."""
        return 0, (self.region_bytes - nbytes) // ALIGN_BYTES * ALIGN_BYTES

    def graph_places(self, images: list[ModelImage]) -> list[tuple[ModelImage, int]]:
        """(image, offset) of every place decode graphs are captured for: each shape in both its places."""
        shapes = {(image.spec, image.dtype): image for image in images}
        return [(image, offset) for image in shapes.values() for offset in self.places_of(image.nbytes)]

    def close(self) -> None:
        """The engine is done with its model region (its own buffer: nothing to give back here)."""

    # ---- internals ----------------------------------------------------------------------
    def _check_size(self, image: ModelImage) -> None:
        if image.nbytes > self.region_bytes // 2:
            raise EngineError(f"model {image.name!r} needs {image.nbytes} bytes but a model slot has "
                              f"{self.region_bytes // 2}; raise max_model_bytes")

    def _apply(self, image: ModelImage, change: Callable[[], Any]) -> Any:
        """Run the rule's `change`, free what it no longer holds and copy `image` in when it is held but not
        placed; on a refusal nothing changes."""
        self._check_size(image)
        self.sizes[image.name] = float(image.nbytes)
        rule = self.rule
        before = rule.snapshot()
        try:
            result = change()
            self._free_unheld()
            if image.name in rule.held() and image.name not in self.placed:
                try:
                    offset = self._offset(image.name, image.nbytes)
                except _NoGap:
                    offset = self._repack(image)
                self._copy(image, offset)
        except (RefusedAction, EngineError) as err:
            rule.restore(before)
            raise EngineError(str(err)) from None
        return result

    def _free_unheld(self) -> None:
        held = set(self.rule.held())
        for model in [m for m in self.placed if m not in held]:
            del self.placed[model]  # later copies over it are ordered after the compute queued (after_compute)

    def _offset(self, model: str, nbytes: int) -> int:
        """Flush against the region's start or end when that gap holds it, else the first gap that does."""
        taken = sorted((p.offset, p.offset + p.nbytes) for p in self.placed.values())
        gaps, at = [], 0
        for start, end in taken:
            if start > at:
                gaps.append((at, start))
            at = max(at, end)
        if at < self.region_bytes:
            gaps.append((at, self.region_bytes))
        low, high = self.places_of(nbytes)
        if gaps and gaps[0][0] == 0 and gaps[0][1] >= nbytes:
            return low
        if gaps and gaps[-1][1] == self.region_bytes and gaps[-1][0] <= high:
            return high
        for start, end in gaps:
            offset = -(-start // ALIGN_BYTES) * ALIGN_BYTES
            if offset + nbytes <= end:
                return offset
        raise _NoGap(f"model {model!r} ({nbytes} bytes) finds no free gap in the model region beside "
                     f"{ {m: (p.offset, p.nbytes) for m, p in self.placed.items()} }")

    def _repack(self, image: ModelImage) -> int:
        """The models held fit the region (the rule said so) but no gap holds `image`: the region is fragmented
        (a plan's `keep` sets free models in any order). Place every model held again, packed from the region's
        start (resident ones first), copying each in from its host image; returns the offset left for `image`.
        Compute waits for the resident models' new copies (a cached one's activation waits for its own)."""
        order = [m for m in self.rule.held() if m in self.placed]
        self.placed.clear()
        at = 0
        for model in order:
            self._copy(self._images[model], at)
            if model in self.rule.resident:
                self.streams.compute_waits(self.placed[model].ready)
            at = -(-(at + self._images[model].nbytes) // ALIGN_BYTES) * ALIGN_BYTES
        if at + image.nbytes > self.region_bytes:
            raise EngineError(f"model {image.name!r} ({image.nbytes} bytes) does not fit the model region beside "
                              f"{order} even packed ({at} of {self.region_bytes} bytes taken)")
        return at

    def _copy(self, image: ModelImage, offset: int) -> None:
        weights = self.streams.weights
        self.streams.after_compute(weights)
        with self.streams.on(weights):
            self.region[offset : offset + image.nbytes].copy_(image.buffer, non_blocking=True)
        self._num_loads += 1
        self.placed[image.name] = Placement(offset, image.nbytes, self.streams.record(weights), self._num_loads)
        self._images[image.name] = image
        self.on_copy(image.nbytes)


class _NoGap(EngineError):
    """No free gap of the model region holds a model whose bytes fit (the region is fragmented)."""
