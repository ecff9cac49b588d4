"""The torch engine's own model region under a plan's resident sets (`keep`): every set the instance model
accepts is placed, even when freeing models in any order has fragmented the region (the held models are then
packed again from their host images), and every model held reads its own bytes."""

from __future__ import annotations

import random

import pytest
import torch

from pool.engines.base import EngineError
from pool.engines.device import Streams
from pool.engines.slots import ModelSlots


class _Image:
    """What the slots read of a model image: its name, size (whole 256-byte units, as `ModelImage` pads its
    tensors) and host bytes (each model a value of its own)."""

    def __init__(self, name: str, nbytes: int, value: int) -> None:
        self.name, self.nbytes = name, nbytes
        self.buffer = torch.full((nbytes,), value, dtype=torch.uint8)


@pytest.mark.parametrize("seed", range(3))
def test_every_resident_set_the_rule_accepts_is_placed_and_reads_its_own_bytes(seed: int) -> None:
    rng = random.Random(seed)
    images = {f"m{k}": _Image(f"m{k}", rng.choice([256, 512, 768, 1024]), k + 1) for k in range(6)}
    region = torch.zeros(2048, dtype=torch.uint8)
    placed = refused = 0
    for _ in range(40):
        slots = ModelSlots(region, Streams(torch.device("cpu")))
        for _ in range(30):
            model = rng.choice(list(images))
            held = [m for m in slots.rule.held() if m != model]
            keep = tuple(rng.sample(held, rng.randint(0, len(held))))
            try:
                slots.activate(images[model], True, keep)  # type: ignore[arg-type]
            except EngineError as err:
                assert "model region holds" in str(err), err  # only the rule refuses: never a lack of a gap
                refused += 1
                continue
            placed += 1
            assert set(slots.placed) == set(slots.rule.held())
            for name, where in slots.placed.items():
                got = region[where.offset: where.offset + where.nbytes]
                assert bool((got == images[name].buffer).all()), f"{name} at {where.offset} reads other bytes"
    assert placed > 10 * refused > 0
