"""The engine seam: the values an engine takes and returns, the `Engine` Protocol, and `Table` (its lookups).

The scheduler's actions map onto these calls one to one: Switch -> `activate`,
Prefetch -> `prefetch`, Prefill -> `prefill`, Decode -> `decode_step` (once per
step), SwapOut -> `save_kv`, SwapIn -> `restore_kv`; a finished or cancelled
request ends with `release`. A request moves between engines (instances) with
`export_kv` on one and `import_kv` on the other, its KV through host memory
or, between engines on one GPU, staged in the exporter's device memory until
the exporter's `release` (`pool.engines.handoff`). An engine never decides
anything itself. The pool sends these calls as values (`pool.calls`, one
frozen dataclass per method, run with `call.run(engine)`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pool.errors import EngineError as EngineError  # an engine's refusals, defined below every pool module
from pool.errors import OutOfKvMemory as OutOfKvMemory

if TYPE_CHECKING:
    from pool.engines.timings import StepTimings

FinishReason = Literal["stop", "length"]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI/vLLM semantics)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept; 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-request generator; same seed -> same tokens
    max_tokens: int = 16  # counts tokens already produced (GenRequest.output_token_ids) too
    stop: Sequence[str] = ()  # stop strings; the returned text never contains them
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # HF semantics over prompt + output; 1 = off

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (self.temperature >= 0, "temperature", self.temperature),
            (0 < self.top_p <= 1, "top_p", self.top_p),
            (self.top_k >= 0, "top_k", self.top_k),
            (self.max_tokens >= 1, "max_tokens", self.max_tokens),
            (self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty),
            (all(self.stop), "stop", self.stop),
        ]
        for ok, name, value in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} = {value!r} is out of range")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One request as an engine sees it: token ids in, token ids out."""

    request_id: str
    model: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Tokens already produced (and already streamed): a request whose KV was
    # lost resumes from prompt + these, and only later tokens are returned.
    output_token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One new token of one request; `text` is the delta to stream."""

    request_id: str
    token_id: int
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled as its fields: an engine process sends one per request per step, and the dataclass's own
        # __getstate__ looks the fields up for every token (7% of the H200 decode process's host time at 22 req/s)
        return TokenOut, (self.request_id, self.token_id, self.text, self.finished, self.finish_reason)


@dataclass(frozen=True, slots=True)
class ArenaRef:
    """A staging arena of device memory (`pool.engines.handoff`), as another process opens it."""

    pid: int  # the owner's process
    key: str
    nbytes: int
    device: str
    ipc: tuple[Any, ...] | None  # CUDA: what torch.multiprocessing's rebuild_cuda_tensor takes
    path: str | None  # CPU: its shared-memory file


@dataclass(frozen=True, slots=True)
class StagedKv:
    """A request's KV staged in device memory for a hand-off: `nbytes` at `offset` in `arena`, laid out as
    `KvExport.kv` is. The region is the exporting engine's until it releases the request."""

    arena: ArenaRef
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class KvExport:
    """One request moved out of an engine: all another engine needs to continue it (picklable).

    `kv` is the KV of the request's first `num_tokens` tokens (prompt + output
    but the last token, which has no KV yet) as the raw bytes of a C-contiguous
    `[num_layers, 2 (k, v), num_kv_heads, num_tokens, head_dim]` tensor of
    `kv_dtype`: only tokens, no block padding, so the importing engine may page
    it with another block size. It is a flat numpy uint8 array (numpy has no
    bfloat16), which pickle protocol 5 - Ray's object store - carries out of
    band, without a copy; or, for a hand-off between engines on one GPU, a
    `StagedKv` in the exporter's device memory (`staged`). `kv_tensor()` gives
    it back as a torch tensor (on the device, for a staged one).
    """

    request: GenRequest  # output_token_ids: every token produced so far (all already returned)
    seed: int  # the sampler's seed (drawn at admission when sampling.seed is None); token k draws with (seed, k)
    num_tokens: int  # tokens with KV: len(prompt) + len(output) - 1
    kv: Any  # numpy uint8, kv_bytes long
    kv_dtype: str  # torch dtype name, e.g. 'bfloat16'
    kv_shape: tuple[int, ...]  # (num_layers, 2, num_kv_heads, num_tokens, head_dim)
    text: str = ""  # output text detokenised so far (incrementally, as it was streamed)
    text_emitted: int = 0  # chars of `text` already streamed; the rest is held back (may begin a stop string)
    detok_offsets: tuple[int, int] = (0, 0)  # the incremental detokeniser's (prefix_offset, read_offset)

    @property
    def kv_bytes(self) -> int:
        return int(self.kv.nbytes)

    @property
    def staged(self) -> bool:
        """Its KV waits in the exporting engine's device memory (released with the request there)."""
        return isinstance(self.kv, StagedKv)

    def kv_tensor(self) -> Any:
        """The KV as a torch tensor of `kv_shape` and `kv_dtype` (shares memory with `kv`)."""
        import warnings

        import torch

        if isinstance(self.kv, StagedKv):
            from pool.engines.handoff import staged_view

            return staged_view(self.kv.arena, self.kv.offset, getattr(torch, self.kv_dtype), tuple(self.kv_shape))

        with warnings.catch_warnings():  # unpickled (Ray) arrays are read-only; the tensor is only read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(self.kv)
        return flat.view(getattr(torch, self.kv_dtype)).view(self.kv_shape)


@dataclass(frozen=True, slots=True)
class KvCapacity:
    """The device KV an engine can give requests, per loaded model, after its block and slab rounding.

    `tokens[m]` is what the device KV holds of model m alone; a request of m
    holds whole blocks of `block_tokens[m]` tokens. A mix fits when each
    request's blocks, counted as its share `blocks * block_tokens[m] / tokens[m]`,
    add up to at most 1 (models of one KV shape always; models of several
    shapes unless the engine's memory is fragmented between them, see
    `pool.engines.kv`). This is the KV the scheduler plans with
    (`pool.served.plan_kv`); a call that still finds no room raises `OutOfKvMemory`.
    """

    tokens: Mapping[str, int]
    block_tokens: Mapping[str, int]
    # tokens of each model the host KV store holds for swapped-out requests (after slab rounding); None: an
    # engine that keeps no host KV (vLLM resumes held requests by recompute) or does not bound it (sim)
    host_tokens: Mapping[str, int] | None = None
    # the device memory the engine holds model weights in (the torch engine's model region: two slots of its own,
    # or a shared region with every model once) and each model's bytes there: the weight budget and sizes the
    # scheduler plans resident sets with (`plan_kv`); None: the engine does not bound them (sim, vllm)
    weight_bytes: int | None = None
    model_bytes: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if set(self.tokens) != set(self.block_tokens):
            raise ValueError(f"KvCapacity: tokens for {sorted(self.tokens)}, blocks for {sorted(self.block_tokens)}")
        for name, block in self.block_tokens.items():
            if block < 1 or self.tokens[name] < 0:
                raise ValueError(f"KvCapacity[{name!r}]: {self.tokens[name]} tokens in blocks of {block}")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine holds and has moved; sizes in bytes."""

    device: str
    device_buffer_bytes: int = 0
    kv_device_bytes: int = 0  # the KV region
    kv_device_used_bytes: int = 0
    kv_capacity: KvCapacity | None = None  # what `Engine.kv_capacity` reports (None: not known yet)
    kv_host_bytes: int = 0  # host KV slabs allocated (kept for reuse)
    kv_host_used_bytes: int = 0
    host_weight_bytes: int = 0  # this engine's weight cache
    loaded_models: tuple[str, ...] = ()
    active_model: str | None = None
    prefetched_model: str | None = None  # device-resident in the spare slot
    resident_models: tuple[str, ...] = ()  # the models compute may use: the active one and those co-located
    num_requests: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    num_switches: int = 0
    switch_s: float = 0.0  # total seconds spent in activate()
    num_weight_copies: int = 0  # models' weights copied onto the device (a switch to a model neither resident nor
    # in the spare slot, or a prefetch); a switch to the spare or a resident model copies nothing
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    """A swap-capable token engine for one instance (one device)."""

    timings: StepTimings | None  # per-call and per-step timings, where the engine keeps them (torch)

    def load(self, model: str, path: Path) -> None:
        """Read `model`'s weights into the host weight cache (idempotent)."""
        ...

    def models(self) -> list[str]: ...

    def tokenizer(self, model: str) -> Any: ...

    def activate(self, model: str, evict: bool = True, keep: tuple[str, ...] | None = None) -> float:
        """Make `model` the active model; return the seconds it took. With `evict` it becomes the only
        resident model (the one it replaces waits in the spare slot); without, it joins the resident ones
        (co-location, within the device's model memory: EngineError when it does not fit). `keep`: the models
        that stay cached beside it (the plan's resident set; the others are freed). The rule is
        `scheduler.instance.ModelSlots`, the simulator's."""
        ...

    def prefetch(self, model: str, keep: tuple[str, ...] | None = None) -> None:
        """Start copying `model`'s weights in without blocking compute (`keep`: as in `activate`)."""
        ...

    def deactivate(self, model: str) -> None: ...

    def prefill(self, requests: Sequence[GenRequest]) -> list[TokenOut]:
        """Admit the requests (of resident models), run prompt + already-produced tokens, return each one's
        next token, in request order."""
        ...

    def decode_step(self, request_ids: Sequence[str]) -> list[TokenOut]:
        """One token for each request (of resident models, KV on the device), in request order; each
        model's batch is one forward pass."""
        ...

    def save_kv(self, request_ids: Sequence[str]) -> None:
        """Move the requests' KV from the device to host memory."""
        ...

    def restore_kv(self, request_ids: Sequence[str]) -> None:
        """Move the requests' KV from host memory back to the device."""
        ...

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the requests and free their KV wherever it is (unknown ids are ignored)."""
        ...

    def export_kv(self, request_ids: Sequence[str]) -> list[KvExport]:
        """Move the requests out: their state and KV (from host memory, or copied off the device), then forget them.

        All or none; their KV blocks are freed on both tiers.
        """
        ...

    def import_kv(self, exports: Sequence[KvExport]) -> None:
        """Admit exported requests with their KV in host memory (as after `save_kv`); `restore_kv` next.

        Their models must be loaded (EngineError otherwise); all or none
        (OutOfKvMemory when host memory cannot hold them).
        """
        ...

    def kv_capacity(self) -> KvCapacity:
        """The device KV requests can have, per loaded model (see `KvCapacity`); once every model is loaded."""
        ...

    def stats(self) -> EngineStats: ...

    def warm_up(self, max_tokens: int | None = None) -> int:
        """Before serving, once every model is loaded: capture what the request path must not (decode graphs,
        for requests of up to `max_tokens` tokens); returns how many graphs (0: nothing to capture)."""
        ...

    def close(self) -> None:
        """Free the engine's device memory (a restarted instance needs it); the engine is unusable after."""
        ...


# ---- the checks every engine makes, worded once --------------------------------------------------------------
def check_unique(call: str, request_ids: Sequence[str]) -> None:
    """Refuse a call that names one request twice (its KV would be read, moved or freed twice)."""
    if len(set(request_ids)) != len(request_ids):
        raise EngineError(f"duplicate request ids in {call}: {list(request_ids)}")


def check_new(call: str, request_ids: Sequence[str], held: Container[str]) -> None:
    """Refuse admitting (prefill, import_kv) requests named twice or held by the engine already."""
    check_unique(call, request_ids)
    for request_id in request_ids:
        if request_id in held:
            raise EngineError(f"{call}: request {request_id!r} is already in the engine")


def check_admissible(request: GenRequest) -> None:
    """Refuse a request with nothing to start from (no prompt) or nothing left to produce."""
    request_id, max_tokens = request.request_id, request.sampling.max_tokens
    if not request.prompt_token_ids:
        raise EngineError(f"request {request_id}: empty prompt")
    if len(request.output_token_ids) >= max_tokens:
        raise EngineError(f"request {request_id}: already has {len(request.output_token_ids)} of "
                          f"max_tokens={max_tokens} tokens")


def check_resident(what: str, model: str, resident: Collection[str], active: str | None) -> None:
    """Refuse computing with a model whose weights are not on the device."""
    if model not in resident:
        raise EngineError(f"{what}: model {model!r} is not resident (resident: {sorted(resident)}, "
                          f"active: {active!r})")


def check_on_device(request_id: str, on_device: bool) -> None:
    """Refuse a decode step of a request whose KV waits in host memory."""
    if not on_device:
        raise EngineError(f"request {request_id}: KV is in host memory; restore_kv first")


class Table(dict[str, T]):
    """An engine's models by name or requests by id; `require` is the lookup a caller may get wrong.

    A plain dict otherwise. `require` raises EngineError, not KeyError, with
    the message of the table's kind (`of_models`, `of_requests`).
    """

    def __init__(self, missing: Callable[[str, Mapping[str, T]], str]) -> None:
        super().__init__()
        self._missing = missing

    @classmethod
    def of_models(cls) -> Table[T]:
        return cls(lambda name, loaded: f"model {name!r} is not loaded; loaded: {sorted(loaded)}")

    @classmethod
    def of_requests(cls) -> Table[T]:
        return cls(lambda request_id, _: f"unknown request {request_id!r} (finished, released or never prefilled)")

    def require(self, key: str) -> T:
        try:
            return self[key]
        except KeyError:
            raise EngineError(self._missing(key, self)) from None
