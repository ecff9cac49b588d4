"""A torch engine's models, and where their weights sit on its device: the weights-and-slots part of the engine.

The engine's device memory is one buffer, made at the first need (once the
models are known): KV region | model region, two model slots' worth; or,
with `shared_weights`, the KV region alone beside the device's shared weights
region (`shared_weights.py`: every model once per device, mapped by each
engine on it). The
model region is placed by `slots.ModelSlots` under the instance model of
`scheduler.instance` (the models resident, the one in the spare slot); the KV
region is the engine's `KvStore`. A model's forward pass (`Decoder`) is built
once per place its weights can sit in and bound to them at each call.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pool.engines.base import EngineError, Table, check_resident
from pool.engines.device import DeviceBuffer, Streams, align_up
from pool.engines.forward import Decoder, SharedTensors
from pool.engines.kv import HostSlabPool, KvShape, slab_bytes_for
from pool.engines.kvstore import KvStore
from pool.engines.slots import ModelSlots
from pool.engines.weights import HostWeightCache, ModelImage

if TYPE_CHECKING:
    from pool.engines.torch_engine import TorchEngineConfig

MiB = 1 << 20


@dataclass(slots=True)
class LoadedModel:
    """A model an engine has loaded: its image in the host cache, its KV shape, tokenizer and end ids."""

    name: str
    image: ModelImage
    kv_shape: KvShape
    tokenizer: Any
    eos_ids: frozenset[int]


class Residency:
    """The loaded models, the device buffer (model slots | KV store) and the decoders bound to the slots."""

    def __init__(self, config: TorchEngineConfig, device: torch.device, streams: Streams, weights: HostWeightCache,
                 host_kv: HostSlabPool, rank: Any = None) -> None:
        self.config = config
        self.device = device
        self.dtype = getattr(torch, config.dtype) if config.dtype else None
        self.streams = streams
        self.weights = weights
        self.rank = rank  # a tensor-parallel rank (`pool.engines.tp.TpRank`): its shard of every model; None: all
        self.models: Table[LoadedModel] = Table.of_models()
        self.buffer: DeviceBuffer | None = None
        self.slots: ModelSlots | None = None
        self.kv: KvStore | None = None
        self.fused: bool | None = None  # fused Triton kernels (decode and prefill); None: wherever they run (CUDA)
        self._host_kv = host_kv
        self._decoders: dict[tuple[str, int, bool | None], Decoder] = {}
        self._shared: dict[tuple[Any, torch.dtype, int], SharedTensors] = {}  # (spec, dtype, slot) -> tensors
        self.weight_bytes_h2d = self.num_switches = self.num_weight_copies = 0
        self.switch_s = 0.0

    # ---- models -----------------------------------------------------------------------------------------
    def load(self, model: str, path: Path) -> None:
        if model in self.models:
            return
        from transformers import AutoTokenizer

        shard = (0, 1) if self.rank is None else (self.rank.rank, self.rank.size)
        image = self.weights.load(model, Path(path), self.dtype, shard)
        self.add_image(image, AutoTokenizer.from_pretrained(path), _eos_ids(Path(path)))

    def add_image(self, image: ModelImage, tokenizer: Any = None, eos_ids: Iterable[int] = ()) -> None:
        spec = image.spec
        shape = KvShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.config.block_size, image.dtype)
        eos = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.models[image.name] = LoadedModel(image.name, image, shape, tokenizer, frozenset(eos))

    # ---- weights in the slots -------------------------------------------------------------------------------
    def activate(self, model: str, evict: bool, keep: tuple[str, ...] | None = None) -> float:
        image = self.models.require(model).image
        slots = self.ensure()
        if keep is None and slots.active_model == model and (not evict or slots.resident == {model}):
            return 0.0
        seconds = slots.activate(image, evict, keep)
        self.num_switches += 1
        self.switch_s += seconds
        return seconds

    def prefetch(self, model: str, keep: tuple[str, ...] | None = None) -> None:
        self.ensure().prefetch(self.models.require(model).image, keep)

    def ready_on_device(self, model: str) -> bool:
        return self.slots is not None and self.slots.ready_on_device(model)

    def deactivate(self, model: str) -> None:
        if self.slots is not None:
            self.slots.deactivate(model)

    def drop(self, model: str) -> None:
        if self.slots is not None:
            self.slots.drop(model)

    def require_resident(self, model: str, what: str) -> None:
        slots = self.ensure()
        check_resident(what, model, slots.resident, slots.active_model)

    # ---- the device buffer ----------------------------------------------------------------------------------
    def ensure(self) -> ModelSlots:
        """The device buffer, made on first need: KV region | model region (two model slots' worth)."""
        if self.slots is None:
            cfg = self.config
            if cfg.shared_weights:
                self.buffer = DeviceBuffer({"kv": cfg.kv_bytes}, self.device)
                self.slots = self._shared_slots(cfg.shared_weights)
            else:
                slot = align_up(cfg.max_model_bytes or max((m.image.nbytes for m in self.models.values()), default=0))
                self.buffer = DeviceBuffer({"kv": cfg.kv_bytes, "models": 2 * slot}, self.device)
                self.slots = ModelSlots(self.buffer.region("models"), self.streams, on_copy=self._count_weight_copy)
            blocks = [m.kv_shape.block_bytes for m in self.models.values()]
            slab = cfg.device_slab_bytes or slab_bytes_for(blocks, MiB, cfg.kv_bytes)
            self._host_kv.size()  # the host slabs too, from the same models (and the reserved ones made now)
            self.kv = KvStore(self.buffer.region("kv"), slab, self._host_kv, self.streams)
        return self.slots

    def _shared_slots(self, share_dir: str) -> ModelSlots:
        """Model slots in the device's shared weights region, laid out for every model loaded now."""
        from pool.engines.shared_weights import SharedModelSlots, SharedRegion

        if self.rank is not None:
            raise EngineError("shared_weights: a tensor-parallel rank keeps its shards in a region of its own")
        if not self.models:
            raise EngineError("shared_weights: load every model before the first call that needs the device")
        region = SharedRegion(share_dir, self.device, {m.name: m.image.nbytes for m in self.models.values()})
        return SharedModelSlots(region, self.streams, on_copy=self._count_weight_copy)

    def kv_store(self) -> KvStore:
        self.ensure()
        return self.kv  # type: ignore[return-value]

    def _count_weight_copy(self, nbytes: int) -> None:
        self.weight_bytes_h2d += nbytes
        self.num_weight_copies += 1

    # ---- forward passes -------------------------------------------------------------------------------------
    def decoder(self, model: LoadedModel) -> Decoder:
        """The forward pass of the resident `model`, bound to where its weights are."""
        where = self.ensure().placement(model.name)
        decoder = self.slot_decoder(model, where.offset)
        decoder.bind(where.load)
        return decoder

    def slot_decoder(self, model: LoadedModel, offset: int) -> Decoder:
        """The forward pass of `model` as if its weights sat at `offset` of the model region (they need not
        be there yet)."""
        key = (model.name, offset, self.fused)
        if key not in self._decoders:
            slots = self.ensure()
            image = model.image
            shared_key = (image.spec, image.dtype, offset)
            if shared_key not in self._shared:
                self._shared[shared_key] = SharedTensors(image.spec, image.dtype, self.device)
            self._decoders[key] = Decoder(image.spec, image.views(slots.region[offset: offset + image.nbytes]),
                                          self.kv_store().view(model.kv_shape), fused=self.fused,
                                          shared=self._shared[shared_key],
                                          comm=None if self.rank is None else self.rank.comm)
        return self._decoders[key]

    def offset(self, model: LoadedModel) -> int:
        return self.ensure().placement(model.name).offset

    def close(self) -> None:
        """Drop the decoders and the device buffer (the engine is unusable after)."""
        for shared in self._shared.values():
            shared.owner = None  # decoder <-> shared tensors: no cycle left for the collector
        self._decoders.clear()
        self._shared.clear()
        if self.slots is not None:
            self.slots.close()  # a shared weights region: this engine's use of it ends
        self.buffer = self.slots = self.kv = None


def _eos_ids(path: Path) -> set[int]:
    try:
        value = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {int(value)}
