"""`serve --layout`: the instance roles a capacity report recommends (or given by hand), for the live pool.

`modelpool capacity` searches token-level's prefill/decode split (and all-mixed layouts) per TP class and
writes the answer into report.json (`policies.<policy>.layout`: per TP class, prefill / decode / mixed counts).
`serve --layout report.json` serves with the roles of that answer; `--layout 1P+2D` (the report's own label
form: P prefill, D decode, M mixed, joined by +) gives them by hand. Without it serve cuts its instances by the
fleet's `prefill_fraction`. `simulate --layout` takes a whole pool's cut the same ways (`pool_layouts`: the report,
or `TP1:4P+4D,TP2:2M,TP4:1M`), so a capacity answer can be simulated as one pool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from scheduler.costs import Role

if TYPE_CHECKING:
    from sims.capacity_eval import Layout

_PART = re.compile(r"^(\d+)([PDM])$")
_ROLE: dict[str, Role] = {"P": "prefill", "D": "decode", "M": "mixed"}


class LayoutError(ValueError):
    """A --layout that cannot be read; the message names what was wrong and where."""


def layout_roles(value: str, policy: str = "token-level", tp: int = 1) -> list[Role]:
    """Instance roles, prefill first, then decode, then mixed: from a report JSON path or a `1P+2D` spec."""
    path = Path(value)
    if path.suffix == ".json" or path.is_file():
        return _from_report(path, policy, tp)
    return _from_spec(value)


def _from_spec(spec: str) -> list[Role]:
    counts = {"P": 0, "D": 0, "M": 0}
    text = re.sub(r"^TP\d+:", "", spec.replace(" ", "").upper())  # the report's label: "TP1: 4P+5D"
    for part in text.split("+"):
        match = _PART.match(part)
        if not match:
            raise LayoutError(f"--layout {spec!r}: {part!r} is not a count and a role (e.g. 1P+2D, 3M; "
                              "P prefill, D decode, M mixed), nor a report JSON file")
        counts[match.group(2)] += int(match.group(1))
    roles = [_ROLE[key] for key in "PDM" for _ in range(counts[key])]
    if not roles:
        raise LayoutError(f"--layout {spec!r}: no instances")
    if counts["P"] and not (counts["D"] or counts["M"]) or counts["D"] and not (counts["P"] or counts["M"]):
        raise LayoutError(f"--layout {spec!r}: prefill instances need decode (or mixed) ones and the other way round")
    return roles


def _report_entry(path: Path, policy: str) -> dict:
    """The `policy` answer of a capacity report JSON (with its layout), or a LayoutError saying what is wrong."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LayoutError(f"--layout {path}: cannot read a capacity report: {exc}") from None
    entry = (report.get("policies") or {}).get(policy) if isinstance(report, dict) else None
    if not isinstance(entry, dict) or not entry.get("layout"):
        raise LayoutError(f"--layout {path}: the report has no layout for policy {policy!r} "
                          f"(policies: {sorted((report.get('policies') or {}) if isinstance(report, dict) else [])})")
    return entry


def _from_report(path: Path, policy: str, tp: int) -> list[Role]:
    entry = _report_entry(path, policy)
    for cls in entry["layout"]:
        if cls.get("tp") == tp:
            spec = "+".join(f"{cls.get(k, 0)}{k[0].upper()}" for k in ("prefill", "decode", "mixed") if cls.get(k))
            return _from_spec(spec)
    raise LayoutError(f"--layout {path}: the {policy} answer has no TP{tp} class "
                      f"(it has TP {sorted(c.get('tp') for c in entry['layout'])})")


def pool_layouts(value: str, policy: str, tps: Sequence[int]) -> list[Layout]:
    """A whole pool's cut, every TP class of the fleet (`tps`): from a capacity report JSON (the `policy` answer's
    layout, dedicated's replicas too) or `TP1:4P+4D,TP2:2M,TP4:1M` (`simulate --layout`)."""
    from sims.capacity_eval import Layout

    path = Path(value)
    if path.suffix == ".json" or path.is_file():
        entry = _report_entry(path, policy)
        layouts = []
        for cls in entry["layout"]:
            if cls.get("replicas"):
                layouts.append(Layout(int(cls["tp"]), replicas=tuple(sorted(cls["replicas"].items()))))
            else:
                layouts.append(Layout(int(cls["tp"]), prefill=int(cls.get("prefill", 0)),
                                      decode=int(cls.get("decode", 0)), mixed=int(cls.get("mixed", 0))))
        where = f"--layout {path} ({policy})"
    else:
        layouts = []
        for part in (p for p in value.replace(" ", "").upper().split(",") if p):
            match = re.match(r"^TP(\d+):(.+)$", part)
            if not match:
                raise LayoutError(f"--layout {value!r}: {part!r} is not TPn:ROLES (e.g. TP1:4P+4D,TP2:2M; P prefill, "
                                  "D decode, M mixed), nor a capacity report JSON file")
            try:
                roles = _from_spec(match.group(2))
            except LayoutError as exc:  # name the whole value and the class, not the class's part alone
                raise LayoutError(f"--layout {value!r}: TP{match.group(1)}: "
                                  f"{str(exc).split(': ', 1)[1]}") from None
            layouts.append(Layout(int(match.group(1)), roles.count("prefill"), roles.count("decode"),
                                  roles.count("mixed")))
        where = f"--layout {value!r}"
    given = sorted(layout.tp for layout in layouts)
    if given != sorted(set(tps)):
        raise LayoutError(f"{where}: gives TP classes {given}, the fleet's models need exactly TP {sorted(set(tps))}")
    if policy != "dedicated" and any(layout.replicas for layout in layouts):
        raise LayoutError(f"{where}: per-model replicas are dedicated's; {policy} takes P/D/M instances")
    if policy != "token-level" and any(layout.prefill or layout.decode for layout in layouts):
        raise LayoutError(f"{where}: prefill/decode instances are token-level's; {policy} takes mixed ones (M)")
    return sorted(layouts, key=lambda layout: layout.tp)
