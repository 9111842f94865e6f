"""From the parsed `serve` flags to what one server process serves: the validated
ServerConfig (before any model loads) and the engine with its FastAPI app. `prefixserve serve`
builds one; each Ray replica of `serve --replicas N` builds its own from the launcher's flags."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib

from .config import ServerConfig, ServerLimits
from .tenancy import Tenants, key_tenant, read_keys_file

log = logging.getLogger(__name__)

API_KEY_ENV = "PREFIXSERVE_API_KEY"
ADMIN_KEY_ENV = "PREFIXSERVE_ADMIN_API_KEY"


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
