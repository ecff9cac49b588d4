"""The pool's engine calls as values (`pool.calls`): each runs the engine method it is named after, carries the
request ids the controller blames when it fails, and travels to a worker process by pickle unchanged."""

from __future__ import annotations

import pickle
import typing
from typing import Any

import pytest

from pool import calls
from pool.engines.base import GenRequest, KvExport, SamplingParams

REQUEST = GenRequest("r1", "m", (1, 2, 3), SamplingParams(max_tokens=4))
EXPORT = KvExport(request=GenRequest("r2", "m", (1,)), seed=0, num_tokens=0, kv=b"", kv_dtype="uint8", kv_shape=(0,))
EXAMPLES: list[tuple[calls.EngineCall, tuple[Any, ...], tuple[str, ...]]] = [
    (calls.Activate("m", False, ("m", "n")), ("m", False, ("m", "n")), ()),
    (calls.Prefetch("n"), ("n", None), ()),
    (calls.Prefill((REQUEST,)), ((REQUEST,),), ("r1",)),
    (calls.DecodeStep(("r1", "r2"), turn_step=2, max_steps=4), (("r1", "r2"),), ("r1", "r2")),
    (calls.SaveKv(("r1",)), (("r1",),), ("r1",)),
    (calls.RestoreKv(("r1",)), (("r1",),), ("r1",)),
    (calls.Release(("r1", "r2")), (("r1", "r2"),), ("r1", "r2")),
    (calls.ExportKv(("r2",)), (("r2",),), ("r2",)),
    (calls.ImportKv((EXPORT,)), ((EXPORT,),), ("r2",)),
    (calls.GetKvCapacity(), (), ()),
    (calls.GetStats(), (), ()),
]


class Recorder:
    """Stands in for an engine: records the method each call ran and its arguments."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        def method(*args: Any) -> str:
            self.ran.append((name, args))
            return f"result of {name}"
        return method


def test_every_call_kind_has_an_example() -> None:
    assert {type(call) for call, _, _ in EXAMPLES} == set(typing.get_args(calls.EngineCall))


@pytest.mark.parametrize("call, args, request_ids", EXAMPLES, ids=[type(c).__name__ for c, _, _ in EXAMPLES])
def test_a_call_runs_the_engine_method_it_is_named_after(call: Any, args: tuple[Any, ...],
                                                          request_ids: tuple[str, ...]) -> None:
    engine = Recorder()
    result = call.run(engine)
    assert engine.ran == [(call.name, args)]  # the name is what StepTimings books the call under
    assert result in (f"result of {call.name}", None)
    assert call.request_ids == request_ids


def test_calls_pickle_as_their_fields() -> None:
    for call, _, _ in EXAMPLES:
        assert pickle.loads(pickle.dumps(call, protocol=5)) == call


def test_the_parity_fake_exports_bare_ids_and_an_import_of_them_blames_them() -> None:
    assert calls.ImportKv(("r7", "r8")).request_ids == ("r7", "r8")
