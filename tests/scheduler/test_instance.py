"""The instance model (scheduler.instance): the spare-slot rule, co-location within a model region, KV places
and the time of one KV move - the rules the simulator's executor, the engines and the parity fake share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.errors import RefusedAction
from scheduler.instance import KvPlaces, ModelSlots, decode_turn_s, kv_move_s, prefill_s
from tests.factories import LinearCosts


def test_a_switch_back_to_the_spare_waits_only_for_what_is_left_of_its_copy() -> None:
    slots = ModelSlots()
    assert slots.switch("a", 0.0) == (True, 0.0)  # nothing on the device: a whole copy
    assert slots.switch("b", 1.0) == (True, 0.0) and slots.spare == "a" and slots.resident == {"b"}
    assert slots.switch("a", 2.0) == (False, 0.0) and slots.spare == "b"  # the one switched away from: free
    assert slots.prefetch("c", ready_at=5.0) and slots.spare == "c"  # replaces "b"
    assert slots.switch("c", 3.0) == (False, 2.0) and slots.spare == "a"  # 2 s of its copy left
    assert slots.switch("b", 6.0) == (True, 0.0)  # dropped from the spare slot by the prefetch of "c"
    assert not slots.prefetch("b", 9.0) and not slots.prefetch("c", 9.0)  # resident; in the spare slot


def test_co_location_keeps_the_resident_models_and_a_switch_with_evict_drops_them() -> None:
    slots = ModelSlots(capacity_bytes=10.0, model_bytes={"a": 4.0, "b": 4.0, "c": 3.0})
    slots.switch("a", 0.0)
    slots.switch("b", 0.0, evict=False)
    assert slots.resident == {"a", "b"} and slots.active == "b" and slots.spare is None
    assert slots.switch("a", 0.0, evict=False) == (False, 0.0)  # resident: only the active one changes
    with pytest.raises(RefusedAction, match=r"need 11 bytes .* holds 10"):
        slots.switch("c", 0.0, evict=False)
    assert slots.resident == {"a", "b"}
    assert not slots.prefetch("c", 1.0)  # no room beside the resident ones
    slots.switch("c", 0.0)  # evict: "c" alone, "a" (the active one) to the spare slot, "b" gone
    assert (slots.resident, slots.spare, slots.held()) == ({"c"}, "a", ["c", "a"])
    with pytest.raises(RefusedAction, match="'b' is not resident"):
        slots.require_resident("b", "decode of r1")


def test_kv_places_refuse_what_an_engine_refuses() -> None:
    kv = KvPlaces()
    kv.place("r1")
    kv.admit_to_host("r2")
    with pytest.raises(RefusedAction, match="already"):
        kv.place("r1")
    with pytest.raises(RefusedAction, match="host memory"):
        kv.require_on_device("r2", "decode")
    assert kv.move(["r1", "r2"], to_device=True) == ["r2"]  # r1 was there already
    with pytest.raises(RefusedAction, match="unknown request 'r3'"):
        kv.move(["r3"], to_device=False)
    kv.release(["r1", "r3"])
    assert kv.on_device == {"r2": True}


def test_one_kv_move_pays_one_overhead_and_steps_add_up_over_models() -> None:
    class Costs(LinearCosts):
        def kv_move_overhead_s(self, model: str) -> float:
            return 0.25

    costs = Costs(kv_per_token_s=0.001)
    assert kv_move_s(costs, []) == 0.0
    assert kv_move_s(costs, [("a", 100), ("b", 300)]) == pytest.approx(0.4 + 0.25)
    assert prefill_s(costs, [("a", 10), ("b", 20), ("a", 30)]) == costs.prefill_s("a", 40, 2) + costs.prefill_s("b", 20)
    assert decode_turn_s(costs, [("a", 10), ("b", 20), ("a", 30)], 3) == (
        costs.decode_turn_s("a", 2, 40, 3) + costs.decode_turn_s("b", 1, 20, 3))


def test_a_planned_resident_set_keeps_what_it_names_and_frees_the_rest() -> None:
    slots = ModelSlots(capacity_bytes=10.0, model_bytes={"a": 3.0, "b": 3.0, "c": 3.0, "d": 5.0})
    assert slots.switch("a", 0.0, keep=()) == (True, 0.0)
    assert slots.prefetch("b", ready_at=4.0, keep=())  # "a" resident, "b" cached
    assert slots.prefetch("c", ready_at=6.0, keep=("b",)) and slots.held() == ["a", "b", "c"]
    assert slots.switch("b", 5.0, keep=("a", "c")) == (False, 0.0)  # its copy is done: free
    assert slots.switch("c", 5.0, keep=("a", "b")) == (False, 1.0)  # 1 s of its copy left
    assert slots.switch("a", 7.0, keep=("b", "c")) == (False, 0.0)  # cached since it was switched away from
    with pytest.raises(RefusedAction, match="need 11 bytes"):
        slots.switch("d", 8.0, keep=("b", "c"))  # d + b + c do not fit
    assert slots.held() == ["a", "b", "c"]  # a refusal changes nothing
    assert slots.switch("d", 8.0, keep=("b",)) == (True, 0.0) and slots.held() == ["d", "b"]
    with pytest.raises(RefusedAction, match=r"cannot keep \['a'\]"):
        slots.prefetch("c", 9.0, keep=("a",))  # "a" was freed: keeping it would be a copy nobody timed
    assert not slots.prefetch("b", 9.0, keep=())  # cached already: nothing to copy, the others freed
    assert slots.held() == ["d", "b"]


def test_without_keep_one_spare_is_cached_as_before() -> None:
    slots = ModelSlots(capacity_bytes=100.0, model_bytes={"a": 1.0, "b": 1.0, "c": 1.0})
    slots.switch("a", 0.0, keep=())
    slots.prefetch("b", 1.0, keep=())
    slots.prefetch("c", 2.0, keep=("b",))
    slots.switch("b", 3.0)  # the one-spare rule: "a" (switched away from) is the spare, "c" goes
    assert slots.held() == ["b", "a"] and slots.spare == "a"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["switch", "prefetch", "switch-colocate"]), st.sampled_from("abcde"),
                          st.lists(st.sampled_from("abcde"), max_size=4, unique=True), st.booleans()),
                max_size=30))
def test_held_weights_never_exceed_the_region_and_only_resident_models_compute(ops: list) -> None:
    sizes = {"a": 2.0, "b": 3.0, "c": 4.0, "d": 5.0, "e": 6.0}
    slots = ModelSlots(capacity_bytes=12.0, model_bytes=sizes)
    for t, (op, model, keep, planned) in enumerate(ops):
        before = slots.snapshot()
        try:
            if op == "prefetch":
                slots.prefetch(model, float(t), tuple(keep) if planned else None)
            else:
                slots.switch(model, float(t), op == "switch", tuple(keep) if planned else None)
        except RefusedAction:
            assert slots.snapshot() == before  # a refused action changes nothing
        assert slots.held_bytes() <= 12.0
        assert slots.active is None or slots.active in slots.resident
        assert not set(slots.cached) & slots.resident
        for m in "abcde":
            if m not in slots.resident:
                with pytest.raises(RefusedAction):
                    slots.require_resident(m, "decode")
