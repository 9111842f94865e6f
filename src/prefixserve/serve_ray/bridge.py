"""One HTTP request carried from the ingress to an engine replica through a Ray Serve handle.

    client ─HTTP─> Ray's proxy ─> Ingress (auth, body limit, routing key; ingress.py)
        ─ handle.remote(HTTPCall) ─ Ray's router picks a replica by HTTPCall.prompt ─>
    EngineReplica: ASGIBridge runs the unchanged server app (server/api.py) on the call and
        streams back the app's ASGI `send` messages, which the ingress replays to its client

The replica's app sees exactly what a single-process server sees (method, path, query,
headers, body), so routes, auth, validation, errors, streaming and usage are the same code.
When the ingress stops reading (its client left), Ray cancels the replica's generator and the
app's next `receive()` answers `http.disconnect`: the app aborts the request, as it would alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from starlette.types import ASGIApp, Message

log = logging.getLogger(__name__)

REPLICA_HEADER = b"x-prefixserve-replica"


@dataclasses.dataclass(frozen=True)
class HTTPCall:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]  # lower-case names, as in an ASGI scope
    body: bytes
    prompt: str  # the routing key (routing_key.py); Ray's prefix router reads this attribute by name

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query_string, "root_path": "", "headers": self.headers,
                "client": None, "server": None}


class ASGIBridge:
    """Runs calls on an ASGI app and yields what the app sends, the response start first."""

    def __init__(self, app: ASGIApp, replica: str):
        self.app, self.replica = app, replica.encode()
        self._tasks: set[asyncio.Future[None]] = set()  # apps still running after their caller left

    async def run(self, call: HTTPCall) -> AsyncIterator[Message]:
        sent: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        body = [{"type": "http.request", "body": call.body, "more_body": False}]

        async def receive() -> Message:
            if body:
                return body.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.replica)]}
            sent.put_nowait(message)

        def finished(task: asyncio.Future[None]) -> None:
            self._tasks.discard(task)
            sent.put_nowait(None)
            _log_failure(task)

        task = asyncio.ensure_future(self.app(call.scope(), receive, send))  # ASGIApp: any Awaitable
        self._tasks.add(task)
        task.add_done_callback(finished)
        try:
            while (message := await sent.get()) is not None:
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    return
        finally:
            gone.set()  # finished, or the caller left: either way the app may see a disconnect now


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the app failed on a call", exc_info=task.exception())
