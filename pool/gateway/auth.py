"""Optional API keys: Bearer tokens on /v1/*, an admin key on /pool/*.

Keys come from flags, environment variables or files (one key per line, `#`
comments); they are compared in constant time (`hmac.compare_digest` against
every key, no early exit) and never logged or echoed: a key's repr is its
fingerprint. With no API key set, /v1/* is open; with no admin key set,
/pool/* takes an API key (or is open when there is none either). /health and
/metrics stay open, as in vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from pool.gateway.errors import APIError, unauthorized

API_KEY_ENV = "MODELPOOL_API_KEY"
ADMIN_KEY_ENV = "MODELPOOL_ADMIN_KEY"


class Secret:
    """A key that never shows itself in logs, reprs or tracebacks."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value.encode()

    def matches(self, offered: bytes) -> bool:
        return hmac.compare_digest(self._value, offered)

    def __repr__(self) -> str:
        return f"Secret(sha256:{hashlib.sha256(self._value).hexdigest()[:8]})"

    __str__ = __repr__


def read_keys(flag_keys: Iterable[str] = (), key_file: Path | None = None, env_var: str | None = None) -> list[Secret]:
    """Keys from flags, a file (one per line; blank lines and `#` comments skipped) and an env var."""
    keys = [k.strip() for k in flag_keys if k and k.strip()]
    if key_file is not None:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if env_var and os.environ.get(env_var, "").strip():
        keys.append(os.environ[env_var].strip())
    return [Secret(k) for k in dict.fromkeys(keys)]


@dataclass(frozen=True)
class KeyChecker:
    api_keys: tuple[Secret, ...] = ()
    admin_keys: tuple[Secret, ...] = field(default_factory=tuple)

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)

    def check_api(self, authorization: str | None) -> None:
        if self.api_keys and not _any_match(self.api_keys, authorization):
            raise unauthorized()

    def check_admin(self, authorization: str | None) -> None:
        keys = self.admin_keys or self.api_keys
        if keys and not _any_match(keys, authorization):
            raise APIError(401, "This endpoint needs the admin key (send 'Authorization: Bearer <admin key>')",
                           code="invalid_api_key")


def _any_match(keys: Iterable[Secret], authorization: str | None) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    offered = token.strip().encode() if scheme.lower() == "bearer" else b""
    found = False
    for key in keys:  # no early exit: time does not depend on which key matched
        found |= key.matches(offered)
    return found and bool(offered)


class AuthMiddleware:
    """Plain ASGI (no per-request task or thread): checks keys on /v1/* and /pool/* before routing."""

    def __init__(self, app: ASGIApp, keys: KeyChecker) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            check = (self.keys.check_api if path.startswith("/v1/") or path == "/v1"
                     else self.keys.check_admin if path.startswith("/pool/") else None)
            if check is not None:
                header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                try:
                    check(header.decode("latin-1") if header is not None else None)
                except APIError as exc:
                    await exc.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)
