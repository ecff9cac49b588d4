"""A capacity planner's install: the base dependencies without the `serve` extra (issue 36 item 4).

Each CLI run below is a fresh interpreter whose imports of the serve-only packages fail as if they were not
installed (a `sys.meta_path` finder raising ModuleNotFoundError): `simulate` and `capacity` must still run, and
`serve` must stop with an error naming the missing package and the extra to install.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from modelpool.extras import SERVE_PACKAGES
from tests.sims.test_capacity import TINY_FLEET

REPO = Path(__file__).resolve().parents[1]
# import name -> distribution: the packages the live pool needs and the simulator must not
SERVE_ONLY = {"torch": "torch", "ray": "ray", "vllm": "vllm", "fastapi": "fastapi", "starlette": "starlette",
              "uvicorn": "uvicorn", "transformers": "transformers", "safetensors": "safetensors",
              "prometheus_client": "prometheus-client"}

CLI = """
import importlib.abc, sys

BLOCKED = set(sys.argv[1].split(","))


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
from modelpool.cli import app

try:
    app(sys.argv[2:], prog_name="modelpool")
finally:
    leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    print("imported serve-only modules:", leaked or "none")
"""


def modelpool(cwd: Path, *args: str,
              blocked: frozenset[str] = frozenset(SERVE_ONLY)) -> subprocess.CompletedProcess[str]:
    """`modelpool ARGS` run in `cwd` by an interpreter that cannot import `blocked`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", CLI, ",".join(sorted(blocked)), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture()
def fleet(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_FLEET)
    return path


def test_the_base_dependencies_hold_no_serve_only_package_and_the_serve_extra_has_them() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
                for r in requirements}

    assert names(project["dependencies"]) & set(SERVE_ONLY.values()) == set()
    assert names(project["optional-dependencies"]["serve"]) >= set(SERVE_ONLY.values()) - {"vllm", "starlette"}


def test_simulate_runs_without_the_serve_extra(fleet: Path) -> None:
    run = modelpool(fleet.parent, "simulate", "--fleet", str(fleet), "--duration", "20", "--gpus", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "attainment" in run.stdout.lower()
    assert "imported serve-only modules: none" in run.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["validate", "tiny.yaml"], "OK: tiny.yaml is valid"),
    (["schema"], '"title": "modelpool fleet (models.yaml)"'),
    (["estimate", "--model", "qwen2.5-7b", "--gpu", "h200"], "qwen2.5-7b"),
    (["traces"], "fetch"),
], ids=["validate", "schema", "estimate", "traces"])
def test_the_other_planning_commands_run_without_the_serve_extra(fleet: Path, args: list[str], says: str) -> None:
    run = modelpool(fleet.parent, *args)
    assert run.returncode == 0, run.stdout + run.stderr
    assert says in run.stdout
    assert "imported serve-only modules: none" in run.stdout


def test_capacity_runs_in_one_process_without_ray(fleet: Path) -> None:
    out = fleet.parent / "report"
    run = modelpool(fleet.parent, "capacity", "--fleet", str(fleet), "--duration", "20", "--policies", "token-level",
                    "--what-if-tpot", "0", "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Ray is not installed: every simulation runs in this process" in run.stdout
    assert (out / "report.json").is_file() and (out / "report.html").is_file()
    assert "imported serve-only modules: none" in run.stdout
    run = modelpool(fleet.parent, "capacity", "--fleet", str(fleet), "--duration", "20", "--workers", "2")
    assert run.returncode == 1
    assert "pip install 'modelpool[ray]', or --workers 0" in run.stderr


@pytest.mark.parametrize("blocked", [frozenset(SERVE_ONLY), frozenset({"torch"})], ids=["no-extra", "no-torch"])
def test_serve_without_the_extra_names_what_is_missing_and_the_extra(fleet: Path, blocked: frozenset[str]) -> None:
    run = modelpool(fleet.parent, "serve", "--engine", "sim", "--fleet", str(fleet), blocked=blocked)
    assert run.returncode == 1
    missing = ", ".join(sorted(blocked & SERVE_PACKAGES))
    assert f"error: modelpool serve needs {missing}, not installed here: pip install 'modelpool[serve]'" in run.stderr
    assert "Traceback" not in run.stderr
