"""Helpers: a real `prefixserve serve` process on a free loopback port (one per test module), driven over HTTP.

Each module makes its `server` fixture with `launch(tmp_path_factory, *extra_args)`; tearing it
down sends SIGTERM and requires a graceful shutdown (the engine thread joined) within 30 s.
"""

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
import pytest

API_KEY = "test-key-5f0c"
SYSTEM_PROMPT = "You are a pinned test assistant. Answer in one short sentence."
BASE_ARGS = ("--kv-cache-memory", str(256 << 20), "--max-num-seqs", "64", "--api-key", API_KEY,
             "--shutdown-timeout", "2")
STARTUP_TIMEOUT_S = 180


@dataclasses.dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: pathlib.Path
    model: str = ""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs)

    def post(self, path: str, body=None, *, content: bytes | None = None, headers=None, **kwargs) -> httpx.Response:
        headers = self.headers if headers is None else headers
        if content is not None:
            headers = {**headers, "Content-Type": "application/json"}
        kwargs.setdefault("timeout", 120)
        return httpx.post(self.url + path, json=body, content=content, headers=headers, **kwargs)

    def get(self, path: str, headers=None) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers if headers is None else headers, timeout=60)

    def detail(self) -> dict:
        r = self.get("/health?detail=1")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 60) -> dict:
        """Poll the integrity route until no request is running or waiting; returns its report."""
        deadline = time.monotonic() + timeout
        while True:
            d = self.detail()
            if d["running"] == 0 and d["waiting"] == 0 and d["streams"] == 0:
                return d
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {d}"
            time.sleep(0.2)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path_factory, *extra: str):
    """Generator for a module fixture: start the server, wait for /health, yield, SIGTERM it."""
    tmp = tmp_path_factory.mktemp("server")
    (tmp / "system.txt").write_text(SYSTEM_PROMPT + "\n")
    port = free_port()
    log_path = tmp / "server.log"
    cmd = [sys.executable, "-m", "prefixserve.cli", "serve", "--port", str(port),
           "--pin-system-prompt", str(tmp / "system.txt"), *BASE_ARGS, *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_healthy(server)
        server.model = server.get("/v1/models").json()["data"][0]["id"]
        yield server
    finally:
        _stop(server)


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail(f"the server was not healthy within {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        rc = server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        pytest.fail(f"the server did not shut down within 30 s of SIGTERM:\n{server.log_tail()}")
    assert rc == 0, f"the server exited with {rc} after SIGTERM (a drained shutdown is 0):\n{server.log_tail()}"
    assert "engine thread stopped" in server.log_path.read_text(errors="replace"), server.log_tail()
