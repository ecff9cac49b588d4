"""Every error the gateway returns, in OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`.

Handlers here turn FastAPI's own failures (unknown route, wrong method,
validation) into the same envelope, so a client's error path never sees
another shape. Overload answers carry `Retry-After` (whole seconds).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("modelpool.gateway")


class APIError(Exception):
    """An error answer: HTTP status plus the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def sse(self) -> bytes:
        """The error as the last event of a stream that already started."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def bad_request(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, known: list[str]) -> APIError:
    return APIError(404, f"The model {model!r} does not exist; served models: {', '.join(sorted(known))}",
                    param="model", code="model_not_found")


def unauthorized(message: str = "Invalid or missing API key (send 'Authorization: Bearer <key>')") -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


def queue_full(message: str, retry_after_s: float) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="model_queue_full", retry_after_s=retry_after_s)


def unavailable(message: str, retry_after_s: float, code: str = "pool_unavailable") -> APIError:
    return APIError(503, message, type="service_unavailable", code=code, retry_after_s=retry_after_s)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def validation_error(errors: Any) -> APIError:
    """A 400 naming the first bad field (`messages.0.content`), what was wrong and what came."""
    errors = list(errors)
    if not errors:
        return bad_request("invalid request body", None)
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body",)]
    param = ".".join(loc) or None
    got = first.get("input")
    shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
    if len(shown) > 80:
        shown = shown[:77] + "..."
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"{param or 'body'}: {first.get('msg', 'invalid')} (got {shown}){more}", param)
