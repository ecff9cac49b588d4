"""Where the controller's engine calls run: in this process, or in Ray actors.

Both answer `call(instance_id, method, args, meta) -> handle` at once and hand
results back through `poll(timeout_s) -> [(handle, result or exception)]`,
oldest call first.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from typing import Any

from pool.engines.base import Engine


class InProcessBackend:
    """Engines in this process; each call runs as it is issued (tests and single-process dry runs)."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self.engines = dict(engines)
        self._ids = itertools.count(1)
        self._done: deque[tuple[int, Any]] = deque()

    def call(self, instance_id: str, method: str, args: tuple[Any, ...], meta: dict[str, Any]) -> int:
        handle = next(self._ids)
        try:
            result: Any = getattr(self.engines[instance_id], method)(*args)
        except Exception as exc:  # handed to the controller, which decides what it means
            result = exc
        self._done.append((handle, result))
        return handle

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        out = list(self._done)
        self._done.clear()
        return out


class RayBackend:
    """One Ray actor per instance (`pool.actor.InstanceActor`); calls on one actor run in order."""

    def __init__(self, actors: Mapping[str, Any]) -> None:
        import ray

        self._ray = ray
        self.actors = dict(actors)
        self._ids = itertools.count(1)
        self._pending: dict[Any, int] = {}  # ObjectRef -> handle

    def call(self, instance_id: str, method: str, args: tuple[Any, ...], meta: dict[str, Any]) -> int:
        handle = next(self._ids)
        actor = self.actors.get(instance_id)
        if actor is None:
            raise KeyError(f"no actor for instance {instance_id!r}")
        self._pending[actor.call.remote(method, *args)] = handle
        return handle

    def poll(self, timeout_s: float) -> list[tuple[int, Any]]:
        if not self._pending:
            return []
        refs = list(self._pending)
        ready, _ = self._ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in ready:
            handle = self._pending.pop(ref)
            try:
                result = self._ray.get(ref)
            except Exception as exc:  # RayActorError when the actor died; the engine's own errors too
                result = exc
            out.append((handle, result))
        return sorted(out, key=lambda pair: pair[0])

    @property
    def in_flight(self) -> int:
        return len(self._pending)
