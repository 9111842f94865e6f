"""The FastAPI app: OpenAI-compatible routes, health, metrics; see server/__init__.py for the map.

The app owns no engine state: `AsyncEngine` does, on its thread. The lifespan starts that
thread and, on shutdown (uvicorn turns SIGINT/SIGTERM into one, after giving in-flight
requests `--shutdown-timeout` seconds), aborts what is left and joins it.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..engine.async_engine import AsyncEngine, EngineDeadError
from . import errors
from .chat import create_chat_completion
from .completions import create_completion
from .config import ServerConfig
from .errors import APIError
from .generation import ClientGone, ServerState
from .metrics import Metrics
from .middleware import AuthMiddleware, BodyLimitMiddleware
from .prefixes import add_prefix_routes

log = logging.getLogger(__name__)


def create_app(engine: AsyncEngine, cfg: ServerConfig, metrics: Metrics) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving %s (attention backend %s)", cfg.served_model_name, engine.backend_name)
        yield
        await engine.shutdown()

    app = FastAPI(title="prefixserve", version=__version__, lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=cfg.limits.max_body_bytes, timeout=cfg.body_timeout)
    app.add_middleware(AuthMiddleware, tenants=cfg.tenants, on_error=metrics.count_error)  # added last: runs first
    errors.install(app, on_error=metrics.count_error)
    app.add_exception_handler(ClientGone, _client_gone)
    state = ServerState(engine, cfg)
    _add_openai_routes(app, state)
    add_prefix_routes(app, state)
    _add_ops_routes(app, engine, cfg, metrics)
    return app


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(state, request)

    def card() -> dict:
        return {"id": state.cfg.served_model_name, "object": "model", "created": state.started,
                "owned_by": "prefixserve", "max_model_len": state.engine.max_model_len}

    def check_alive() -> None:
        if state.engine.failure is not None:
            raise APIError(503, state.engine.failure, None, "engine_unavailable")

    @app.get("/v1/models")
    async def models():
        check_alive()
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_alive()
        if model != state.cfg.served_model_name:
            raise APIError(404, f"the model `{model}` does not exist", "model", "model_not_found")
        return card()


def _add_ops_routes(app: FastAPI, engine: AsyncEngine, cfg: ServerConfig, metrics: Metrics) -> None:
    @app.get("/health")
    async def health(detail: bool = False):
        """200 while the engine thread is alive and making progress, else 503. `?detail=1` also
        runs check_integrity() on the engine thread and reports the KV cache's state."""
        problem = engine.health(cfg.health_stall_timeout)
        if problem is None and detail:
            try:
                return {"status": "ok", **await engine.inspect(timeout=cfg.health_stall_timeout)}
            except AssertionError as e:
                log.error("integrity check failed: %s", e)
                return JSONResponse({"status": "unhealthy", "integrity": f"failed: {e}"}, status_code=500)
            except (TimeoutError, EngineDeadError) as e:
                problem = f"engine did not answer: {e!r}"
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)


async def _client_gone(request: Request, e: Exception) -> Response:  # e: ClientGone (its handler)
    log.info("client disconnected; request %s aborted", e)
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it
