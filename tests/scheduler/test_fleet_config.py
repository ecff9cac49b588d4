"""models.yaml: the shipped fleet validates; every kind of mistake is named by file, line, field and value."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from modelpool.config import FleetFileError, load_fleet, parse_fleet
from scheduler.catalog import ARCHS
from scheduler.fleet import Arch, arch_from_hf_config, catalogue_arch, hf_shape

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOOD = """\
pool: {gpu: h20, num_gpus: 8}
models:
  - {name: a, arch: qwen2.5-7b}
  - {name: b, arch: qwen2.5-72b, tp: 4}
"""


def problems(text: str, tmp_path: pathlib.Path) -> list[str]:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    with pytest.raises(FleetFileError) as info:
        load_fleet(path)
    return [str(p) for p in info.value.problems]


def test_shipped_fleet_is_a_long_tail_of_47_models_on_h20() -> None:
    fleet = load_fleet(ROOT / "models.yaml")
    assert fleet.pool.gpu == "h20" and len(fleet.models) == 47
    sizes = sorted(m.arch.params for m in fleet.models)
    assert sizes[0] < 2e9 and sizes[-1] > 70e9
    assert sum(s < 15e9 for s in sizes) >= 35  # mostly small
    assert {m.tp for m in fleet.models if m.arch.params > 30e9} <= {2, 4}
    rates = sorted((m.traffic.rate_rps for m in fleet.models), reverse=True)
    assert rates[0] > 10 * rates[-1] and sum(rates[:5]) > 0.4 * sum(rates)  # long tail


def test_good_fleet_and_arch_from_local_config_json(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "torch_dtype": "bfloat16",
        "max_position_embeddings": 32768}))
    path = tmp_path / "fleet.yaml"
    path.write_text(GOOD + "  - {name: c, arch: ./my-model}\n")
    fleet = load_fleet(path)
    assert fleet.model("c").arch.kv_bytes_per_token == fleet.model("a").arch.kv_bytes_per_token
    assert abs(fleet.model("c").arch.params / fleet.model("a").arch.params - 1) < 0.01


def test_unknown_key(tmp_path: pathlib.Path) -> None:
    (msg,) = problems(GOOD.replace("num_gpus: 8", "num_gpus: 8, colour: blue"), tmp_path)
    assert msg.startswith(f"{tmp_path / 'fleet.yaml'}:1:")
    assert "pool.colour: unknown key 'colour'; allowed: gpu, num_gpus" in msg


def test_retired_host_cache_gb_says_why_and_what_to_do(tmp_path: pathlib.Path) -> None:
    (msg,) = problems(GOOD.replace("num_gpus: 8", "num_gpus: 8, host_cache_gb: 64"), tmp_path)
    assert msg.startswith(f"{tmp_path / 'fleet.yaml'}:1:") and "pool: host_cache_gb (64) is no longer read" in msg
    assert "remove the key" in msg


def test_wrong_type(tmp_path: pathlib.Path) -> None:
    (msg,) = problems(GOOD.replace("tp: 4", "tp: four"), tmp_path)
    assert ":4:" in msg and "models[1].tp" in msg and "'four'" in msg


def test_tp_that_does_not_fit_gpu_memory(tmp_path: pathlib.Path) -> None:
    (msg,) = problems(GOOD.replace("tp: 4", "tp: 1"), tmp_path)
    assert ":4:" in msg and "models[1].tp" in msg and "does not fit 'b' on h20" in msg and "use tp >= 2" in msg
    assert "(got 1)" in msg


def test_duplicate_model_name(tmp_path: pathlib.Path) -> None:
    (msg,) = problems(GOOD + "  - {name: a, arch: qwen2.5-3b}\n", tmp_path)
    assert ":5:" in msg and "models[2].name: duplicate model name 'a' (first at models[0])" in msg


def test_unknown_arch(tmp_path: pathlib.Path) -> None:
    (msg,) = problems(GOOD.replace("qwen2.5-7b", "qwen9-7b"), tmp_path)
    assert ":3:" in msg and "models[0].arch: unknown arch 'qwen9-7b'" in msg and "qwen2.5-7b" in msg


def test_unknown_gpu_and_bad_yaml_and_duplicate_yaml_key(tmp_path: pathlib.Path) -> None:
    (msg,) = problems(GOOD.replace("gpu: h20", "gpu: h9000"), tmp_path)
    assert "pool.gpu: unknown GPU 'h9000'" in msg
    (msg,) = problems("models: [\n", tmp_path)
    assert "fleet.yaml:2:" in msg and "(yaml)" in msg
    (msg,) = problems(GOOD + "pool: {gpu: h100}\n", tmp_path)
    assert ":5:1:" in msg and "duplicate key 'pool'" in msg


def test_every_problem_is_reported_once(tmp_path: pathlib.Path) -> None:
    text = GOOD.replace("num_gpus: 8", "num_gpus: 8, colour: blue").replace("tp: 4", "tp: 1")
    text += "  - {name: a, arch: qwen9-7b}\n  - {name: z, arch: qwen2.5-3b, slo: {ttft_s: -1}}\n"
    msgs = problems(text, tmp_path)
    assert len(msgs) == 4
    assert [m.split(": ")[1] for m in msgs] == ["pool.colour", "models[1].tp", "models[2].arch", "models[3].slo.ttft_s"]


def test_missing_file_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FleetFileError, match="nope.yaml.*cannot read"):
        load_fleet(tmp_path / "nope.yaml")


def test_catalogue_params_match_the_architecture_shapes() -> None:
    for key, figures in ARCHS.items():
        arch = Arch(**figures)
        assert abs(arch.computed_params / arch.params - 1) < 0.02, key
    moe = Arch(**ARCHS["qwen3-30b-a3b"])
    assert 3.0e9 < moe.active_params < 3.6e9


def test_hf_shape_is_what_arch_from_hf_config_reads_back() -> None:
    """The catalogue as config.json keys (the benchmarks and `modelpool calibrate` build their random-weight models
    from it): every dense arch comes back with the same shape."""
    shape = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
             "tie_embeddings")
    for key in ARCHS:
        arch = catalogue_arch(key)
        if arch.is_moe:
            continue
        back = Arch.model_validate(arch_from_hf_config({**hf_shape(arch), "model_type": arch.family}))
        assert {f: getattr(back, f) for f in shape} == {f: getattr(arch, f) for f in shape}, key
    assert hf_shape(catalogue_arch("qwen2.5-1.5b"))["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="unknown arch 'qwen9-7b'; known archs: .*qwen2.5-7b"):
        catalogue_arch("qwen9-7b")


def test_validate_cli_exit_codes(tmp_path: pathlib.Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "modelpool.cli", "validate", str(ROOT / "models.yaml")],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "is valid" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("tp: 4", "tp: 1"))
    res = subprocess.run([sys.executable, "-m", "modelpool.cli", "validate", str(bad)], capture_output=True, text=True)
    assert res.returncode == 1 and f"{bad}:4:" in res.stderr and "1 problem(s)" in res.stderr


def test_published_schema_is_current() -> None:
    res = subprocess.run([sys.executable, "-m", "modelpool.cli", "schema"], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert json.loads(res.stdout) == json.loads((ROOT / "models.schema.json").read_text())
    assert (ROOT / "models.yaml").read_text().startswith("# yaml-language-server: $schema=./models.schema.json")


def test_parse_fleet_is_usable_without_a_file() -> None:
    fleet = parse_fleet(GOOD)
    assert [m.name for m in fleet.models] == ["a", "b"] and fleet.gpu().memory_gb == 96
