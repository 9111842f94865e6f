"""`prefixserve serve`: load the engine, pin system prompts, serve the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import socket

from .config import LIMIT_HELP, ServerConfig, ServerLimits
from .tenancy import Tenants, key_tenant, read_keys_file

log = logging.getLogger(__name__)

API_KEY_ENV = "PREFIXSERVE_API_KEY"
ADMIN_KEY_ENV = "PREFIXSERVE_ADMIN_API_KEY"


def register(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                   "/metrics and /version over HTTP.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--api-key", action="append", default=None, help=f"require `Authorization: Bearer KEY` on "
                   f"every route but GET /health; repeatable, each key its own tenant (default: ${API_KEY_ENV}; "
                   f"no key at all: no auth). Keys on the command line show in `ps`: prefer the file or environment")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="API keys and their tenants, one `KEY TENANT` per line (# comments): tenants never share "
                        "cached prefixes, except public pins")
    p.add_argument("--admin-api-key", default=None, help=f"the operator's key: public pins, every tenant's pins, "
                   f"/metrics and /health?detail=1 once there is more than one key (default: ${ADMIN_KEY_ENV})")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    p.add_argument("--pin-system-prompt", action="append", default=[], metavar="FILE",
                   help="a file whose text is a system prompt: its chat-templated prefix is computed once at "
                        "start and never evicted (repeatable; the file's final newlines are dropped)")
    p.add_argument("--health-stall-timeout", type=float, default=ServerConfig.health_stall_timeout,
                   help="seconds with work but no finished step before /health answers 503")
    p.add_argument("--request-body-timeout", type=float, default=ServerConfig.body_timeout,
                   help="seconds a client gets to send its whole request body before a 408")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests get before they are aborted")
    g = p.add_argument_group("limits (a request over one is refused with a 4xx)")
    for f in dataclasses.fields(ServerLimits):
        g.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, help=LIMIT_HELP[f.name])
    add_engine_args(p)
    from ..serve_ray.options import add_args as add_scale_out_args  # imports no ray
    add_scale_out_args(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:  # only then is ray imported
        from ..serve_ray.launch import serve_replicas
        return serve_replicas(args)
    from .runner import run
    server_config(args)  # the flags, checked before the port is taken
    sock = _bind(args.host, args.port)  # a busy port or a foreign address fails before the model loads
    app, async_engine = build_app(args)
    return run(app, async_engine, sock, args.shutdown_timeout)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the flags ask for, validated before any model loads; the default model
    name is known only after, so it is "pending" here."""
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
    return ServerConfig(args.served_model_name or "pending", _tenants(args), limits, args.health_stall_timeout,
                        args.request_body_timeout)


def build_app(args: argparse.Namespace):
    """The engine and the FastAPI app serving it (its lifespan starts the engine): what one
    process serves, and what each replica of `--replicas N` serves."""
    from ..cli import engine_kwargs
    from ..config import EngineConfig
    from ..engine.async_engine import AsyncEngine
    from ..engine.engine import LLMEngine
    from .api import create_app
    from .metrics import Metrics

    cfg = server_config(args)
    pins = [_read(path) for path in args.pin_system_prompt]  # fail before the model loads
    if not cfg.tenants.auth and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key", args.host)
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    if args.served_model_name is None:
        cfg = dataclasses.replace(cfg, served_model_name=engine.model_name)
    for path, text in zip(args.pin_system_prompt, pins, strict=True):
        _pin(engine, path, text)
    metrics = Metrics(cfg.served_model_name, engine.backend_name, cfg.tenants.names)
    async_engine = AsyncEngine(engine, observer=metrics)
    metrics.watch(lambda: async_engine.snapshot)
    return create_app(async_engine, cfg, metrics), async_engine


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"--port must be in [1, 65535], got {port}")
    return port


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def _tenants(args: argparse.Namespace) -> Tenants:
    """The keys and tenants of the flags and environment; `args.tenants` when already resolved
    (Ray replicas get the launcher's, so that every process resolves keys alike)."""
    if getattr(args, "tenants", None) is not None:
        return args.tenants
    keys = args.api_key if args.api_key is not None else [k for k in [os.environ.get(API_KEY_ENV)] if k]
    pairs = tuple((k, key_tenant(k)) for k in keys)
    if args.api_keys_file is not None:
        pairs += read_keys_file(args.api_keys_file)
    return Tenants(pairs, args.admin_api_key or os.environ.get(ADMIN_KEY_ENV) or None)


def _read(path: str) -> str:
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the system prompt file {path}: {e}") from e
    if not text.strip():
        raise ValueError(f"the system prompt file {path} is empty")
    return text.rstrip("\n")  # the newline that ends a text file is not part of the prompt


def _pin(engine, path: str, text: str) -> None:
    from .chat import system_prefix_ids
    pin = engine.pin_prefix(system_prefix_ids(engine.tokenizer, text), public=True)
    log.info("pinned the system prompt of %s (public, every tenant reads it): %d tokens", path, len(pin.token_ids))
