"""`prefixserve serve --replicas N`: start (or join) Ray, run the application, wait for
SIGINT/SIGTERM, take it all down.

    Ray's HTTP proxy ─> Ingress (1, no CPU reserved) ─ handle, Ray's router ─> EngineReplica (N)
                              └──────── reads ───────> Board <──── reports ─────┘

Started here (no --ray-address), the local Ray cluster is this process's: `ray.shutdown()`
stops it, and with it every Ray process. Joined (--ray-address), only this application is
deleted; the cluster stays.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import socket
import threading

from ..cli import engine_kwargs
from ..config import EngineConfig
from ..server.setup import server_config
from .options import ScaleOutConfig
from .routers import request_router_config

log = logging.getLogger(__name__)

APP_NAME = "prefixserve"
# Replicas that fail to start in a row before the application counts as failed: a bad engine
# setting (the model's heads not divisible by --tensor-parallel-size, no room for the model)
# fails every replica alike, and `serve` should exit with it, not retry forever.
MAX_START_FAILURES = 2


def serve_replicas(args: argparse.Namespace) -> int:
    scale = ScaleOutConfig.from_args(args)
    cfg = server_config(args)  # validated before Ray starts; replicas get the keys and tenants read here
    EngineConfig.from_kwargs(**engine_kwargs(args))
    args = argparse.Namespace(**{**vars(args), "tenants": cfg.tenants, "replicas": None})
    router = request_router_config(scale.router)  # a Ray without the router fails here, before starting
    _check_port(args.host, args.port)
    import ray
    from ray import serve

    ray.init(address=scale.ray_address, include_dashboard=False, log_to_driver=True,
             logging_level=logging.WARNING, configure_logging=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(_application(args, cfg, scale, router), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # Serve's word for replicas that failed to start
            log.error("the application did not start: %s", e)
            return 1
        log.info("serving on http://%s:%d with %d replicas (router %s)", args.host, args.port,
                 scale.replicas, scale.router)
        _wait_for_signal()
    finally:
        _take_down(scale)
    return 0


def _application(args: argparse.Namespace, cfg, scale: ScaleOutConfig, router):
    import ray
    from ray import serve

    from .board import Board
    from .ingress import Ingress
    from .replica import EngineReplica

    board = ray.remote(num_cpus=0)(Board).remote()  # owned by this process: it ends with it
    limits = cfg.limits
    engine = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=scale.replicas,
        ray_actor_options={"num_cpus": scale.cpus_per_replica, "num_gpus": scale.gpus_per_replica},
        max_ongoing_requests=limits.max_concurrent_requests,  # the replica's own 429 bound, not Serve's default 5
        graceful_shutdown_timeout_s=args.shutdown_timeout, health_check_period_s=5.0,
        max_constructor_retry_count=MAX_START_FAILURES,
        health_check_timeout_s=max(30.0, cfg.health_stall_timeout),
        **({"request_router_config": router} if router is not None else {}))
    ingress = serve.deployment(
        serve.ingress()(Ingress), name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=scale.replicas * limits.max_concurrent_requests + 16)
    threads = max(1, math.floor(scale.cpus_per_replica))
    # serve.deployment's overloads hide the Deployment that a call with options returns
    return ingress.bind(cfg, engine.bind(args, threads, board), board)  # type: ignore[attr-defined]


def _check_port(host: str, port: int) -> None:
    """Fail now, not after Ray and every replica started, if the port cannot be served."""
    try:
        with socket.create_server((host, port)):
            pass
    except (OSError, OverflowError) as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from e


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    while not stop.wait(1.0):
        pass
    log.info("shutting down")


def _take_down(scale: ScaleOutConfig) -> None:
    import ray
    from ray import serve
    try:
        if scale.ray_address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()
