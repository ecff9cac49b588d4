"""The instance model (scheduler.instance): the spare-slot rule, co-location within a model region, KV places
and the time of one KV move - the rules the simulator's executor, the engines and the parity fake share."""

from __future__ import annotations

import pytest

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
