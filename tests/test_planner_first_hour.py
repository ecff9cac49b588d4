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


# ---- 3: "(unmet)" says who missed; savings against a failing baseline say so ------------------------------------


def test_unmet_names_the_policy_and_the_models_that_missed(tmp_path: pathlib.Path) -> None:
    fleet = tmp_path / "tight.yaml"  # small-c's 2 ms TPOT SLO cannot be met on an H20
    fleet.write_text(TINY_FLEET.replace("rate_rps: 0.1}}", "rate_rps: 0.1}, slo: {ttft_s: 10, tpot_s: 0.002}}"))
    out = tmp_path / "report"
    code, output = invoke("capacity", "--fleet", str(fleet), "--duration", "60", "--workers", "0",
                          "--what-if-tpot", "0", "--policies", "dedicated,token-level", "--out", str(out))
    assert code == 0, output
    assert ("(unmet) dedicated misses the 99.0% per-request target (each model must meet it on its own); "
            "under it: small-c 0.00%") in output
    assert "(unmet) token-level misses the 99.0% per-request target (each TP class must meet it over its requests); " \
           "under it: small-c 0.00%" in output
    assert "small-a" not in output.split("(unmet) dedicated")[1].split("\n")[0]  # only the model that missed
    assert "Target not met: dedicated misses the 99.0% per-request target" in (out / "report.md").read_text()
    assert "Target not met: dedicated misses" in (out / "report.html").read_text()


def test_savings_against_a_baseline_that_missed_its_own_target_say_so() -> None:
    from types import SimpleNamespace

    from sims.capacity import Goal
    from sims.report import _headline

    result = SimpleNamespace(gpu="h20", config=SimpleNamespace(goal=Goal(0.99)))
    missed = [{"model": "qwen3-32b-chat", "attainment": 0.97, "requests": 40}]
    policies = {"dedicated": {"gpus": 23, "usd_per_month": 30_000.0, "met": False, "missed_models": missed},
                "token-level": {"gpus": 17, "usd_per_month": 22_000.0, "met": True, "missed_models": []}}
    headline = _headline(result, None, policies)
    assert headline["sentence"].startswith("23 dedicated H20s -> 17 pooled (token-level), 26% fewer GPUs")
    assert headline["baseline_met"] is False
    assert ("but the dedicated baseline misses the target itself (qwen3-32b-chat under it), so this saving is "
            "measured against a pool that falls short") in headline["sentence"]
    policies["dedicated"]["met"] = True
    assert "baseline" not in _headline(result, None, policies)["sentence"]
