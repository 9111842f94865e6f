"""`prefixserve serve`: load the engine, pin system prompts, serve the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket

from .config import LIMIT_HELP, ServerConfig, ServerLimits
from .setup import ADMIN_KEY_ENV, API_KEY_ENV, build_app, server_config

log = logging.getLogger(__name__)


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
