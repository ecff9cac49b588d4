"""Opt-in mypyc build: `MODELPOOL_MYPYC=1 pip install --no-build-isolation .` compiles the simulator's hot path.

pyproject.toml holds the metadata; this file only adds the extension modules, and only when asked, so the
default install stays pure Python, and an editable one always does. The compiled modules make the same decisions
(tests/sims/test_compiled.py compares Plan logs byte for byte), ~6x faster under token-level (1M requests: 46.1 s
of event-loop CPU against 292.9 s pure; ~4x under dedicated: BENCHMARKS.md, "Simulator speed").
`compiled_copy` builds the same modules in a copy of the tree, for that test and benchmarks/sim_speed.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# The modules the event loop spends its time in. Exceptions live in uncompiled scheduler/errors.py and
# sims/errors.py (mypyc cannot subclass builtin exceptions).
MYPYC_MODULES = [
    "scheduler/plan.py", "scheduler/request.py", "scheduler/quotas.py", "scheduler/costs.py", "scheduler/instance.py",
    "scheduler/policies/base.py", "scheduler/policies/dedicated.py", "scheduler/policies/request_level.py",
    "scheduler/policies/spatial.py", "scheduler/policies/token_level.py", "scheduler/policies/token_prefill.py",
    "scheduler/policies/token_decode.py",
    "sims/simulator.py", "sims/costmodel.py",
]
_TREE = ["scheduler", "sims", "modelpool", "pool", "pyproject.toml", "README.md", "setup.py"]  # what a build reads


def ext_modules() -> list:
    from mypyc.build import mypycify

    return mypycify(MYPYC_MODULES, opt_level="3")


def compiled_copy(dest: Path) -> Path:
    """Copy the packages to `dest` and compile MYPYC_MODULES there in place; return `dest`."""
    for name in _TREE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(ROOT / name, dest / name)
    out = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest, capture_output=True,
                         text=True, env={**os.environ, "MODELPOOL_MYPYC": "1"})
    if out.returncode:
        raise RuntimeError(f"mypyc build failed:\n{(out.stdout + out.stderr)[-4000:]}")
    return dest


if __name__ == "__main__":
    compile_ = os.environ.get("MODELPOOL_MYPYC") == "1"
    if compile_ and "editable_wheel" in sys.argv:
        sys.exit("MODELPOOL_MYPYC=1 is for `pip install .`: an editable install would leave compiled modules in "
                 "the source tree, shadowing edits to them")
    setup(ext_modules=ext_modules() if compile_ else [])
