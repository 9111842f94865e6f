"""Running the app under uvicorn, with the engine's part of a graceful shutdown.

On SIGINT/SIGTERM uvicorn stops listening and waits for the requests in flight. Meanwhile the
engine refuses new ones (and /health turns 503), and after `drain_timeout` seconds it aborts
the rest, so each ends with an error (an SSE error event, or a 503) rather than a cut
connection. uvicorn cancels whatever is still left `CANCEL_AFTER_ABORT_S` later; then the
app's lifespan joins the engine thread.
"""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI

from ..engine.async_engine import AsyncEngine

CANCEL_AFTER_ABORT_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float):
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout

    async def shutdown(self, sockets=None) -> None:
        self.engine.stop_accepting()
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run(app: FastAPI, engine: AsyncEngine, host: str, port: int, drain_timeout: float) -> int:
    config = uvicorn.Config(app, host=host, port=port, log_config=None,
                            timeout_graceful_shutdown=drain_timeout + CANCEL_AFTER_ABORT_S)
    try:
        DrainingServer(config, engine, drain_timeout).run()
    except KeyboardInterrupt:  # after a graceful shutdown on a signal, uvicorn raises that signal again
        return 130
    return 0
