"""Bringing lost instances back: a fresh engine (a new Ray actor) built off the loop thread.

When the controller writes an instance off (its actor died, or an engine
call failed and its state can no longer be trusted), `Restarts.watch()`
starts one rebuild on a daemon thread, at most `max_restarts` per instance
over the pool's life. The rebuild's outcome reaches the pool loop through
`deliver(instance_id, replacement or exception)`; the loop then swaps the
replacement into its backend and tells the controller (`InstanceAdded` to
the scheduler), or gives the instance up, after which the controller fails
the requests nobody is left to serve. Until then the instance counts as
coming back, so its re-queued requests wait for it rather than fail.

A rebuild that raises is tried again after `retry_after_s`, as one more
restart, while the instance has restarts left: when a node dies with its
actor, Ray may place the first replacement on that node before it has
noticed the node is gone, and the replacement dies with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("modelpool.restarts")


class Restarts:
    def __init__(self, build: Callable[[str], Any], deliver: Callable[[str, Any], None], max_restarts: int,
                 retry_after_s: float = 1.0) -> None:
        self._build = build  # instance id -> its replacement (runs on the rebuild thread; may raise)
        self._deliver = deliver
        self.max_restarts = max_restarts
        self.retry_after_s = retry_after_s
        self._closed = threading.Event()  # the pool stopped: no more retries
        self.pending: set[str] = set()  # rebuilding now
        self.given_up: set[str] = set()  # lost for good
        self.num_restarts: Counter[str] = Counter()  # rebuilds started, per instance
        self.num_failed = 0  # rebuilds that raised (written by the rebuild threads)

    def watch(self, lost: Iterable[str]) -> None:
        """Start a rebuild for every newly lost instance that has restarts left (give the others up)."""
        for instance_id in lost:
            if instance_id in self.pending or instance_id in self.given_up:
                continue
            if self.num_restarts[instance_id] >= self.max_restarts:
                log.error("instance %s lost for good after %d restart(s)", instance_id, self.num_restarts[instance_id])
                self.given_up.add(instance_id)
                continue
            self.num_restarts[instance_id] += 1
            self.pending.add(instance_id)
            log.warning("instance %s lost: restart %d of %d", instance_id, self.num_restarts[instance_id],
                        self.max_restarts)
            threading.Thread(target=self._run, args=(instance_id,), name=f"modelpool-restart-{instance_id}",
                             daemon=True).start()

    def done(self, instance_id: str, ok: bool) -> None:
        """The loop took the rebuild's outcome: back in service, or (failed) lost for good."""
        self.pending.discard(instance_id)
        if not ok:
            self.given_up.add(instance_id)

    def close(self) -> None:
        """The pool stopped: a rebuild that fails from now on is not tried again."""
        self._closed.set()

    def _run(self, instance_id: str) -> None:
        while True:
            try:
                replacement = self._build(instance_id)
                break
            except Exception as exc:
                self.num_failed += 1
                if self.num_restarts[instance_id] >= self.max_restarts:
                    log.exception("restart of %s failed", instance_id)
                    replacement = exc  # reported to the loop, which gives the instance up
                    break
                log.warning("restart of %s failed (%s: %s); trying again in %g s", instance_id, type(exc).__name__,
                            str(exc).splitlines()[0] if str(exc) else "", self.retry_after_s)
                if self._closed.wait(self.retry_after_s):  # the pool stopped meanwhile
                    replacement = exc
                    break
                self.num_restarts[instance_id] += 1
                log.warning("instance %s: restart %d of %d", instance_id, self.num_restarts[instance_id],
                            self.max_restarts)
        self._deliver(instance_id, replacement)
