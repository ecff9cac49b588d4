"""scheduler/ is pure: no I/O, no clock reads, no global randomness, no framework imports."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALLOWED_TOP = {"__future__", "collections", "dataclasses", "enum", "json", "math", "random", "typing", "heapq",
               "itertools", "functools", "bisect", "operator", "abc", "numbers", "statistics", "pydantic", "numpy",
               "scheduler",
               "mypy_extensions"}  # mypyc_attr only: a no-op class decorator unless compiled
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval"}


def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_scheduler_imports_only_stdlib_pure_modules_pydantic_and_numpy() -> None:
    bad = {}
    for path in sorted((ROOT / "scheduler").rglob("*.py")):
        extra = _imports(ast.parse(path.read_text())) - ALLOWED_TOP
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert bad == {}


def test_scheduler_calls_no_io_and_no_global_random() -> None:
    bad = []
    for path in sorted((ROOT / "scheduler").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
                bad.append(f"{path.name}:{node.lineno} {func.id}()")
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "random"
                    and func.attr != "Random"):
                bad.append(f"{path.name}:{node.lineno} random.{func.attr}()")
    assert bad == []


def test_importing_scheduler_pulls_in_no_framework() -> None:
    code = ("import sys, scheduler, scheduler.policies; "
            "bad = [m for m in ('ray','vllm','fastapi','torch','uvicorn','httpx','yaml','sims','pool','modelpool') "
            "if m in sys.modules]; print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_dependencies_point_one_way() -> None:
    """pool -> scheduler <- sims: neither pool nor sims imports the other."""
    for package, other in (("pool", "sims"), ("sims", "pool")):
        for path in sorted((ROOT / package).rglob("*.py")):
            assert other not in _imports(ast.parse(path.read_text())), f"{path.relative_to(ROOT)} imports {other}"
