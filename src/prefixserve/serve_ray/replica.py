"""EngineReplica: one engine and the single-process server's app (server/setup.py build_app),
as a Ray Serve deployment. Ray's router sends it HTTPCalls; it answers with the app's ASGI
messages (bridge.py), reports to the board every second, and tells Ray Serve it is unhealthy
when its engine is (Ray then restarts it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

from starlette.types import Message

from .board import REPORT_INTERVAL_S, Report
from .bridge import ASGIBridge, HTTPCall

log = logging.getLogger(__name__)


class EngineReplica:
    async def __init__(self, args: argparse.Namespace, threads: int, board):  # type: ignore[misc]  # Ray Serve awaits it
        import torch
        from ray import serve

        from ..server.setup import build_app, server_config
        torch.set_num_threads(threads)
        self.cfg = server_config(args)
        self.app, self.engine = build_app(args)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.bridge = ASGIBridge(self.app, self.name)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))  # starts the engine
        self._board = board
        self._reporter = asyncio.create_task(self._report_forever())
        log.info("replica %s serving", self.name)

    async def serve_call(self, call: HTTPCall) -> AsyncIterator[Message]:
        async for message in self.bridge.run(call):
            yield message

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        problem = self.engine.health(self.cfg.health_stall_timeout)
        if problem is not None:
            raise RuntimeError(problem)

    async def _report_forever(self) -> None:
        while True:
            report = Report(socket.gethostname(), os.getpid(), self.engine.health(self.cfg.health_stall_timeout),
                            await self._metrics_text())
            try:
                await self._board.report.remote(self.name, report)
            except Exception as e:  # the board is gone at shutdown; keep serving
                log.warning("replica %s could not report: %r", self.name, e)
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def _metrics_text(self) -> str:
        authorization = self.cfg.tenants.operator_authorization()
        if authorization is None:  # tenants but no admin key: nobody may read /metrics
            return ""
        chunks = [m.get("body", b"") async for m in self.bridge.run(_metrics_call(authorization))]
        return b"".join(chunks[1:]).decode()

    async def __del__(self):
        """Ray Serve's graceful shutdown has already waited for requests in flight (up to
        `--shutdown-timeout`); whatever is left is aborted, and the engine thread joined."""
        if not hasattr(self, "_reporter"):
            return  # __init__ failed before the engine started
        self._reporter.cancel()
        self.engine.abort_all()
        await self._lifespan.aclose()


def _metrics_call(authorization: bytes) -> HTTPCall:
    headers = [(b"authorization", authorization)] if authorization else []
    return HTTPCall("GET", "/metrics", b"", headers, b"", "")
