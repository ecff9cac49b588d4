"""The opt-in mypyc build (setup.py) decides exactly what the pure-Python tree does.

The hot modules are compiled in a copy of the tree, with setup.py's own build; the same simulations then
run in one process per tree, and their Plan logs and metrics must be byte-identical.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("token-level", "dedicated", "request-level", "spatial")

# Runs in the tree given as the working directory: which files the compiled modules came from, then per policy
# the Plan log and the metrics of the shipped fleet's own traffic (about 2,000 requests) on 64 GPUs.
_SIMULATE = """
import importlib, io, json, sys
from modelpool.config import load_fleet
from sims.run import fleet_workload_spec, simulate
from sims.traces import load_workload

modules, fleet_path, policies = sys.argv[1].split(","), sys.argv[2], sys.argv[3].split(",")
files = {name: importlib.import_module(name).__file__ for name in modules}
fleet = load_fleet(fleet_path)
workload = load_workload(fleet_workload_spec(fleet, 200.0), [m.name for m in fleet.models], seed=0)
runs = {}
for policy in policies:
    log = io.StringIO()
    result = simulate(fleet, workload, policy, num_gpus=64, plan_log=log)
    segments = [s for r in result.records.values() for s in r.segments]
    runs[policy] = {"plans": log.getvalue(), "metrics": json.dumps(result.metrics, sort_keys=True, default=repr),
                    # the requests of one step share one segment tuple (kept in memory for every request)
                    "segments": len(segments), "segment_objects": len({id(s) for s in segments})}
print(json.dumps({"files": files, "requests": len(workload), "runs": runs}))
"""


def _simulate(tree: Path, modules: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}  # ShareGPT lengths: package data
    return subprocess.Popen([sys.executable, "-c", _SIMULATE, ",".join(modules), str(ROOT / "models.yaml"),
                             ",".join(POLICIES)], cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


def test_compiled_build_gives_byte_identical_plan_logs_and_metrics(tmp_path: Path) -> None:
    if importlib.util.find_spec("mypyc") is None:
        pytest.skip("mypyc is not installed (it comes with mypy)")
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler (gcc) on PATH")
    setup = runpy.run_path(str(ROOT / "setup.py"))  # not as __main__: defines, builds nothing
    modules = [path.removesuffix(".py").replace("/", ".") for path in setup["MYPYC_MODULES"]]
    tree = setup["compiled_copy"](tmp_path / "compiled")

    compiled, pure = _simulate(tree, modules), _simulate(ROOT, modules)  # side by side: 2 cores
    compiled_out, pure_out = _result(compiled), _result(pure)

    for name in modules:
        assert Path(compiled_out["files"][name]).is_relative_to(tree), name
        assert compiled_out["files"][name].endswith(".so"), f"{name} was not compiled"
        assert pure_out["files"][name].endswith(".py"), name
    assert compiled_out["requests"] == pure_out["requests"] > 1000
    for policy in POLICIES:
        ours, theirs = compiled_out["runs"][policy], pure_out["runs"][policy]
        assert theirs["plans"].count("\n") > 1000, policy
        assert ours["plans"] == theirs["plans"], f"{policy}: the Plan logs differ"
        assert ours["metrics"] == theirs["metrics"], f"{policy}: the metrics differ"
        # compiled code must not box a segment anew for each request (it did: 40% more memory)
        assert ours["segments"] == theirs["segments"] > ours["segment_objects"] == theirs["segment_objects"], policy
