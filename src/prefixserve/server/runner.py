"""Running the app under uvicorn, with the engine's part of a graceful shutdown.

On SIGINT/SIGTERM uvicorn stops listening and waits for the requests in flight. Meanwhile the
engine refuses new ones (and /health turns 503), and after `drain_timeout` seconds it aborts
the rest, so each ends with an error (an SSE error event, or a 503) rather than a cut
connection. uvicorn cancels whatever is still left `CANCEL_AFTER_ABORT_S` later; then the
app's lifespan joins the engine thread.

Exit status: 0 after a drain on SIGTERM (uvicorn would re-raise the signal: killed by SIGTERM
reads as a crash to supervisors), 130 after SIGINT, 1 when the engine thread died (the server
stops at once rather than live on answering 503s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

import uvicorn
from fastapi import FastAPI

from ..engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

CANCEL_AFTER_ABORT_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float):
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        self.signals: list[int] = []
        engine.on_death = self._engine_died

    def _engine_died(self) -> None:  # on the engine thread; uvicorn polls should_exit
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self.signals, self._captured_signals = list(self._captured_signals), []  # handled: not re-raised

    async def shutdown(self, sockets=None) -> None:
        self.engine.stop_accepting()
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run(app: FastAPI, engine: AsyncEngine, sock: socket.socket, drain_timeout: float) -> int:
    """Serve on `sock` (bound before the model loaded) until a signal or the engine's death."""
    # uvicorn annotates the timeout int but hands it to asyncio.wait_for, which takes a float
    config = uvicorn.Config(app, log_config=None,
                            timeout_graceful_shutdown=drain_timeout + CANCEL_AFTER_ABORT_S)  # type: ignore[arg-type]
    server = DrainingServer(config, engine, drain_timeout)
    server.run(sockets=[sock])
    if engine.failure is not None:
        log.error("exiting: %s", engine.failure)
        return 1
    return 130 if signal.SIGINT in server.signals else 0
