"""The optional installs: whether a package is importable here, and the error that names the `serve` extra.

A capacity planner installs modelpool without the live pool's packages (`simulate`, `capacity` and
`estimate` run without them); `serve` and `calibrate` stop at once naming every missing one.
"""

from __future__ import annotations

import importlib.util
from typing import NoReturn

import typer

SERVE_EXTRA = "pip install 'modelpool[serve]'"
# what the live pool imports that the simulator does not (the `serve` extra; ray is optional: --backend processes)
SERVE_PACKAGES = frozenset({"torch", "fastapi", "starlette", "uvicorn", "transformers", "tokenizers", "safetensors",
                            "prometheus_client"})


def installed(name: str) -> bool:
    """Whether the top-level package `name` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a broken install, or a test's import blocker
        return False


def missing_serve_extra(exc: ModuleNotFoundError) -> NoReturn:
    """Exit naming every package of the `serve` extra that is not installed and how to install them; an import
    that fails for another reason (a module of our own missing) is re-raised as it is."""
    root = (exc.name or "").partition(".")[0]
    if root not in SERVE_PACKAGES:
        raise exc
    missing = sorted({root, *(name for name in SERVE_PACKAGES if not installed(name))})
    typer.echo(f"error: modelpool serve needs {', '.join(missing)}, not installed here: {SERVE_EXTRA} (on a "
               "machine without a GPU install torch's CPU wheel first, or take 'modelpool[serve,cpu]')", err=True)
    raise typer.Exit(1) from None
