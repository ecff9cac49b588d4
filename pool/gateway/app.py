"""The FastAPI app: one OpenAI-compatible endpoint in front of a `LivePool`.

A generation request is read and checked (`prompts.prepare`) and submitted
to the pool with a `TokenQueue` as its sink; whatever goes wrong until then
gets a proper HTTP status. A stream's headers go out at once and its tokens
as unbuffered SSE as they come; a failure after submission is its last
`data: {"error": ...}` event (as in vLLM). A non-streamed answer is sent
whole, or an error status. From submission on, the client's connection is
watched; when it goes, the request is cancelled in the pool (its KV freed at
the next step boundary). A stream whose client stops reading is cancelled
once `max_buffered_tokens` tokens wait unread (`streaming.TokenQueue`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from pool.errors import RequestFailed
from pool.gateway.auth import AuthMiddleware, KeyChecker, Secret
from pool.gateway.errors import (APIError, bad_request, install_error_handlers, model_not_found, queue_full,
                                 unavailable, validation_error)
from pool.gateway.metrics import GatewayMetrics, RequestTimer
from pool.gateway.bounded import run_bounded
from pool.gateway.prompts import Prepared, RequestLimits, check, max_prompt_chars, prepare
from pool.gateway.schemas import ChatCompletionRequest, CompletionRequest, Kind, ResponseShape, model_card
from pool.gateway.streaming import DONE, ClientGone, Disconnect, Hopper, SlowClient, SSEResponse, TokenQueue, sse
from pool.service import LivePool, PoolBusy, PoolClosed, QueueFull

BIG_BODY_BYTES = 64 << 10  # tokenise bodies larger than this off the event loop
log = logging.getLogger("modelpool.gateway")


@dataclass(frozen=True)
class GatewaySettings:
    """How the gateway answers; keys are `auth.Secret`s (never printed)."""

    api_keys: tuple[Secret, ...] = ()  # Bearer keys for /v1/*; none = open
    admin_keys: tuple[Secret, ...] = ()  # keys for /pool/*; none = the API keys
    default_chat_max_tokens: int = 1024  # a chat without max_tokens gets at most this many
    max_body_bytes: int = 8 << 20  # larger bodies get 413
    max_buffered_tokens: int = 1024  # unread tokens one stream may hold before its request is cancelled
    # requests of one model in the pool (waiting or generating) before 429 model_share_full; None = no cap. With
    # it, one model's flood cannot take every `max_requests` slot and turn the other models' requests into 503s.
    max_requests_per_model: int | None = None
    unavailable_retry_after_s: float = 5.0  # Retry-After when the pool is down
    owned_by: str = "modelpool"  # /v1/models owned_by
    fingerprint: str | None = None  # system_fingerprint on every response (e.g. 'modelpool-sim')
    limits: RequestLimits = RequestLimits()  # stop strings, messages, request chat templates, template time
    body_timeout_s: float = 10.0  # a body not read whole by then gets 408 (a client holding half-sent bodies)
    max_connections: int = 2048  # open connections (and requests) uvicorn takes before answering 503


class Gateway:
    def __init__(self, pool: LivePool, settings: GatewaySettings) -> None:
        self.pool = pool
        self.settings = settings
        self.keys = KeyChecker(settings.api_keys, settings.admin_keys)
        # load now: the first request must not wait for a tokenizer
        infos = {info.name: info for info in pool.model_infos()}
        self._max_chars = {name: max_prompt_chars(pool.tokenizer(name), infos[name].max_model_len if name in infos
                                                  else pool.models[name].profile.max_context)
                           for name in pool.models}
        self.metrics = GatewayMetrics(pool, pool.models)
        self.metrics.drain.default_s = pool.config.retry_after_s  # until a drain rate is measured
        self.created = int(time.time())
        self._ids = itertools.count(1)
        self._id_prefix = uuid.uuid4().hex[:12]  # unique per gateway; a counter after it (uuid4 costs a syscall)
        self._hop: Hopper | None = None
        self._streams: dict[str, TokenQueue] = {}  # live streams, for their buffered tokens in /pool/status
        self.peak_buffered_tokens = 0  # most unread tokens any ended stream held
        self.num_slow_client_cancels = 0

    def _hopper(self) -> Hopper:
        loop = asyncio.get_running_loop()
        if self._hop is None or self._hop.loop is not loop:
            self._hop = Hopper(loop)
        return self._hop

    def model_list(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card(info) for info in self.pool.model_infos()]}

    def model(self, model_id: str) -> dict[str, Any]:
        for info in self.pool.model_infos():
            if info.name == model_id:
                return self._card(info)
        raise model_not_found(model_id, list(self.pool.models))

    def _card(self, info: Any) -> dict[str, Any]:
        return model_card(info.name, info.path.name or info.name, info.max_model_len, self.settings.owned_by,
                          self.created)

    def health(self) -> Response:
        """200 while the pool can serve every model now or once a restart under way (or due) is done; else 503
        naming the models it cannot (with every instance of a model lost for good it answered 200 while every
        request got 503, and a load balancer kept sending traffic)."""
        return self._serving(self.pool.unservable_models(now=False), "health")

    def readiness(self) -> Response:
        """200 only while every model has an instance up this moment (a restart under way: not ready)."""
        return self._serving(self.pool.unservable_models(now=True), "ready")

    def _serving(self, missing: list[str], what: str) -> Response:
        if not missing:
            return JSONResponse({"status": "ok"})
        if not self.pool.ready:
            message = "the pool is not running"
        else:
            message = f"no instance can serve {', '.join(missing)}" + (" now" if what == "ready" else "")
        return unavailable(message, self.settings.unavailable_retry_after_s).response()

    def status(self) -> dict[str, Any]:
        infos = {i.name: {"max_model_len": i.max_model_len} for i in self.pool.model_infos()}
        status = self.pool.status()
        for name, entry in status.get("models", {}).items():
            entry.update(infos.get(name, {}))
        streams = list(self._streams.values())
        peak = max([self.peak_buffered_tokens, *(q.peak_buffered for q in streams)])
        status["gateway"] = {"streams": len(streams), "buffered_tokens": sum(q.num_buffered for q in streams),
                             "max_buffered_tokens": self.settings.max_buffered_tokens, "peak_buffered_tokens": peak,
                             "slow_client_cancels": self.num_slow_client_cancels}
        return status

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, request: Request, kind: Kind) -> Response:
        arrived = time.perf_counter()
        body = await self._read(request, ChatCompletionRequest if kind == "chat" else CompletionRequest)
        infos = {i.name: i for i in self.pool.model_infos()}
        info = infos.get(body.model)
        if info is None:
            raise model_not_found(body.model, list(infos))
        model = info.name
        try:
            prepared = await self._prepare(request, body, info)
        except APIError as exc:
            self.metrics.error(model, exc.status)
            raise
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{self._id_prefix}{next(self._ids):x}"
        if prepared.stream:
            tokens = TokenQueue(self._hopper(), self.settings.max_buffered_tokens,
                                on_overflow=lambda: self._slow_client(request_id, model))
        else:  # the answer is collected as it comes: nothing waits on the client
            tokens = TokenQueue(self._hopper())
        self._submit(request_id, model, prepared, tokens)
        timer = self.metrics.timer(model, len(prepared.prompt_ids))
        timer.arrived_at = timer.last_at = arrived
        shape = ResponseShape(kind, request_id, model, self.settings.fingerprint)
        if prepared.stream:  # headers go out now, while the prompt is prefilled: off the TTFT path
            self._streams[request_id] = tokens
            return SSEResponse(self._events(tokens, shape, timer, prepared, request_id),
                               on_disconnect=lambda: self.pool.cancel(request_id),
                               on_close=lambda: self._stream_closed(request_id))
        watch = Disconnect(request.receive)
        try:
            return JSONResponse(await watch.race(self._collect(tokens, shape, timer, model)))
        except ClientGone:
            self.pool.cancel(request_id)
            timer.finished(None)
            return Response(status_code=499)  # nobody reads it; the connection is gone
        finally:
            await watch.close()

    async def _prepare(self, request: Request, body: CompletionRequest | ChatCompletionRequest, info: Any) -> Prepared:
        """The request checked, rendered and tokenised: chats and big bodies off the event loop, time-bounded."""
        tokenizer = self.pool.tokenizer(info.name)
        limits, max_tokens = self.settings.limits, self.settings.default_chat_max_tokens
        check(body, limits, self._max_chars.get(info.name), info.vocab_size or len(tokenizer))
        if not isinstance(body, ChatCompletionRequest) and getattr(request.state, "body_size", 0) <= BIG_BODY_BYTES:
            return prepare(body, info, tokenizer, max_tokens, limits)  # a short text: sub-millisecond
        where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        try:
            return await run_bounded(lambda: prepare(body, info, tokenizer, max_tokens, limits),
                                     limits.template_timeout_s)
        except TimeoutError:
            raise bad_request(f"{where}: rendering and tokenising the prompt took longer than "
                              f"{limits.template_timeout_s:g} s; refused", where, "prompt_timeout") from None

    async def _read(self, request: Request, schema: type[CompletionRequest] | type[ChatCompletionRequest]
                    ) -> CompletionRequest | ChatCompletionRequest:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.settings.max_body_bytes:
            raise APIError(413, f"request body of {size} bytes exceeds the limit of {self.settings.max_body_bytes}")
        try:
            raw = await asyncio.wait_for(request.body(), self.settings.body_timeout_s)
        except TimeoutError:
            raise APIError(408, f"the request body was not received within {self.settings.body_timeout_s:g} s",
                           code="body_timeout") from None
        request.state.body_size = len(raw)
        if len(raw) > self.settings.max_body_bytes:
            raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of {self.settings.max_body_bytes}")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"body: not valid JSON ({exc})", None, "invalid_json") from None
        if not isinstance(data, dict):
            raise bad_request(f"body: expected a JSON object, got {type(data).__name__}", None)
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    def _submit(self, request_id: str, model: str, prepared: Prepared, sink: TokenQueue) -> None:
        cap = self.settings.max_requests_per_model
        if cap is not None:
            queued, running = self.pool.load().get(model, (0, 0))
            if queued + running >= cap:
                self.pool.num_rejected[(model, "share_full")] += 1  # submit's counts are made on this thread too
                self.metrics.error(model, 429)
                raise APIError(429, f"{queued + running} requests of {model!r} are in the pool already, its share "
                               "limit", type="rate_limit_error", code="model_share_full",
                               retry_after_s=self.metrics.drain.model_retry_after_s(model, queued + running))
        try:
            self.pool.submit(request_id, model, prepared.prompt_ids, prepared.sampling, sink)
        except QueueFull as exc:
            self.metrics.error(model, 429)
            queued = self.pool.load().get(model, (0, 0))[0]
            raise queue_full(str(exc), self.metrics.drain.queue_retry_after_s(model, queued)) from None
        except PoolBusy as exc:
            self.metrics.error(model, 503)
            ahead = sum(q + r for q, r in self.pool.load().values())
            raise unavailable(str(exc), self.metrics.drain.pool_retry_after_s(ahead), code="pool_full") from None
        except PoolClosed as exc:
            self.metrics.error(model, 503)
            raise unavailable(str(exc), self.settings.unavailable_retry_after_s) from None

    def _slow_client(self, request_id: str, model: str) -> None:
        self.pool.cancel(request_id)
        self.num_slow_client_cancels += 1
        log.warning("request %s (%s) cancelled: its client stopped reading (%d tokens unread)", request_id, model,
                    self.settings.max_buffered_tokens)

    def _stream_closed(self, request_id: str) -> None:
        tokens = self._streams.pop(request_id, None)
        if tokens is not None:
            self.peak_buffered_tokens = max(self.peak_buffered_tokens, tokens.peak_buffered)

    def _failure(self, exc: BaseException, model: str) -> APIError:
        """What a pool-side failure means to the client."""
        if isinstance(exc, SlowClient):
            error = APIError(408, str(exc), code="slow_client")
        elif isinstance(exc, PoolClosed):
            error = unavailable(str(exc), self.settings.unavailable_retry_after_s)
        elif isinstance(exc, RequestFailed):
            error = unavailable(f"the pool could not serve the request: {exc}", self.settings.unavailable_retry_after_s,
                                code="request_failed")
        else:
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        self.metrics.error(model, error.status)
        return error

    async def _events(self, tokens: TokenQueue, shape: ResponseShape, timer: RequestTimer, prepared: Prepared,
                      request_id: str) -> AsyncIterator[bytes]:
        usage_field = prepared.include_usage
        ended = False
        try:
            while True:
                out: list[bytes] = []
                for token in [await tokens.get(), *tokens.take_ready()]:
                    if isinstance(token, BaseException):
                        ended = True
                        timer.finished(None)
                        yield b"".join(out) + self._failure(token, shape.model).sse() + DONE
                        return
                    if timer.num_tokens == 0 and shape.kind == "chat":
                        out.append(sse(shape.role_chunk(usage_field)))
                    timer.token()
                    if token.text or token.finished:
                        out.append(sse(shape.chunk(token.text, token.finish_reason, usage_field)))
                    if token.finished:
                        ended = True
                        timer.finished(token.finish_reason)
                        if usage_field:
                            out.append(sse(shape.usage_chunk(timer.prompt_tokens, timer.num_tokens)))
                        yield b"".join(out) + DONE
                        return
                if out:
                    yield b"".join(out)
        finally:
            if not ended:
                self.pool.cancel(request_id)
                timer.finished(None)

    async def _collect(self, tokens: TokenQueue, shape: ResponseShape, timer: RequestTimer,
                       model: str) -> dict[str, Any]:
        pieces: list[str] = []
        while True:
            item = await tokens.get()
            if isinstance(item, BaseException):
                timer.finished(None)
                raise self._failure(item, model)
            timer.token()
            pieces.append(item.text)
            if item.finished:
                timer.finished(item.finish_reason)
                return shape.final("".join(pieces), item.finish_reason, timer.prompt_tokens, timer.num_tokens)


def create_app(pool: LivePool, settings: GatewaySettings | None = None) -> FastAPI:
    """The gateway for `pool` (started or not: requests get 503 until it runs)."""
    gateway = Gateway(pool, settings or GatewaySettings())
    app = FastAPI(title="modelpool", description="Many LLMs behind one OpenAI-compatible endpoint.",
                  version="0.1.0")
    app.state.gateway = gateway
    install_error_handlers(app)
    app.add_middleware(AuthMiddleware, keys=gateway.keys)
    # endpoints are async: FastAPI runs sync ones on a thread pool, a hop every request would pay

    shared: dict[str, Any] = {}  # nested models, as components: a `#/$defs/...` ref would dangle in the document

    def body_schema(model: type[BaseModel]) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        shared.update(schema.pop("$defs", {}))
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    openapi = app.openapi

    def openapi_with_shared() -> dict[str, Any]:
        document = openapi()
        document.setdefault("components", {}).setdefault("schemas", {}).update(shared)
        return document

    app.openapi = openapi_with_shared  # type: ignore[method-assign]

    @app.get("/health", tags=["ops"])
    async def health() -> Response:
        return gateway.health()

    @app.get("/ready", tags=["ops"])
    async def ready() -> Response:
        return gateway.readiness()

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/pool/status", tags=["ops"])
    async def status() -> dict[str, Any]:
        return gateway.status()

    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict[str, Any]:
        return gateway.model_list()

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def model(model_id: str) -> dict[str, Any]:
        return gateway.model(model_id)

    @app.post("/v1/completions", tags=["openai"], openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await gateway.generate(request, "completion")

    @app.post("/v1/chat/completions", tags=["openai"],
              openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await gateway.generate(request, "chat")

    return app
