"""Model shapes and the host weight cache: each model's weights in one contiguous (pinned) block.

A model is loaded once per process into a `ModelImage`: one byte buffer, with
every tensor at a fixed offset, in the engine's fused layout (q/k/v in one
matrix, gate/up in one matrix). A switch is then one large copy of that
buffer into a device slot, and `ModelImage.views()` names the tensors inside
any copy of it (host or device) without copying again.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pool.engines.device import align_up, pinned_empty

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the forward pass needs to know about a decoder-only Llama-family model."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None
    inv_freq: tuple[float, ...]  # rope inverse frequencies (float32), from transformers' rope code
    rope_scaling: float  # transformers' attention_scaling for cos/sin
    tp_rank: int = 0  # a tensor-parallel shard (`shard()`): heads and MLP columns are this rank's part
    tp_size: int = 1

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        model_type = config.model_type
        if model_type not in SUPPORTED_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
            raise ValueError(f"{model_type}: only SiLU MLPs without bias are supported")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        window = getattr(config, "sliding_window", None)
        if model_type == "qwen2" or model_type == "qwen3":
            window = window if getattr(config, "use_sliding_window", False) else None
        attention_bias = bool(getattr(config, "attention_bias", False))
        inv_freq, scaling = _rope(config)
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            inv_freq=tuple(inv_freq.tolist()),
            rope_scaling=float(scaling),
        )

    def shard(self, rank: int, size: int) -> ModelSpec:
        """Rank `rank`'s part of this model at tensor-parallel size `size` (Megatron-style, see `pool.engines.tp`):
        its share of the query and KV heads and of the MLP's intermediate columns, and of the vocabulary in the
        output head; embeddings and norms whole."""
        if self.tp_size != 1:
            raise ValueError(f"{self.model_type}: already a shard ({self.tp_rank} of {self.tp_size})")
        if not 0 <= rank < size:
            raise ValueError(f"tp rank {rank} is not in [0, {size})")
        for what, count in (("attention heads", self.num_heads), ("KV heads", self.num_kv_heads),
                            ("intermediate size", self.intermediate_size)):
            if count % size:
                raise ValueError(f"{self.model_type}: {what} {count} do not split over tp {size}")
        return replace(self, num_heads=self.num_heads // size, num_kv_heads=self.num_kv_heads // size,
                       intermediate_size=self.intermediate_size // size, tp_rank=rank, tp_size=size)

    def whole(self) -> ModelSpec:
        """The model this spec is a shard of (itself when it is not one)."""
        size = self.tp_size
        return replace(self, num_heads=self.num_heads * size, num_kv_heads=self.num_kv_heads * size,
                       intermediate_size=self.intermediate_size * size, tp_rank=0, tp_size=1)

    @property
    def vocab_width(self) -> int:
        """Vocabulary rows of the output head per shard (the last may hold fewer)."""
        return -(-self.vocab_size // self.tp_size)

    @property
    def vocab_start(self) -> int:
        return min(self.vocab_size, self.tp_rank * self.vocab_width)

    @property
    def vocab_rows(self) -> int:
        """Rows of the output head held here: the whole vocabulary, or a shard's part of it."""
        return min(self.vocab_size, self.vocab_start + self.vocab_width) - self.vocab_start

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layout(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """The fused tensors of the image, in storage order."""
        h, i = self.hidden_size, self.intermediate_size
        yield "embed", (self.vocab_size, h)
        for n in range(self.num_layers):
            yield f"{n}.ln1", (h,)
            yield f"{n}.qkv", (self.q_size + 2 * self.kv_size, h)
            if self.qkv_bias:
                yield f"{n}.qkv_bias", (self.q_size + 2 * self.kv_size,)
            if self.qk_norm:
                yield f"{n}.q_norm", (self.head_dim,)
                yield f"{n}.k_norm", (self.head_dim,)
            yield f"{n}.o", (h, self.q_size)
            if self.o_bias:
                yield f"{n}.o_bias", (h,)
            yield f"{n}.ln2", (h,)
            yield f"{n}.gate_up", (2 * i, h)
            yield f"{n}.down", (h, i)
        yield "norm", (h,)
        if not self.tie_word_embeddings:
            yield "lm_head", (self.vocab_rows, h)


def _rope(config: Any) -> tuple[torch.Tensor, float]:
    """Rope frequencies exactly as transformers computes them (static rope types only)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.float(), rotary.attention_scaling


# Checkpoint names of each fused tensor's parts, in the order they are stacked.
def _sources(name: str) -> list[str]:
    if name in ("embed", "norm"):
        return [f"model.{'embed_tokens' if name == 'embed' else 'norm'}.weight"]
    if name == "lm_head":
        return ["lm_head.weight"]
    layer, part = name.split(".", 1)
    pre = f"model.layers.{layer}."
    table = {
        "ln1": ["input_layernorm.weight"],
        "ln2": ["post_attention_layernorm.weight"],
        "qkv": [f"self_attn.{p}_proj.weight" for p in "qkv"],
        "qkv_bias": [f"self_attn.{p}_proj.bias" for p in "qkv"],
        "q_norm": ["self_attn.q_norm.weight"],
        "k_norm": ["self_attn.k_norm.weight"],
        "o": ["self_attn.o_proj.weight"],
        "o_bias": ["self_attn.o_proj.bias"],
        "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "down": ["mlp.down_proj.weight"],
    }
    return [pre + s for s in table[part]]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    offset: int  # bytes from the image start
    shape: tuple[int, ...]


class ModelImage:
    """One model's weights as one byte buffer plus a name -> (offset, shape) table."""

    def __init__(self, name: str, spec: ModelSpec, dtype: torch.dtype, pin: bool) -> None:
        self.name, self.spec, self.dtype = name, spec, dtype
        esize = dtype.itemsize
        self.slots: dict[str, TensorSlot] = {}
        top = 0
        for tname, shape in spec.layout():
            self.slots[tname] = TensorSlot(top, shape)
            top = align_up(top + math.prod(shape) * esize)
        self.nbytes = top
        self.buffer = pinned_empty(top, pin, owner=self)

    def views(self, storage: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Typed views of every tensor inside `storage` (default: the host buffer)."""
        storage = self.buffer if storage is None else storage
        if storage.numel() < self.nbytes:
            raise ValueError(f"{self.name}: storage of {storage.numel()} bytes < image of {self.nbytes}")
        esize = self.dtype.itemsize
        out = {}
        for tname, slot in self.slots.items():
            count = math.prod(slot.shape)
            out[tname] = storage[slot.offset : slot.offset + count * esize].view(self.dtype).view(slot.shape)
        if self.spec.tie_word_embeddings:
            start = self.spec.vocab_start
            out["lm_head"] = out["embed"][start : start + self.spec.vocab_rows]
        return out

    def fill_from_safetensors(self, folder: Path) -> None:
        """This image's tensors (of its shard: only those bytes are read) from a transformers folder."""
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                where.update({key: f for key in handle.keys()})
        views = self.views()
        for tname in self.slots:
            parts = []
            for key in _sources(tname):
                if key not in where:
                    raise KeyError(f"{self.name}: tensor {key!r} is missing from {folder}")
                with safe_open(str(where[key]), framework="pt") as handle:
                    source = handle.get_slice(key)
                    parts.append(_shard_part(tname, source, tuple(source.get_shape()), self.spec))
            views[tname].copy_(torch.cat(parts, dim=0) if len(parts) > 1 else parts[0])

    def fill_random(self, seed: int = 0, std: float = 0.02, device: str | torch.device = "cpu") -> None:
        """Random weights (norms = 1) for benchmarks; generated on `device`, then copied here. A shard gets its
        part of the very weights the whole model would get from the same seed."""
        gen = torch.Generator(device=device).manual_seed(seed)
        whole = self.spec.whole()
        views = self.views()
        for tname, shape in whole.layout():
            view = views[tname]
            if "norm" in tname or tname.endswith(("ln1", "ln2")):
                view.fill_(1.0)
                continue
            noise = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            if self.spec.tp_size > 1:
                sizes = _part_rows(tname, whole)
                parts = noise.split(sizes, dim=0) if sizes else [noise]
                noise = torch.cat([_shard_part(tname, part, tuple(part.shape), self.spec) for part in parts])
            view.copy_((noise * std).to(self.dtype))


def _part_rows(tname: str, whole: ModelSpec) -> list[int] | None:
    """Rows of each checkpoint tensor stacked in a fused tensor of the whole model (None: just one)."""
    part = tname.split(".", 1)[-1]
    if part in ("qkv", "qkv_bias"):
        return [whole.q_size, whole.kv_size, whole.kv_size]
    if part == "gate_up":
        return [whole.intermediate_size] * 2
    return None


def _shard_part(tname: str, source: Any, shape: tuple[int, ...], spec: ModelSpec) -> torch.Tensor:
    """Rank `spec.tp_rank`'s part of one checkpoint tensor of the fused tensor `tname` (whole at tp 1).

    Megatron's split: q/k/v and gate/up by output rows (column-parallel), o and down by input columns
    (row-parallel, their outputs summed over ranks), the output head by vocabulary rows; the o bias is added
    once, by rank 0; embeddings and norms are whole on every rank. `source` is a tensor or a safetensors
    slice (only the rows or columns taken are read).
    """
    rank, size = spec.tp_rank, spec.tp_size
    part = tname.split(".", 1)[-1]
    if size == 1 or part in ("embed", "norm", "ln1", "ln2", "q_norm", "k_norm"):
        return source[:]
    if part == "o_bias":
        return source[:] if rank == 0 else torch.zeros(shape, dtype=source[:1].dtype)
    if part in ("o", "down"):
        cols = shape[1] // size
        return source[:, rank * cols : (rank + 1) * cols]
    if part == "lm_head":
        return source[spec.vocab_start : spec.vocab_start + spec.vocab_rows]
    if part in ("qkv", "qkv_bias", "gate_up"):
        rows = shape[0] // size
        return source[rank * rows : (rank + 1) * rows]
    raise ValueError(f"no tensor-parallel split is known for {tname!r}")


class HostWeightCache:
    """Every model's weights once per process, in (pinned, when CUDA is there) host memory.

    Engines of one process share it (`shared_weight_cache()`), so N instances
    of one node hold one copy of each model.
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._images: dict[tuple[str, torch.dtype, tuple[int, int]], ModelImage] = {}
        self._lock = threading.Lock()

    def load(self, name: str, path: Path, dtype: torch.dtype | None = None,
             shard: tuple[int, int] = (0, 1)) -> ModelImage:
        """The image of `name` from `path` (a transformers folder), or of its tensor-parallel `shard` (rank,
        size); read at most once per dtype and shard."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        dtype = dtype or _config_dtype(config)
        return self._get_or_build(name, dtype, shard, lambda: _from_folder(name, path, config, dtype, self.pin, shard))

    def add_random(self, name: str, config: Any, dtype: torch.dtype, seed: int = 0,
                   device: str | torch.device = "cpu", shard: tuple[int, int] = (0, 1)) -> ModelImage:
        """A random-weight model (or its `shard`) built from an in-memory config (benchmarks)."""

        def build() -> ModelImage:
            image = ModelImage(name, _spec(config, shard), dtype, self.pin)
            image.fill_random(seed=seed, device=device)
            return image

        return self._get_or_build(name, dtype, shard, build)

    def _get_or_build(self, name: str, dtype: torch.dtype, shard: tuple[int, int],
                      build: Callable[[], ModelImage]) -> ModelImage:
        with self._lock:
            key = (name, dtype, (shard[0], shard[1]))
            if key not in self._images:
                self._images[key] = build()
            return self._images[key]

    def evict(self, name: str) -> None:
        with self._lock:
            for key in [k for k in self._images if k[0] == name]:
                del self._images[key]

    @property
    def total_bytes(self) -> int:
        return sum(image.nbytes for image in self._images.values())


def _config_dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, value) if isinstance(value, str) else value


RANDOM_WEIGHTS_FILE = "random_weights.json"  # {"seed": N}: a folder of a model's shape, with no weights


def _spec(config: Any, shard: tuple[int, int]) -> ModelSpec:
    spec = ModelSpec.from_config(config)
    return spec if tuple(shard) == (0, 1) else spec.shard(*shard)


def _from_folder(name: str, path: Path, config: Any, dtype: torch.dtype, pin: bool,
                 shard: tuple[int, int] = (0, 1)) -> ModelImage:
    """The image of a transformers folder: its safetensors, or - for a folder that holds only a config, a
    tokenizer and `random_weights.json` (load tests of a fleet's shapes, no download) - seeded random weights."""
    image = ModelImage(name, _spec(config, shard), dtype, pin)
    marker = Path(path) / RANDOM_WEIGHTS_FILE
    if marker.is_file() and not any(Path(path).glob("*.safetensors")):
        import json

        try:
            seed = int(json.loads(marker.read_text()).get("seed", 0))
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{marker}: expected {{\"seed\": <int>}} ({exc})") from None
        image.fill_random(seed=seed, device="cuda" if torch.cuda.is_available() else "cpu")
    else:
        image.fill_from_safetensors(Path(path))
    return image


_SHARED: HostWeightCache | None = None


def shared_weight_cache() -> HostWeightCache:
    """The process-wide cache (one per node when one process drives all its GPUs)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = HostWeightCache()
    return _SHARED
