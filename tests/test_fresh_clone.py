"""What a user's clone sees: no ../shared beside it, no MODELPOOL_TRACES, an empty home and cache.

The repository's tracked files are copied to a temporary folder and the CLI runs from there, importing that
copy (PYTHONPATH): `modelpool simulate`, `modelpool capacity` (one policy, short), a trace given as a path, and
`modelpool traces` must all work with only what the repository ships. A wheel built from the copy must carry the
package data they read, and a non-editable install of it must simulate.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_DROP = ("MODELPOOL_TRACES", "MODELPOOL_TRACES_CACHE", "MODELPOOL_TRACES_MIRROR", "PYTHONPATH")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [name for name in out.stdout.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(copy of the repository, the environment of a user who has nothing else)."""
    base = tmp_path_factory.mktemp("fresh")
    root = base / "modelpool"
    for name in tracked_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes((REPO / name).read_bytes())
    (base / "home").mkdir()
    env = {key: value for key, value in os.environ.items() if key not in _DROP}
    env.update(HOME=str(base / "home"), PYTHONPATH=str(root), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled")
    return root, env


def modelpool(clone: tuple[Path, dict[str, str]], *args: str, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> str:
    root, user_env = clone
    out = subprocess.run([sys.executable, "-m", "modelpool.cli", *args], cwd=cwd or root, env=env or user_env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"modelpool {' '.join(args)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_the_copy_is_alone_and_imported(clone: tuple[Path, dict[str, str]]) -> None:
    root, env = clone
    assert not (root.parent / "shared").exists() and not (root / "../shared").exists()
    out = subprocess.run([sys.executable, "-c", "import sims, modelpool; print(sims.__file__, modelpool.__file__)"],
                         cwd=root, env=env, capture_output=True, text=True)
    assert out.stdout.split() == [str(root / "sims/__init__.py"), str(root / "modelpool/__init__.py")]


def test_simulate_with_no_arguments_but_a_short_duration(clone: tuple[Path, dict[str, str]]) -> None:
    out = modelpool(clone, "simulate", "--duration", "60")
    assert "token-level on 16 GPUs" in out and "completed / failed" in out


def test_capacity_one_policy_short(clone: tuple[Path, dict[str, str]]) -> None:
    root, _ = clone
    out = modelpool(clone, "capacity", "--policies", "dedicated", "--duration", "60", "--workers", "0",
                    "--out", "report")
    assert "wrote" in out and (root / "report/report.html").is_file()
    assert "ShareGPT pairs shipped in sims/data" in (root / "report/report.md").read_text()


def test_a_path_as_the_trace_and_the_traces_list(clone: tuple[Path, dict[str, str]]) -> None:
    assert "456 requests" in modelpool(clone, "simulate", "--trace", "examples/traces/sample.csv")
    listed = modelpool(clone, "traces")
    assert "shipped:" in listed and "not here: `modelpool traces fetch azure-conv`" in listed
    assert f"Looked in {clone[1]['HOME']}/.cache/modelpool/traces" in listed


def test_a_wheel_carries_the_package_data_and_simulates_installed(clone: tuple[Path, dict[str, str]],
                                                                 tmp_path: Path) -> None:
    root, env = clone
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(root)], env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "wheel").glob("modelpool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"sims/data/sharegpt_lengths.csv.gz", "sims/data/trace_files.json", "sims/data/SOURCE.md",
            "sims/profiles/default.json"} <= names
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                              str(tmp_path / "site"), str(wheel)], env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    (tmp_path / "elsewhere").mkdir()
    installed = {**env, "PYTHONPATH": str(tmp_path / "site")}
    where = subprocess.run([sys.executable, "-c", "import sims.trace_store as t; print(t.SHIPPED)"],
                           cwd=tmp_path / "elsewhere", env=installed, capture_output=True, text=True)
    assert where.stdout.strip() == str(tmp_path / "site/sims/data"), where.stderr
    out = modelpool(clone, "simulate", "--fleet", str(root / "models.yaml"), "--duration", "30",
                    cwd=tmp_path / "elsewhere", env=installed)
    assert "completed / failed" in out
