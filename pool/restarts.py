"""Bringing lost instances back: a fresh engine (a new Ray actor) built off the loop thread.

When the controller writes an instance off (its actor died, an engine call
failed or went unanswered, or it missed its heartbeat), `Restarts.watch()`
starts one rebuild on a daemon thread. The rebuild's outcome reaches the pool
loop through `deliver(instance_id, replacement or exception)`; the loop then
swaps the replacement into its backend and tells the controller
(`InstanceAdded` to the scheduler), or gives the instance up, after which the
controller fails the requests nobody is left to serve. Until then the
instance counts as coming back, so its re-queued requests wait for it rather
than fail.

The budget refills, as Ray Serve's replica restarts and Kubernetes' crash
loop back-off do: at most `max_restarts` rebuilds of one instance start
within any `window_s`, and the k-th within the window waits
`backoff_s * 2**(k-2)` first (at most `max_backoff_s`; the first, none).
An instance out of budget is given up until its oldest restart leaves the
window; `watch()` then starts it again. (A fixed budget for the server's
life left an engine with none after a long soak.)

A rebuild that raises is tried again after `retry_after_s`, as one more
restart, while the budget lasts: when a node dies with its actor, Ray may
place the first replacement on that node before it has noticed the node is
gone, and the replacement dies with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("modelpool.restarts")


class Restarts:
    def __init__(self, build: Callable[[str], Any], deliver: Callable[[str, Any], None], max_restarts: int,
                 retry_after_s: float = 1.0, window_s: float = 600.0, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._build = build  # instance id -> its replacement (runs on the rebuild thread; may raise)
        self._deliver = deliver
        self.max_restarts = max_restarts  # within any window_s (0: never restart)
        self.retry_after_s = retry_after_s
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()  # _recent is written by the loop and the rebuild threads
        self._closed = threading.Event()  # the pool stopped: no more retries
        self.pending: set[str] = set()  # rebuilding now
        self.given_up: set[str] = set()  # out of budget (until it refills) or failed for good
        self.num_restarts: Counter[str] = Counter()  # rebuilds started, per instance, over the pool's life
        self.num_failed = 0  # rebuilds that raised (written by the rebuild threads)
        self.waited_s: list[float] = []  # the back-off each rebuild waited, in start order
        self._recent: dict[str, deque[float]] = {}  # instance -> when its rebuilds in the window started

    def watch(self, lost: Iterable[str]) -> None:
        """Start a rebuild for every lost instance with budget left (give the others up until it refills)."""
        for instance_id in lost:
            if instance_id in self.pending:
                continue
            delay = self._take(instance_id)
            if delay is None:
                if instance_id not in self.given_up:
                    log.error("instance %s lost: no restart left (%d in the last %g s)", instance_id,
                              self.max_restarts, self.window_s)
                    self.given_up.add(instance_id)
                continue
            self.given_up.discard(instance_id)
            self.pending.add(instance_id)
            log.warning("instance %s lost: restart %d (%d of %d in %g s), after %.1f s", instance_id,
                        self.num_restarts[instance_id], len(self._recent[instance_id]), self.max_restarts,
                        self.window_s, delay)
            threading.Thread(target=self._run, args=(instance_id, delay), name=f"modelpool-restart-{instance_id}",
                             daemon=True).start()

    def budget_left(self, instance_id: str) -> int:
        """Restarts `instance_id` may still start within the window ending now."""
        with self._lock:
            return self.max_restarts - len(self._window(instance_id))

    def _window(self, instance_id: str) -> deque[float]:
        recent = self._recent.setdefault(instance_id, deque())
        now = self._clock()
        while recent and recent[0] <= now - self.window_s:
            recent.popleft()
        return recent

    def _take(self, instance_id: str) -> float | None:
        """Count one restart of `instance_id` now; the back-off it waits first, or None without budget."""
        with self._lock:
            recent = self._window(instance_id)
            if len(recent) >= self.max_restarts:
                return None
            recent.append(self._clock())
            self.num_restarts[instance_id] += 1
            k = len(recent)
            return 0.0 if k == 1 else min(self.max_backoff_s, self.backoff_s * 2 ** (k - 2))

    def done(self, instance_id: str, ok: bool) -> None:
        """The loop took the rebuild's outcome: back in service, or (failed) given up until the budget refills."""
        self.pending.discard(instance_id)
        if not ok:
            self.given_up.add(instance_id)

    def close(self) -> None:
        """The pool stopped: a rebuild that fails from now on is not tried again."""
        self._closed.set()

    def _run(self, instance_id: str, delay: float) -> None:
        self.waited_s.append(delay)
        replacement: Any = None
        while True:
            if delay > 0 and self._closed.wait(delay):  # the pool stopped meanwhile
                replacement = RuntimeError(f"the pool stopped before {instance_id} was restarted")
                break
            try:
                replacement = self._build(instance_id)
                break
            except Exception as exc:
                self.num_failed += 1
                retry = self._take(instance_id)
                if retry is None:
                    log.exception("restart of %s failed", instance_id)
                    replacement = exc  # reported to the loop, which gives the instance up
                    break
                delay = max(self.retry_after_s, retry)
                log.warning("restart of %s failed (%s: %s); trying again in %g s", instance_id, type(exc).__name__,
                            str(exc).splitlines()[0] if str(exc) else "", delay)
                if self._closed.is_set():
                    replacement = exc
                    break
                self.waited_s.append(delay)
        self._deliver(instance_id, replacement)
