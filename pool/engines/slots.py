"""Which model's weights sit in which of the two device model slots.

One slot holds the current model; the other holds a prefetched model (or the
previously current one, kept as a free cache hit). Activating a model that is
already in a slot only changes roles; otherwise its host image is copied into
a slot in one piece. Copies run on the weight stream after the compute queued
so far (the slot may still be read by it); compute waits on the copy's event.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pool.engines.base import EngineError
from pool.engines.device import Streams, event_done, wait_event
from pool.engines.weights import ModelImage


class ModelSlots:
    def __init__(self, slots: list[torch.Tensor], streams: Streams,
                 on_copy: Callable[[int], None] = lambda nbytes: None) -> None:
        self.slots = slots
        self.streams = streams
        self.on_copy = on_copy
        self.holder: list[str | None] = [None] * len(slots)
        self.ready: list[Any] = [None] * len(slots)  # event of the copy into each slot
        self.loads: list[int] = [0] * len(slots)  # copies into each slot so far (names the weights there)
        self.current: int | None = None
        self.prefetched: str | None = None  # copied (or copying) ahead of its activation

    @property
    def slot_bytes(self) -> int:
        return self.slots[0].numel()

    @property
    def active_model(self) -> str | None:
        return None if self.current is None else self.holder[self.current]

    def find(self, model: str) -> int | None:
        return next((i for i, name in enumerate(self.holder) if name == model), None)

    def ready_on_device(self, model: str) -> bool:
        slot = self.find(model)
        return slot is not None and event_done(self.ready[slot])

    def activate(self, image: ModelImage) -> tuple[float, int]:
        """Make `image` current; returns (seconds until its weights are usable, slot)."""
        start = time.perf_counter()
        slot = self.find(image.name)
        if slot is None:
            slot = self._victim(protect=self.prefetched)
            self._copy(image, slot)
        event = self.ready[slot]
        self.streams.compute_waits(event)
        wait_event(event)  # the caller is told when the weights are really there
        self.current = slot
        if self.prefetched == image.name:
            self.prefetched = None
        return time.perf_counter() - start, slot

    def prefetch(self, image: ModelImage) -> bool:
        """Start copying `image` into the spare slot; False when it is already resident."""
        if self.find(image.name) is not None:
            if self.active_model != image.name:
                self.prefetched = image.name
            return False
        slot = self._victim(protect=self.active_model)
        self._copy(image, slot)
        self.prefetched = image.name
        return True

    def deactivate(self, model: str) -> None:
        if self.active_model == model:
            self.current = None  # weights stay in the slot as a cache

    def drop(self, model: str) -> None:
        """Forget the device copy of an inactive model (its next activation copies it again)."""
        if self.active_model == model:
            raise EngineError(f"model {model!r} is active; deactivate it first")
        slot = self.find(model)
        if slot is not None:
            wait_event(self.ready[slot])
            self.holder[slot], self.ready[slot] = None, None
        if self.prefetched == model:
            self.prefetched = None

    def _victim(self, protect: str | None) -> int:
        """A slot to overwrite: an empty one, else one not holding `protect`, preferring the spare."""
        order = sorted(range(len(self.slots)), key=lambda i: (self.holder[i] is not None, i == self.current))
        for i in order:
            if self.holder[i] is None or self.holder[i] != protect:
                return i
        raise EngineError(f"no model slot free: both hold {protect!r}")

    def _copy(self, image: ModelImage, slot: int) -> None:
        if image.nbytes > self.slot_bytes:
            raise EngineError(
                f"model {image.name!r} needs {image.nbytes} bytes but a model slot has {self.slot_bytes}; "
                "raise max_model_bytes"
            )
        if self.holder[slot] == self.prefetched:
            self.prefetched = None
        weights = self.streams.weights
        self.streams.after_compute(weights)
        with self.streams.on(weights):
            self.slots[slot][: image.nbytes].copy_(image.buffer, non_blocking=True)
        self.ready[slot] = self.streams.record(weights)
        self.holder[slot] = image.name
        self.loads[slot] += 1
        self.on_copy(image.nbytes)
