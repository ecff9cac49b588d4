"""Tokens from the pool's loop thread to the client, unbuffered.

`TokenQueue` is a request's sink: the pool calls it from its loop thread and
it hops each item onto the event loop (`call_soon_threadsafe` into an
`asyncio.Queue`, one wake-up for all the tokens of a step: `Hopper`). `SSEResponse` writes each server-sent event as soon as it
exists - tokens already waiting are joined into one write, nothing is held
back - and listens for the client going away the whole time, so a
disconnect cancels the request in the pool at once, even while it is still
queued. (`Disconnect` does the same for the wait before a response starts.)

A stream's queue is bounded: a client that stops reading blocks the socket
write, and its tokens pile up here. Past `max_buffered` unread tokens the
request is cancelled (the pool cannot pause one request without holding its
whole model's turn), the buffered tokens are dropped, and the stream's last
event says why (`SlowClient`). Pausing would keep KV reserved for a client
that may never come back; cancelling frees it at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pool.engines.base import TokenOut

log = logging.getLogger("modelpool.gateway")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Hopper:
    """Carries items from the pool's loop thread onto one event loop: one wake-up per batch, not per token.

    A decode step delivers a token to every request of its batch; the first
    schedules a drain on the event loop, the rest of the step rides along.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[TokenQueue, TokenOut | BaseException]] = []
        self._scheduled = False

    def put(self, queue: TokenQueue, item: TokenOut | BaseException) -> None:
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending, self._scheduled = self._pending, [], False
        for queue, item in batch:
            queue.deliver(item)


class SlowClient(Exception):
    """A stream's client left `num_unread` tokens unread, more than the gateway buffers; the request was cancelled."""

    def __init__(self, num_unread: int) -> None:
        super().__init__(f"the client read too slowly: {num_unread} tokens were waiting unread, the most a stream "
                         "may buffer; the request was cancelled")
        self.num_unread = num_unread


class TokenQueue:
    """A request's sink: called on the pool's thread, read on the event loop.

    With `max_buffered`, at most that many unread tokens (plus a last item)
    are held; one more calls `on_overflow` (which cancels the request) and
    replaces them all by one `SlowClient`.
    """

    def __init__(self, hopper: Hopper, max_buffered: int | None = None,
                 on_overflow: Callable[[], object] | None = None) -> None:
        self._hopper = hopper
        self._queue: asyncio.Queue[TokenOut | BaseException] = asyncio.Queue()
        self.max_buffered = max_buffered
        self._on_overflow = on_overflow
        self.overflowed = False
        self.peak_buffered = 0  # most items ever waiting unread

    def __call__(self, item: TokenOut | BaseException) -> None:
        self._hopper.put(self, item)

    def deliver(self, item: TokenOut | BaseException) -> None:
        """On the event loop: queue `item`, or give up on a reader that fell too far behind."""
        if self.overflowed:
            return
        last = isinstance(item, BaseException) or item.finished  # the request is over: its last item always fits
        if self.max_buffered is not None and not last and self._queue.qsize() >= self.max_buffered:
            self.overflowed = True
            num_unread = self._queue.qsize()
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(SlowClient(num_unread))
            if self._on_overflow is not None:
                self._on_overflow()
            return
        self._queue.put_nowait(item)
        self.peak_buffered = max(self.peak_buffered, self._queue.qsize())

    @property
    def num_buffered(self) -> int:
        return self._queue.qsize()

    async def get(self) -> TokenOut | BaseException:
        return await self._queue.get()

    def take_ready(self) -> list[TokenOut | BaseException]:
        """Everything already delivered (never waits)."""
        out = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Disconnect:
    """Watches one request's connection until `close()`; `race(aw)` returns aw's result or raises ClientGone."""

    def __init__(self, receive: Receive) -> None:
        self._task = asyncio.ensure_future(_wait_disconnect(receive))

    async def race(self, awaitable: Any) -> Any:
        work = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait({work, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise ClientGone()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class ClientGone(Exception):
    """The client closed its connection."""


class SSEResponse(Response):
    """`text/event-stream` from an async iterator of ready-made event bytes; `on_disconnect` when the client
    leaves, `on_close` when the response is over either way."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], object],
                 on_close: Callable[[], object] | None = None) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        writer = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            completed = writer.done() and not writer.cancelled() and writer.exception() is None
            if not completed:  # the client left, or writing to it failed: the request is abandoned
                self.on_disconnect()
                error = writer.exception() if writer.done() and not writer.cancelled() else None
                if error is not None and not isinstance(error, OSError):
                    log.error("stream failed: %r", error, exc_info=error)
            for task in (writer, watcher):
                task.cancel()
            for task in (writer, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        finally:
            if self.on_close is not None:
                self.on_close()
            await self.events.aclose()  # type: ignore[attr-defined]
