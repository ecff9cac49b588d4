"""Reading models.yaml: the one function that turns a fleet file into a `Fleet`.

Every problem is reported, each with the file, line and column, the field's
dotted path and the bad value, e.g.
`models.yaml:41:9: models[3].tp: tp 1 does not fit 'qwen-72b' on h20 ... (got 1)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from scheduler.fleet import Fleet, FleetProblem, GpuSpec, ModelEntry, PoolSpec, arch_from_hf_config, fleet_problems

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    column: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.field}: {self.message}"


class FleetFileError(ValueError):
    """A fleet file with one or more problems; `problems` lists each with its place."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(map(str, problems)))


def load_fleet(path: str | Path) -> Fleet:
    """Read, resolve (catalogue keys, local config.json folders) and validate a fleet file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FleetFileError([Problem(str(path), 0, 0, "(file)", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        raise FleetFileError([Problem(str(path), data.count(b"\n", 0, exc.start) + 1, exc.start - line_start + 1,
                                      "(file)", f"not UTF-8 text: byte {data[exc.start]:#04x}")]) from None
    return parse_fleet(text, str(path), base_dir=path.parent)


def parse_fleet(text: str, source: str = "<fleet>", base_dir: Path | None = None) -> Fleet:
    lines: dict[Loc, tuple[int, int]] = {}
    problems: list[Problem] = []
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        raise FleetFileError([Problem(source, line, col, "(yaml)", str(getattr(exc, "problem", exc)))]) from None
    if node is None:
        raise FleetFileError([Problem(source, 1, 1, "(file)", "empty fleet file; it needs at least `models:`")])
    data = _NodeReader(source, lines, problems).read(node, ())
    if not isinstance(data, dict):
        raise FleetFileError([Problem(source, 1, 1, "(file)", f"the top level must be a mapping, got {type(data).__name__}")])
    _resolve_arch_folders(data, base_dir or Path("."), lines, problems, source)
    if problems:
        raise FleetFileError(problems)
    try:
        return Fleet.model_validate(data)
    except ValidationError as exc:
        problems = _problems_from(exc, data, lines, source)
        problems += _whole_fleet_problems(data, lines, source, problems)
        raise FleetFileError(sorted(problems, key=lambda p: (p.line, p.column))) from None


def _whole_fleet_problems(data: dict[str, Any], lines: dict[Loc, tuple[int, int]], source: str,
                          found: list[Problem]) -> list[Problem]:
    """Cross-entry checks over the parts that passed field validation (pydantic skips them otherwise)."""
    try:  # unknown keys are reported already; judge the rest
        pool = PoolSpec.model_validate({k: v for k, v in (data.get("pool") or {}).items() if k in PoolSpec.model_fields})
        gpus = {k: GpuSpec.model_validate(v) for k, v in (data.get("gpus") or {}).items()}
    except (ValidationError, AttributeError):
        return []
    entries: list[tuple[int, ModelEntry]] = []
    models = data.get("models")
    for index, raw in enumerate(models if isinstance(models, list) else []):
        try:
            entries.append((index, ModelEntry.model_validate(raw)))
        except ValidationError:
            continue
    known = {(p.line, p.field) for p in found}
    out = [_problem(source, loc, f"{msg} (got {_value_at(data, loc)!r})", lines)
           for loc, msg in fleet_problems(pool, gpus, entries)]
    return [p for p in out if (p.line, p.field) not in known]


MAX_NODES = 100_000  # aliases can expand a few lines into billions of nodes


class _NodeReader:
    """YAML nodes to Python values, remembering each value's line and column; bad nodes become problems."""

    def __init__(self, source: str, lines: dict[Loc, tuple[int, int]], problems: list[Problem]) -> None:
        self.source, self.lines, self.problems = source, lines, problems
        self.scalars = yaml.constructor.SafeConstructor()
        self.num_nodes = 0
        self.open: set[int] = set()  # ids of the collections being read: an alias back to one is a cycle

    def problem(self, node: yaml.Node, loc: Loc, message: str) -> None:
        self.problems.append(Problem(self.source, node.start_mark.line + 1, node.start_mark.column + 1,
                                     _dotted(loc), message))

    def read(self, node: yaml.Node, loc: Loc) -> Any:
        self.lines[loc] = (node.start_mark.line + 1, node.start_mark.column + 1)
        self.num_nodes += 1
        if self.num_nodes > MAX_NODES:
            if self.num_nodes == MAX_NODES + 1:
                self.problem(node, loc, f"more than {MAX_NODES} values (aliases expanding?)")
            return None
        if isinstance(node, yaml.ScalarNode):
            try:
                return self.scalars.construct_object(node, deep=True)
            except Exception as exc:  # noqa: BLE001 - PyYAML's constructors raise anything for a bad tagged value (`!!int`: IndexError)
                self.problem(node, loc, f"unreadable value {node.value[:40]!r}: {getattr(exc, 'problem', exc)}")
                return None
        if id(node) in self.open:
            self.problem(node, loc, "an alias that contains itself")
            return None
        self.open.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                return [self.read(child, loc + (i,)) for i, child in enumerate(node.value)]
            return self._mapping(node, loc)
        finally:
            self.open.discard(id(node))

    def _mapping(self, node: yaml.MappingNode, loc: Loc) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.problem(key_node, loc, "a key must be plain text, not a list or mapping")
                continue
            key = key_node.value
            if key in out:
                self.problem(key_node, loc + (key,), f"duplicate key {key!r}")
                continue
            out[key] = self.read(value_node, loc + (key,))
            self.lines[loc + (key,)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
        return out


def _resolve_arch_folders(data: dict[str, Any], base_dir: Path, lines: dict[Loc, tuple[int, int]],
                          problems: list[Problem], source: str) -> None:
    """`arch: ./some/folder` (a path) becomes the architecture in its config.json."""
    models = data.get("models")
    if not isinstance(models, list):
        return
    for index, entry in enumerate(models):
        arch = entry.get("arch") if isinstance(entry, dict) else None
        if not isinstance(arch, str) or not ("/" in arch or arch.startswith(".")):
            continue
        folder = (base_dir / arch).expanduser()
        try:
            entry["arch"] = arch_from_hf_config(json.loads((folder / "config.json").read_text()))
            entry.setdefault("arch_name", arch)
        except (OSError, ValueError, KeyError) as exc:
            line, col = lines.get(("models", index, "arch"), (0, 0))
            problems.append(Problem(source, line, col, f"models[{index}].arch",
                                    f"cannot read {folder / 'config.json'}: {exc} (got {arch!r})"))


def _problems_from(exc: ValidationError, data: dict[str, Any], lines: dict[Loc, tuple[int, int]],
                   source: str) -> list[Problem]:
    out: list[Problem] = []
    for err in exc.errors():
        fleet_problem = (err.get("ctx") or {}).get("error")
        if isinstance(fleet_problem, FleetProblem):
            for loc, msg in fleet_problem.problems:
                out.append(_problem(source, loc, f"{msg} (got {_value_at(data, loc)!r})", lines))
            continue
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {loc[-1]!r}" + _known_keys_hint(loc)
        elif err["type"] != "missing":
            msg = f"{msg} (got {err.get('input')!r})"
        out.append(_problem(source, loc, msg, lines))
    return out


def _known_keys_hint(loc: Loc) -> str:
    from scheduler.fleet import Arch, ModelEntry, PoolSpec, Slo, Traffic

    parents: dict[str, type[BaseModel]] = {"pool": PoolSpec, "arch": Arch, "slo": Slo, "default_slo": Slo, "traffic": Traffic}
    parent = next((str(p) for p in reversed(loc[:-1]) if isinstance(p, str)), None)
    cls = parents.get(parent or "") or (ModelEntry if len(loc) == 3 and loc[0] == "models" else Fleet if len(loc) == 1 else None)
    return f"; allowed: {', '.join(cls.model_fields)}" if cls else ""


def _problem(source: str, loc: Loc, msg: str, lines: dict[Loc, tuple[int, int]]) -> Problem:
    probe = loc
    while probe and probe not in lines:
        probe = probe[:-1]
    line, col = lines.get(probe, (0, 0))
    return Problem(source, line, col, _dotted(loc), msg)


def _value_at(data: Any, loc: Loc) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"
