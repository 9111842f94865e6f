"""Helpers: a real `prefixserve serve` process on a free loopback port, with or without
`--replicas`, its Ray processes, and a check that stopping it leaves none of them behind."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

API_KEY = "test-key-ray-20"
ENGINE_ARGS = ("--kv-cache-memory", str(128 << 20), "--api-key", API_KEY, "--shutdown-timeout", "2")
STARTUP_TIMEOUT_S = 400


@dataclasses.dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: pathlib.Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def get(self, path: str, auth: bool = True) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
        return httpx.get(self.url + path, headers=headers, timeout=60)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def processes(self) -> set[tuple[int, float]]:
        """(pid, start time) of the server and every process under it: with --replicas, Ray's
        GCS, raylet, workers and agents."""
        root = psutil.Process(self.proc.pid)
        return {(p.pid, p.create_time()) for p in [root, *root.children(recursive=True)]}


def launch(tmp_path_factory, *extra: str):
    """Generator for a module fixture: start, wait for /health, yield, SIGTERM, check the exit
    and that no process it started is left."""
    tmp = tmp_path_factory.mktemp("server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp / "server.log"
    cmd = [sys.executable, "-m", "prefixserve.cli", "serve", "--port", str(port), *ENGINE_ARGS, *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if server.get("/health", auth=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server was not healthy within {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")


def _stop(server: Server) -> None:
    if server.proc.poll() is not None:
        pytest.fail(f"the server died early ({server.proc.returncode}):\n{server.log_tail()}")
    started = server.processes()
    server.proc.send_signal(signal.SIGTERM)
    try:
        rc = server.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        pytest.fail(f"the server did not stop within 90 s of SIGTERM:\n{server.log_tail()}")
    assert rc in (0, -signal.SIGTERM), f"the server exited with {rc}:\n{server.log_tail()}"
    left = _alive(started, deadline=time.monotonic() + 15)
    assert not left, f"processes left after shutdown: {left}"


def _alive(processes: set[tuple[int, float]], deadline: float) -> list[str]:
    """The processes still running (not zombies) at the deadline, or none once all are gone."""
    while True:
        left = []
        for pid, started in processes:
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:100]}")
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
