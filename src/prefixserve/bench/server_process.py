"""The `prefixserve serve` process a serving benchmark runs against: started per config with
the engine's flags (or an existing server at --base-url), healthy before the load starts, stopped
with SIGTERM after it (its log kept only if it failed)."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from . import results as R

log = logging.getLogger(__name__)


def scale_out_flags(args, router: str | None) -> list[str]:
    """`serve` flags for --replicas (with this router) and --server-flags."""
    flags = ["--replicas", str(args.replicas), "--router", router or args.routers[0]] if args.replicas else []
    return flags + shlex.split(args.server_flags)


@contextlib.contextmanager
def server(args, config: str, engine_kw: dict, extra: list[str]) -> Iterator[str]:
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    port = _free_port()
    cmd = [sys.executable, "-m", "prefixserve.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--max-concurrent-requests", str(max(256, args.num_prompts + 1)),
           *engine_flags({**engine_kw, **R.CONFIGS[config]}), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if args.api_key:
        env["PREFIXSERVE_API_KEY"] = args.api_key
    with tempfile.NamedTemporaryFile("w+b", prefix=f"prefixserve-{config}-", suffix=".log", delete=False) as logf:
        log_path = Path(logf.name)
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, args.startup_timeout, log_path)
        yield url
    finally:
        _stop(proc)
        if proc.returncode not in (0, -signal.SIGTERM):
            log.warning("the %s server exited with %s; its log: %s", config, proc.returncode, log_path)
        else:
            log_path.unlink(missing_ok=True)


def engine_flags(kwargs: dict) -> list[str]:
    """Engine keyword arguments -> `prefixserve serve` flags (add_engine_args' spelling)."""
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{_tail(log_path)}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout:g} s:\n{_tail(log_path)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
