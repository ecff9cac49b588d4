"""The live pool's error types, in one module below everything else in `pool`.

Three layers raise them and several catch them, so they live where any
module may import them without lifting itself above another: an engine
refuses a call (`EngineError`, `OutOfKvMemory`); a backend reports that the
process behind an instance is gone (`InstanceDied`, `CallTimedOut`); the pool
ends a request it cannot serve (`RequestFailed`) or turns one away at the door
(`PoolClosed`, `PoolBusy`, `QueueFull`: the gateway maps them to HTTP codes).
"""

from __future__ import annotations


# ---- an engine's refusals ---------------------------------------------------------------------------
class EngineError(RuntimeError):
    """A call the engine cannot carry out in its current state (a caller bug or a full device)."""


class OutOfKvMemory(EngineError):
    """Not enough free KV blocks for the call; nothing was changed. A refusal, not a failure: the pool sends
    the requests on that instance back to the queue and keeps the instance (`pool.controller`)."""


# ---- a backend's word on an instance ----------------------------------------------------------------
class InstanceDied(RuntimeError):
    """A backend's word that the process behind an instance is gone (a Ray actor died, was killed)."""


class CallTimedOut(InstanceDied):
    """An engine call got no answer within the controller's `call_timeout_s`: its instance counts as dead."""


# ---- a request's end or refusal -------------------------------------------------------------------------
class RequestFailed(RuntimeError):
    """The pool could not serve a request (the reason is the scheduler's or the engine's)."""


class PoolClosed(RuntimeError):
    """The pool is not running (not started, stopping, or its loop died)."""


class PoolBusy(RuntimeError):
    """The pool holds `max_requests` requests already; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(RuntimeError):
    """`model` has `max_queued_per_model` requests waiting for their first token already."""

    def __init__(self, model: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.model = model
        self.retry_after_s = retry_after_s
