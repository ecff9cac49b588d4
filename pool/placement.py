"""Ray placement groups for tensor-parallel instances: what one asks Ray for, and its life cycle.

An instance of TP size t gets one placement group of t bundles, one per rank,
packed on one node (STRICT_PACK: its ranks all-reduce every layer). The
instance's actor sits in bundle 0 and its other ranks in the rest. A group
is removed when its instance stops or restarts (Ray then kills every actor
in it), and waiting for one to be placed has a deadline: a cluster with no
room for it gives a `PlacementTimeout` that says which instance, what it
asked for and what the cluster has, instead of waiting for ever.
"""

from __future__ import annotations

import threading
from typing import Any

STRATEGY = "STRICT_PACK"
DEFAULT_TIMEOUT_S = 120.0


def rank_bundle(use_gpus: bool) -> dict[str, float]:
    """What one rank of an instance holds: a GPU and half a CPU, or a CPU slot on a CPU-only cluster."""
    return {"GPU": 1.0, "CPU": 0.5} if use_gpus else {"CPU": 1.0}


def instance_bundles(tp: int, use_gpus: bool) -> list[dict[str, float]]:
    if tp < 1:
        raise ValueError(f"an instance's TP size must be >= 1, got {tp!r}")
    return [rank_bundle(use_gpus) for _ in range(tp)]


class PlacementTimeout(TimeoutError):
    """A placement group Ray could not place in time (it was removed)."""


class Placements:
    """The placement groups of one pool run's TP instances, one per instance id.

    `reserve` removes the instance's previous group first (a restart needs
    its resources back), `release` removes one, `close` removes them all and
    refuses new ones (a restart thread that outlives its pool's run cannot
    leave a group behind). Thread-safe: restarts run on their own threads.
    """

    def __init__(self) -> None:
        self._groups: dict[str, Any] = {}
        self._closed = False
        self._lock = threading.Lock()

    def reserve(self, instance_id: str, tp: int, *, use_gpus: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
        """A placed group for `instance_id` (TP `tp`); raises PlacementTimeout past `timeout_s`."""
        import ray
        from ray.util.placement_group import placement_group

        bundles = instance_bundles(tp, use_gpus)
        self.release(instance_id)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"instance {instance_id}: the pool's placement groups are closed (it stopped)")
            group = self._groups[instance_id] = placement_group(bundles, strategy=STRATEGY)
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            why = describe_unplaced(group, instance_id, bundles, timeout_s)
            self.release(instance_id)
            raise PlacementTimeout(why) from None
        return group

    def release(self, instance_id: str) -> None:
        with self._lock:
            group = self._groups.pop(instance_id, None)
        if group is not None:
            _remove(group)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            _remove(group)

    def __contains__(self, instance_id: str) -> bool:
        with self._lock:
            return instance_id in self._groups


def _remove(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - removed already, or the cluster is gone: nothing is held then
        pass


def describe_unplaced(group: Any, instance_id: str, bundles: list[dict[str, float]], waited_s: float) -> str:
    """Why `group` is not placed, for the error: what was asked, Ray's verdict, what each node has."""
    import ray
    from ray.util.placement_group import placement_group_table

    try:
        verdict = placement_group_table(group).get("stats", {}).get("scheduling_state", "unknown")
    except Exception:  # noqa: BLE001
        verdict = "unknown"
    return (f"instance {instance_id}: Ray could not place its placement group of {len(bundles)} bundles "
            f"{bundles[0]} packed on one node ({STRATEGY}) within {waited_s:g} s (Ray: {verdict}); "
            f"the cluster has {_nodes_text(ray)}")


def _nodes_text(ray: Any) -> str:
    """Each live node's total and free CPU/GPU (free from Ray's per-node view where this Ray has one)."""
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - a Ray without it: totals only
        free = {}
    parts = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total, left = node.get("Resources", {}), free.get(node["NodeID"], {})
        have = ", ".join(f"{key} {left.get(key, 0):g} free of {total[key]:g}" for key in ("CPU", "GPU") if key in total)
        parts.append(f"node {node['NodeID'][:8]} ({node.get('NodeManagerAddress', '?')}): {have or 'no CPU or GPU'}")
    return "; ".join(parts) or "no live nodes"
