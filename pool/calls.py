"""The engine calls the pool makes, as values: one frozen dataclass per `Engine` method, run by `run(engine)`.

`pool.runner` turns each Plan action into these (Switch -> `Activate`,
Prefill -> `Prefill` (+ `SaveKv`), Decode -> `DecodeStep` per step, ...);
the controller hands them to a backend, which carries one to the instance's
engine - in this process, a worker process or a Ray actor - and runs it there.
`run` is a plain method call on the `Engine` protocol, so a reader goes from
the action to the engine's code with "go to definition", and a backend
dispatches without method names. Calls pickle as their fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pool.engines.base import Engine, EngineStats, GenRequest, KvCapacity, TokenOut


@dataclass(frozen=True, slots=True)
class Activate:
    """Make `model` active (Switch); `evict=False` keeps the resident models beside it."""

    model: str
    evict: bool = True
    keep: tuple[str, ...] | None = None  # the models that stay cached beside it (a planned resident set)
    name: ClassVar[str] = "activate"

    def run(self, engine: Engine) -> float:
        return engine.activate(self.model, self.evict, self.keep)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Start copying `model`'s weights into the spare slot (Prefetch); nobody waits for it."""

    model: str
    keep: tuple[str, ...] | None = None  # as `Activate.keep`
    name: ClassVar[str] = "prefetch"

    def run(self, engine: Engine) -> None:
        engine.prefetch(self.model, self.keep)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class Prefill:
    """Admit and prefill requests (Prefill)."""

    requests: tuple[GenRequest, ...]
    name: ClassVar[str] = "prefill"

    def run(self, engine: Engine) -> list[TokenOut]:
        return engine.prefill(self.requests)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests)


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One decode step (Decode runs `max_steps` of them); `turn_step` counts from 1 within the turn and only
    informs simulated backends (tests/parity), which time the turn as the simulator does."""

    ids: tuple[str, ...]
    turn_step: int = 1
    max_steps: int = 1
    name: ClassVar[str] = "decode_step"

    def run(self, engine: Engine) -> list[TokenOut]:
        return engine.decode_step(self.ids)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self.ids


@dataclass(frozen=True, slots=True)
class SaveKv:
    """Move requests' KV from the device to host memory (SwapOut, or Prefill with `kv_to_host`)."""

    ids: tuple[str, ...]
    name: ClassVar[str] = "save_kv"

    def run(self, engine: Engine) -> None:
        engine.save_kv(self.ids)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self.ids


@dataclass(frozen=True, slots=True)
class RestoreKv:
    """Move requests' KV from host memory back to the device (SwapIn)."""

    ids: tuple[str, ...]
    name: ClassVar[str] = "restore_kv"

    def run(self, engine: Engine) -> None:
        engine.restore_kv(self.ids)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self.ids


@dataclass(frozen=True, slots=True)
class Release:
    """Forget requests and free their KV wherever it is (a cancel, a refusal, staged KV once copied)."""

    ids: tuple[str, ...]
    name: ClassVar[str] = "release"

    def run(self, engine: Engine) -> None:
        engine.release(self.ids)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self.ids


@dataclass(frozen=True, slots=True)
class ExportKv:
    """Move requests out of the engine with their KV (a hand-off, or a SwapIn elsewhere)."""

    ids: tuple[str, ...]
    name: ClassVar[str] = "export_kv"

    def run(self, engine: Engine) -> list[Any]:
        return engine.export_kv(self.ids)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self.ids


@dataclass(frozen=True, slots=True)
class ImportKv:
    """Admit requests exported by another engine, their KV into host memory (or device, when staged)."""

    exports: tuple[Any, ...]  # KvExport (what the exporting engine returned)
    name: ClassVar[str] = "import_kv"

    def run(self, engine: Engine) -> None:
        engine.import_kv(self.exports)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(_export_id(e) for e in self.exports)


@dataclass(frozen=True, slots=True)
class GetKvCapacity:
    """The device KV the engine can give requests (asked once at start)."""

    name: ClassVar[str] = "kv_capacity"

    def run(self, engine: Engine) -> KvCapacity:
        return engine.kv_capacity()

    @property
    def request_ids(self) -> tuple[str, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class GetStats:
    """What the engine holds and has moved (for /pool/status and /metrics)."""

    name: ClassVar[str] = "stats"

    def run(self, engine: Engine) -> EngineStats:
        return engine.stats()

    @property
    def request_ids(self) -> tuple[str, ...]:
        return ()


EngineCall = (Activate | Prefetch | Prefill | DecodeStep | SaveKv | RestoreKv | Release | ExportKv | ImportKv
              | GetKvCapacity | GetStats)


def _export_id(export: Any) -> str:
    """The request id of an export (a `KvExport`; the parity fake exports bare request ids)."""
    return export if isinstance(export, str) else export.request.request_id
