"""A profile measured on a CPU, as a user meets it (issue 38 item 5): refused on a GPU fleet unless
`--force-profile` (then warned about, naming both devices)."""

from __future__ import annotations

import pathlib

import pytest

from tests.sims.test_capacity import TINY_FLEET
from tests.test_planner_first_hour import calibrated_profile, flat, invoke


@pytest.fixture()
def h20_fleet(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_FLEET)  # pool.gpu: h20
    return path


def test_force_profile_turns_the_refusal_into_a_warning_naming_both_devices(
        h20_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    cpu = calibrated_profile(tmp_path, "cpu", "cpu")
    code, output = invoke("simulate", "--fleet", str(h20_fleet), "--duration", "10", "--profile", str(cpu))
    assert code == 1
    assert "or pass --force-profile to use it anyway" in flat(output)
    for command in (["simulate", "--fleet", str(h20_fleet), "--duration", "10"],
                    ["capacity", "--fleet", str(h20_fleet), "--duration", "10", "--workers", "0", "--policies",
                     "dedicated", "--no-sensitivity", "--what-if-tpot", "0", "--out", str(tmp_path / "r")],
                    ["estimate", "--model", "small-a", "--fleet", str(h20_fleet)]):
        code, output = invoke(*command, "--profile", str(cpu), "--force-profile")
        assert code == 0, (command, output)
        assert (f"warning: --profile {cpu} was measured on cpu (calibrated as GPU type cpu), but the fleet runs on "
                f"H20; used anyway (--force-profile)" in flat(output)), command
