"""Ingress: the one HTTP endpoint of `--replicas N`. It checks what the replicas would refuse
anyway before routing (the same auth and body-limit middleware as the single-process server),
builds the routing key, and relays the chosen replica's response. It answers two routes
itself, from the board: plain `GET /health` (200 while any replica can serve) and `/metrics`
(every replica's series with a `replica` label).

A replica that dies before its response starts gives a 503; after (a stream), the stream
ends with an OpenAI-shaped error event: never a hang.
"""

from __future__ import annotations

import json
import logging

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..server.config import ServerConfig
from ..server.errors import error_body, error_response
from ..server.middleware import AuthMiddleware, BodyLimitMiddleware
from ..server.tenancy import request_tenant
from . import board as boards
from .bridge import HTTPCall
from .routing_key import routing_key

log = logging.getLogger(__name__)


class Ingress:
    def __init__(self, cfg: ServerConfig, engine, board):
        self.cfg, self.engine, self.board = cfg, engine, board

    def __serve_build_asgi_app__(self):
        app = BodyLimitMiddleware(self._route, max_body_bytes=self.cfg.limits.max_body_bytes,
                                  timeout=self.cfg.body_timeout)
        return AuthMiddleware(app, tenants=self.cfg.tenants)  # the tenant, as the replicas resolve it

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            body, content_type = boards.merged_metrics(await self.board.read.remote())
            return await Response(body, media_type=content_type)(scope, receive, send)
        if scope["method"] == "GET" and scope["path"] == "/health" and not scope.get("query_string"):
            return await self._health(scope, receive, send)
        await self._forward(scope, receive, send)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        problem = boards.health(await self.board.read.remote())
        response = (JSONResponse({"status": "ok"}) if problem is None
                    else JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503))
        await response(scope, receive, send)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _body(receive)
        headers = list(scope["headers"])
        call = HTTPCall(scope["method"], scope["path"], scope.get("query_string", b""), headers, body,
                        routing_key(request_tenant(scope), body))
        messages = self.engine.options(stream=True).serve_call.remote(call)
        try:
            start = await messages.__anext__()
        except Exception as e:  # a replica that died or could not be reached
            log.warning("no replica answered %s %s: %r", scope["method"], scope["path"], e)
            response = error_response(503, f"the replica serving this request failed: {type(e).__name__}",
                                      None, "replica_unavailable")
            return await response(scope, receive, send)
        await send(start)
        await _relay(messages, send, _is_stream(start))


async def _relay(messages, send: Send, stream: bool) -> None:
    """The rest of the replica's messages; if the replica dies first, an error event (streams)
    and the end of the body."""
    try:
        async for message in messages:
            await send(message)
            if not message.get("more_body", False):
                return
    except Exception as e:  # ends this response only
        log.warning("the replica failed mid-response: %r", e)
        if stream:
            event = error_body(503, f"the replica serving this request failed: {type(e).__name__}", None,
                               "replica_unavailable")
            await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                        "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _is_stream(start: dict) -> bool:
    content_type = dict(start.get("headers", ())).get(b"content-type", b"")
    return content_type.startswith(b"text/event-stream")


async def _body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
