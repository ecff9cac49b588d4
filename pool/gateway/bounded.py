"""Running request-driven CPU work (chat templates, tokenising) off the event loop, with a time bound.

A chat template is a Jinja program and rendering one is pure Python: on the
event loop, a template with a nested loop blocked every client (`/health`
included) for as long as it ran. `run_bounded` runs the work on a thread of
its own, so the event loop keeps answering (it gets the GIL back every
switch interval), and past `timeout_s` raises `Overrun` inside that thread:
a Python thread cannot be killed, but an asynchronous exception ends a
render or any other pure-Python loop at its next bytecode. (Work inside a C
call, such as the Rust tokenizer, ends when that call returns; what reaches
it is bounded by the request limits.) The caller gets `TimeoutError` at the
bound either way.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Overrun(BaseException):
    """Raised inside a bounded thread past its time (a BaseException: no `except Exception` swallows it)."""


class _Bounded(threading.Thread):
    def __init__(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop, future: asyncio.Future[T]) -> None:
        super().__init__(name="modelpool-bounded", daemon=True)
        self._fn = fn
        self._loop = loop
        self._future = future
        self._lock = threading.Lock()
        self._running = True

    def run(self) -> None:
        outcome: tuple[bool, object]
        try:
            try:
                outcome = (True, self._fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                outcome = (False, exc)
            finally:
                with self._lock:
                    self._running = False
        except Overrun as exc:  # delivered just as the work ended
            outcome = (False, exc)
        try:
            self._loop.call_soon_threadsafe(self._settle, outcome)
        except RuntimeError:  # the event loop is gone
            pass

    def _settle(self, outcome: tuple[bool, object]) -> None:
        if self._future.done():  # timed out or cancelled already
            return
        ok, value = outcome
        if ok:
            self._future.set_result(value)  # type: ignore[arg-type]
        else:
            self._future.set_exception(value)  # type: ignore[arg-type]

    def interrupt(self) -> bool:
        """Raise `Overrun` in the thread if its work still runs; whether it did."""
        with self._lock:
            if not self._running or self.ident is None:
                return False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(Overrun))
            return True


async def run_bounded(fn: Callable[[], T], timeout_s: float) -> T:
    """`fn()` on its own thread; its result, its exception, or `TimeoutError` after `timeout_s` (work stopped)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    worker = _Bounded(fn, loop, future)
    worker.start()
    try:
        return await asyncio.wait_for(future, timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        worker.interrupt()  # the client left or the bound passed: the work has no one to go to
        raise
