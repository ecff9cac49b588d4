"""The demo fleet: built offline, deterministic, cached by a manifest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pool.demo import MANIFEST, TINY_CONFIGS, build_demo_models, build_tiny_model, build_tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_every_demo_model_is_a_loadable_transformers_folder(demo_models):
    from transformers import AutoConfig

    assert set(TINY_CONFIGS) <= set(demo_models)
    for name, folder in demo_models.items():
        for file in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
            assert (folder / file).exists(), (name, file)
        config = AutoConfig.from_pretrained(folder)
        assert config.model_type in ("llama", "qwen2", "qwen3")
    assert AutoConfig.from_pretrained(demo_models["tiny-qwen3"]).head_dim == 48


def test_second_build_reads_the_manifest_only(demo_models):
    cache = next(iter(demo_models.values())).parent
    stamps = {name: (folder / "model.safetensors").stat().st_mtime_ns for name, folder in demo_models.items()}
    again = build_demo_models(cache)  # nothing rebuilt: the files keep their modification times
    assert again == demo_models
    assert {n: (f / "model.safetensors").stat().st_mtime_ns for n, f in again.items()} == stamps
    assert set(json.loads((cache / MANIFEST).read_text())) == set(demo_models)


def test_a_stale_manifest_entry_rebuilds_that_model_only(tmp_path):
    built = build_demo_models(tmp_path, include_smollm2=False)
    stamps = {n: (f / "model.safetensors").stat().st_mtime_ns for n, f in built.items()}
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["tiny-llama"] = "v0-old"
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    build_demo_models(tmp_path, include_smollm2=False)
    after = {n: (f / "model.safetensors").stat().st_mtime_ns for n, f in built.items()}
    assert after["tiny-llama"] != stamps["tiny-llama"]  # rebuilt; the others untouched
    del after["tiny-llama"], stamps["tiny-llama"]
    assert after == stamps
    assert not list(tmp_path.glob("*.partial"))


def test_tiny_models_and_tokenizer_are_deterministic(tmp_path, demo_models):
    build_tiny_model("tiny-qwen2", tmp_path / "again")
    for file in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "again" / file).read_bytes() == (demo_models["tiny-qwen2"] / file).read_bytes(), file


def test_tokenizer_round_trips_and_has_a_chat_template():
    tok = build_tokenizer()
    text = "What is the capital of France? Ünïcode too: 日本."
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id is not None


def test_cli_prints_what_it_built(demo_models):
    cache = next(iter(demo_models.values())).parent
    proc = subprocess.run([sys.executable, "-m", "pool.demo", "build", str(cache)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in demo_models:
        assert name in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "pool.demo"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_models_run_in_transformers(name, demo_models):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_models[name])
    model = AutoModelForCausalLM.from_pretrained(demo_models[name])
    ids = tok("Once upon a time", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4 and model.dtype == torch.bfloat16
