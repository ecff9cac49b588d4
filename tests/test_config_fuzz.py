"""Fuzzing the models.yaml loader: whatever the text, `load_fleet` returns a Fleet or raises `FleetFileError`.

Three kinds of input: random text (with YAML's own punctuation mixed in),
the repo's fleet files with random edits to their text, and documents that
are valid YAML of the right outline with wrong values (types, ranges,
unknown keys, missing keys, impossible layouts). An error must be a
`FleetFileError` whose every problem names the file and a line, or at least
the field; any other exception (KeyError, TypeError, an AttributeError from
deep inside) fails the test.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelpool.config import FleetFileError, load_fleet, parse_fleet
from scheduler.fleet import Fleet

REPO = Path(__file__).resolve().parents[1]
FLEET_FILES = [REPO / "models.yaml", REPO / "examples" / "aegaeon" / "models.yaml"]
SOURCE = "fuzz/models.yaml"
EXAMPLES = int(os.environ.get("MODELPOOL_FUZZ_EXAMPLES", "300"))  # per fuzzer; more for the long run
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NUM_CASES = {"text": 0, "mutated": 0, "wrong": 0}


def check(text: str, kind: str) -> Fleet | None:
    """Load `text`; the only allowed failure is a FleetFileError whose problems are placed."""
    NUM_CASES[kind] += 1
    try:
        fleet = parse_fleet(text, SOURCE, base_dir=REPO)
    except FleetFileError as error:
        assert error.problems, "a FleetFileError without problems"
        for problem in error.problems:
            assert problem.path == SOURCE and problem.message, problem
            assert problem.line >= 1 or problem.field not in ("", "(top level)"), f"unplaced: {problem}"
            assert str(problem).startswith(f"{SOURCE}:{problem.line}:{problem.column}: {problem.field}: ")
        return None
    assert isinstance(fleet, Fleet) and fleet.models
    return fleet


# ---- 1. random text --------------------------------------------------------------------------------
yaml_bits = st.sampled_from(["models:", "pool:", "gpus:", "- ", "  ", "{", "}", "[", "]", ": ", ",", "&a ", "*a",
                             "!!python/object:os.system ", "!!binary ", "? ", "|", ">", "#", "'", '"', "\t", "\n",
                             "- {name: m, arch: qwen2.5-7b}", "num_gpus: ", "tp: ", "1e309", ".nan", "-1", "~",
                             "<<: *a", "!!int ", "!!float ", "!!bool ", "!!timestamp ", "!!binary ", "!!set ", "!!omap ",
                             "!foo ", "%YAML 1.2\n", "---\n", "...\n", "\x00", "\ufeff"])


@FUZZ
@given(pieces=st.lists(st.one_of(yaml_bits, st.text(max_size=8)), max_size=30))
def test_random_text_only_raises_fleet_file_error(pieces: list[str]) -> None:
    check("".join(pieces), "text")


# ---- 2. the repo's fleet files, edited at random -----------------------------------------------------
TEXTS = [path.read_text() for path in FLEET_FILES if path.exists()]


@st.composite
def edited(draw: st.DrawFn) -> str:
    lines = draw(st.sampled_from(TEXTS)).splitlines()
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(lines) - 1))
        how = draw(st.sampled_from(["drop", "repeat", "indent", "dedent", "cut", "insert", "swap"]))
        line = lines[at]
        if how == "drop":
            del lines[at]
        elif how == "repeat":
            lines.insert(at, line)
        elif how == "indent":
            lines[at] = "  " + line
        elif how == "dedent":
            lines[at] = line.lstrip()
        elif how == "cut" and line:
            lines[at] = line[:draw(st.integers(0, len(line) - 1))]
        elif how == "insert":
            column = draw(st.integers(0, len(line)))
            lines[at] = line[:column] + draw(st.one_of(yaml_bits, st.text(max_size=4))) + line[column:]
        elif how == "swap":
            other = draw(st.integers(0, len(lines) - 1))
            lines[at], lines[other] = lines[other], lines[at]
        if not lines:
            lines = [""]
    return "\n".join(lines)


@FUZZ
@given(text=edited())
def test_edited_fleet_files_only_raise_fleet_file_error(text: str) -> None:
    check(text, "mutated")


# ---- 3. the right outline, wrong values ------------------------------------------------------------
odd = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.integers(-10**30, 10**30),
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
archs = st.sampled_from(["qwen2.5-7b", "qwen2.5-72b", "llama-3.1-8b", "qwen3-30b-a3b", "no-such-arch", "./nowhere",
                         "../models.yaml", "/"])


def maybe(value: st.SearchStrategy) -> st.SearchStrategy:
    """The field's plausible value, or an odd one."""
    return st.one_of(value, odd)


arch_inline = st.fixed_dictionaries({"num_layers": maybe(st.integers(1, 100)), "hidden_size": maybe(st.integers(1, 9000)),
                                     "num_heads": maybe(st.integers(1, 64)), "num_kv_heads": maybe(st.integers(1, 64)),
                                     "intermediate_size": maybe(st.integers(1, 30000)),
                                     "vocab_size": maybe(st.integers(1, 200000))},
                                    optional={"head_dim": odd, "num_experts": maybe(st.integers(0, 64)),
                                              "experts_per_token": maybe(st.integers(0, 8)),
                                              "dtype": maybe(st.sampled_from(["bfloat16", "fp8", "int4"])),
                                              "max_context": odd, "bogus": odd})
entry = st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(["a", "b", "chat", "a"]))},
    optional={"arch": st.one_of(archs, arch_inline, odd), "tp": maybe(st.sampled_from([1, 2, 3, 4, 8, 16])),
              "slo": st.one_of(odd, st.fixed_dictionaries({"ttft_s": maybe(st.floats(0.1, 10)), "tpot_s": odd})),
              "traffic": st.one_of(odd, st.fixed_dictionaries({"rate_rps": maybe(st.floats(0, 5))},
                                                              optional={"cv": odd})),
              "weights": odd, "extra_key": odd})
pool = st.fixed_dictionaries({}, optional={
    "gpu": maybe(st.sampled_from(["h20", "h100", "a100-80gb", "mygpu", "H20"])), "num_gpus": maybe(st.integers(1, 64)),
    "gpus_per_node": maybe(st.sampled_from([1, 2, 4, 8])), "prefill_fraction": odd,
    "gpu_memory_utilization": maybe(st.floats(0, 1.5)), "host_cache_gb": odd, "default_slo": odd, "max_batch_size": odd,
    "nonsense": odd})
gpus = st.dictionaries(st.sampled_from(["mygpu", "h20", "x"]),
                       st.one_of(odd, st.fixed_dictionaries({"memory_gb": maybe(st.floats(1, 200)),
                                                             "hbm_tb_s": maybe(st.floats(0.5, 8)),
                                                             "bf16_tflops": maybe(st.floats(10, 2000)),
                                                             "h2d_gb_s": odd, "nvlink_gb_s": odd,
                                                             "usd_per_hour": odd})), max_size=2)
document = st.fixed_dictionaries({}, optional={"pool": st.one_of(pool, odd),
                                               "models": st.one_of(st.lists(st.one_of(entry, odd), max_size=4), odd),
                                               "gpus": st.one_of(gpus, odd), "version": odd})


def dump(data: object) -> str:
    """YAML for `data`; non-finite floats as YAML's .nan/.inf (safe_dump writes those too)."""
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


@FUZZ
@given(data=document, flow=st.booleans())
def test_wrong_values_only_raise_fleet_file_error(data: dict, flow: bool) -> None:
    text = yaml.safe_dump(data, default_flow_style=flow, allow_unicode=True) if flow else dump(data)
    fleet = check(text, "wrong")
    if fleet is not None:  # accepted: then it is sane
        assert all(entry.tp >= 1 and math.isfinite(entry.arch.weight_bytes) for entry in fleet.models)


@pytest.mark.parametrize(("text", "expected"), [  # what the fuzzers found (each was a raw exception)
    ("models: 1\n", "1:1: models: Input should be a valid list (got 1)"),  # TypeError in the cross-entry checks
    ("? [a, b]\n: 1\nmodels: []\n", "1:3: (top level): a key must be plain text"),  # TypeError: unhashable
    ("models: &a [*a]\n", "1:9: models[0]: an alias that contains itself"),  # RecursionError
    ("pool: {num_gpus: !!int abc}\n", "1:18: pool.num_gpus: unreadable value 'abc'"),  # ValueError
    ("pool:\n  num_gpus: !!int\n", "2:13: pool.num_gpus: unreadable value ''"),  # IndexError
    ("pool: {gpu: !!timestamp x}\n", "1:13: pool.gpu: unreadable value 'x'"),  # AttributeError
    ("pool: {gpu: !!bool maybe}\n", "1:13: pool.gpu: unreadable value 'maybe'"),  # KeyError
    ("pool: {gpu: !foo x}\n", "1:13: pool.gpu: unreadable value 'x': could not determine a constructor"),
    ("pool: &a\n", "1:1: pool: Input should be a valid dictionary"),  # ParserError re-serialising an anchor
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{k}: &{k} [{', '.join([f'*{p}'] * 10)}]\n" for p, k in zip("abcde", "bcdef")),
     "more than 100000 values (aliases expanding?)"),  # a billion laughs: 10^6 values, expanded in full
])
def test_found_by_fuzzing(text: str, expected: str) -> None:
    with pytest.raises(FleetFileError) as error:
        parse_fleet(text, SOURCE)
    assert str(error.value).startswith(SOURCE) and expected in str(error.value)


def test_unreadable_paths_are_named(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.yaml", tmp_path):
        try:
            load_fleet(path)
        except FleetFileError as error:
            assert str(path) in str(error) and "cannot read" in str(error)
        else:
            raise AssertionError(f"{path} loaded")
    undecodable = tmp_path / "latin1.yaml"
    undecodable.write_bytes(b"models:\n  - {name: caf\xe9, arch: qwen2.5-7b}\n")
    try:
        load_fleet(undecodable)
    except FleetFileError as error:
        assert str(error) == f"{undecodable}:2:15: (file): not UTF-8 text: byte 0xe9"
    else:
        raise AssertionError("latin-1 text loaded")


def test_cases_were_tried() -> None:
    """The counts BENCHMARKS.md reports (run after the fuzzers: pytest keeps file order)."""
    print(f"models.yaml fuzz cases: {NUM_CASES}")
    assert all(NUM_CASES[kind] >= min(100, EXAMPLES) for kind in NUM_CASES) or sum(NUM_CASES.values()) == 0
