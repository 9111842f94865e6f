"""Checks on the raw ASGI scope, before routing, so they cover every route (unknown ones too).

- `AuthMiddleware`: with API keys set, every request but a plain `GET /health` (no query:
  its `?detail=1` form runs the integrity check, which costs engine time) needs
  `Authorization: Bearer KEY`; compared in constant time (server/tenancy.py). It puts the
  key's tenant in `request.state.tenant` (ANONYMOUS without keys). With more than one key
  (two tenants, or one and the admin), `/metrics` and `/health?detail=1` show every tenant's
  traffic: they are the admin key's alone (403).
  Refusals are counted through `on_error(status)` like every other error.
- `BodyLimitMiddleware`: reads the body up to `max_body_bytes` (413 above it, whether declared
  by Content-Length or streamed chunked), then replays it to the app; later `receive()` calls
  go to the server, so the app still learns of a client's disconnect. A body not complete
  within `timeout` seconds is a 408 (a stalled half-sent body would hold its connection and
  its memory forever).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response
from .tenancy import ADMIN, Tenants

_BODY_METHODS = {"POST", "PUT", "PATCH"}


class AuthMiddleware:
    def __init__(self, app: ASGIApp, tenants: Tenants, on_error: Callable[[int], None] | None = None):
        self.app, self.tenants, self.on_error = app, tenants, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        tenant = self.tenants.tenant_of(dict(scope["headers"]).get(b"authorization", b""))
        scope.setdefault("state", {})["tenant"] = tenant
        if tenant is None and not _open(scope):
            return await self._refuse(scope, receive, send, 401, "invalid or missing API key: send "
                                      "`Authorization: Bearer KEY`", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if self.tenants.shared and tenant != ADMIN and _all_tenants(scope):
            return await self._refuse(scope, receive, send, 403, f"{scope['path']} shows every tenant's "
                                      "traffic: it needs the admin API key", "admin_only", None)
        return await self.app(scope, receive, send)

    async def _refuse(self, scope, receive, send, status, message, code, headers) -> None:
        if self.on_error is not None:
            self.on_error(status)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await error_response(status, message, None, code, headers)(scope, receive, send)


def _open(scope: Scope) -> bool:
    """A plain liveness probe: no key needed."""
    return scope["path"] == "/health" and not scope.get("query_string")


def _all_tenants(scope: Scope) -> bool:
    return scope["path"] == "/metrics" or (scope["path"] == "/health" and bool(scope.get("query_string")))


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, timeout: float):
        self.app, self.limit, self.timeout = app, max_body_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive)
        except TimeoutError:
            response = error_response(408, f"the request body did not arrive within {self.timeout:g} s",
                                      None, "request_timeout", {"Connection": "close"})
            return await response(scope, receive, send)
        if body is None:
            return await self._too_large(scope, receive, send)
        if body is not False:
            await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | Literal[False] | None:
        """The whole body; None: over the limit; False: the client left before sending it."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"the request body is over the limit of {self.limit} bytes",
                                  None, "request_too_large", {"Connection": "close"})
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay
