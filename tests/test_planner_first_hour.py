"""The capacity planner's first hour (issue 38), run as a user runs it: `modelpool simulate`, `capacity`,
`estimate` and `traces fetch` through the CLI, each checked on the message or figure it prints."""

from __future__ import annotations

import pathlib

import pytest
from typer.testing import CliRunner

from modelpool.cli import app
from tests.sims.test_capacity import TINY_FLEET

HEADER = "timestamp_s,model,input_tokens,output_tokens\n"


@pytest.fixture()
def tiny_fleet(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_FLEET)
    return path


def invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


# ---- 1: a model name the fleet does not know ------------------------------------------------------------------


def test_a_misspelt_model_name_is_an_error_naming_file_line_and_the_fleets_names(
        tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    names = ["small-a", "small-b", "small-c"]
    rows = [f"{k * 0.5},{names[k % 3]},100,10" for k in range(200)]
    rows[137] = "68.5,small-bb,100,10"  # one typo among 200 rows (line 139: the header is line 1)
    trace = tmp_path / "trace.csv"
    trace.write_text(HEADER + "\n".join(rows) + "\n")
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", str(trace))
    assert code == 1
    assert f"{trace}:139: column 'model': not a model of the fleet (known: small-a, small-b, small-c" in output
    assert "'small-bb'" in output and "map=fold" in output
    code, output = invoke("capacity", "--fleet", str(tiny_fleet), "--trace", str(trace), "--workers", "0")
    assert code == 1 and f"{trace}:139: column 'model'" in output


def test_a_trace_of_other_models_is_mapped_and_the_mapping_printed(
        tiny_fleet: pathlib.Path, tmp_path: pathlib.Path) -> None:
    trace = tmp_path / "other.csv"
    trace.write_text(HEADER + "".join(f"{k},{'busy' if k % 3 else 'quiet'},50,5\n" for k in range(30)))
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", str(trace))
    assert code == 0, output
    assert "note: 2 trace models dealt round-robin by popularity onto 3 models: busy -> small-a, quiet -> small-b" \
        in output
    # the explicit option deals a file that names some fleet models too, and says so
    trace.write_text(HEADER + "".join(f"{k},{'small-a' if k % 3 else 'smal-b'},50,5\n" for k in range(30)))
    code, output = invoke("simulate", "--fleet", str(tiny_fleet), "--trace", f"{trace};map=fold")
    assert code == 0, output
    assert "small-a -> small-a, smal-b -> small-b" in output
