"""`serve --layout`: the roles of a capacity report's answer, or a spec by hand; bad values named."""

from __future__ import annotations

import json
import pathlib

import pytest

from modelpool.layout import LayoutError, layout_roles
from modelpool.deploy import fleet_deployment


def _report(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"policies": {"token-level": {"layout": [
        {"tp": 1, "gpus": 3, "instances": 3, "prefill": 1, "decode": 2, "mixed": 0},
        {"tp": 2, "gpus": 4, "instances": 2, "prefill": 0, "decode": 0, "mixed": 2}]}}}))
    return path


def test_the_roles_come_from_a_report_or_a_spec(tmp_path: pathlib.Path) -> None:
    assert layout_roles(str(_report(tmp_path))) == ["prefill", "decode", "decode"]
    assert layout_roles(str(_report(tmp_path)), tp=2) == ["mixed", "mixed"]
    assert layout_roles("TP1: 2P+3D") == ["prefill"] * 2 + ["decode"] * 3
    assert layout_roles("3m") == ["mixed"] * 3
    with pytest.raises(LayoutError, match="'2X' is not a count and a role"):
        layout_roles("1P+2X")
    with pytest.raises(LayoutError, match="need decode"):
        layout_roles("2P")
    with pytest.raises(LayoutError, match="no layout for policy 'spatial'"):
        layout_roles(str(_report(tmp_path)), policy="spatial")
    with pytest.raises(LayoutError, match="no TP4 class"):
        layout_roles(str(_report(tmp_path)), tp=4)


def test_serve_takes_the_layout_for_the_fleets_instances(tmp_path: pathlib.Path) -> None:
    roles = layout_roles(str(_report(tmp_path)))
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("pool: {gpu: h100, num_gpus: 4}\nmodels:\n" +
                     "".join(f"  - {{name: m{k}, arch: qwen2.5-1.5b}}\n" for k in range(3)))
    dep = fleet_deployment(fleet, "sim", 0, None, "token-level", None, layout=roles)
    assert [spec.role for spec in dep.instances] == roles
