"""How fast the pool's queues drain, measured, for the `Retry-After` of a 429 or 503.

A fixed `Retry-After: 1` sent clients straight back into a queue that took
22 s to drain. Here every request that leaves a model's queue (its first
token went out) and every request that leaves the pool (it ended) is counted
over a sliding window, per model; a refusal's `Retry-After` is the time the
requests ahead of the client take to leave at the measured rate,
`ahead / rate`, between `min_s` and `max_s`. With nothing measured yet the
answer is `default_s`; with requests ahead and none leaving for a whole
window, `max_s`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable


class DrainRate:
    def __init__(self, window_s: float = 30.0, min_s: float = 1.0, max_s: float = 60.0, default_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.min_s, self.max_s, self.default_s = min_s, max_s, default_s
        self._clock = clock
        self._since = clock()
        self._started: dict[str, deque[float]] = {}  # model -> times its requests left its queue
        self._ended: dict[str, deque[float]] = {}  # model -> times its requests left the pool

    def started(self, model: str) -> None:
        self._started.setdefault(model, deque()).append(self._clock())

    def ended(self, model: str) -> None:
        self._ended.setdefault(model, deque()).append(self._clock())

    def queue_retry_after_s(self, model: str, ahead: int) -> float:
        """Seconds until `ahead` requests have left `model`'s queue, at its measured rate."""
        return self._retry_after([self._started.get(model)], ahead)

    def model_retry_after_s(self, model: str, ahead: int) -> float:
        """Seconds until `ahead` requests of `model` have left the pool."""
        return self._retry_after([self._ended.get(model)], ahead)

    def pool_retry_after_s(self, ahead: int) -> float:
        """Seconds until `ahead` requests (of any model) have left the pool."""
        return self._retry_after(self._ended.values(), ahead)

    def _retry_after(self, series: Iterable[deque[float] | None], ahead: int) -> float:
        now = self._clock()
        count, oldest = 0, now
        for times in series:
            if times is None:
                continue
            while times and times[0] < now - self.window_s:
                times.popleft()
            if times:
                count += len(times)
                oldest = min(oldest, times[0])
        if count == 0:
            stuck = ahead > 0 and now - self._since >= self.window_s
            return self.max_s if stuck else self.default_s
        rate = count / max(now - oldest, 1.0)  # a burst of endings right after start is not a rate of thousands
        return min(self.max_s, max(self.min_s, ahead / rate))
