"""The OpenAI-compatible HTTP server (`prefixserve serve`).

    cli.py          the `serve` subcommand: engine, pinned system prompts
    runner.py       uvicorn, with the engine's part of a graceful shutdown
    config.py       ServerConfig / ServerLimits (frozen, validated; the CLI's defaults)
    middleware.py   auth and body-size limit, on the raw ASGI scope (covers every route)
    api.py          the FastAPI app: routes, lifespan, error handlers
    protocol.py     pydantic request models (the only pydantic in the project)
    generation.py   one request's life: admission, engine stream, disconnects, SSE, usage
    completions.py  /v1/completions     chat.py  /v1/chat/completions (and system-prompt pinning)
    errors.py       OpenAI-shaped errors      metrics.py  Prometheus
"""
