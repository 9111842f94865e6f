"""Start-up errors: each a one-line error and a non-zero exit, and those that need no model
(a bad port, a busy port, an address not on this machine, a missing pin file) before it loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from server_process import free_port

NO_MODEL_NEEDED_S = 30  # far below a model load on a loaded CI machine; python + imports only


def serve(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "prefixserve.cli", "serve", *args], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return out, time.monotonic() - t


def last_error_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if "error" in line]
    assert lines and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[-1]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (("--port", "70000"), "--port must be in [1, 65535], got 70000"),
    (("--port", "0"), "--port must be in [1, 65535], got 0"),
    (("--host", "10.255.255.1"), "cannot listen on 10.255.255.1:"),
    (("--pin-system-prompt", "/nonexistent/system.txt"), "cannot read the system prompt file /nonexistent"),
    (("--model", "/nonexistent/model"), "model '/nonexistent/model' not found"),
])
def test_refused_before_the_model_loads(args, message):
    out, seconds = serve("--port", str(free_port()), *args)
    assert out.returncode == 2 and message in last_error_line(out), out.stderr[-3000:]
    assert "KV cache:" not in out.stderr and seconds < NO_MODEL_NEEDED_S


def test_a_busy_port_is_refused_before_the_model_loads(busy_port):
    out, seconds = serve("--port", str(busy_port))
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{busy_port}: Address already in use" in \
        last_error_line(out), out.stderr[-3000:]
    assert "KV cache:" not in out.stderr and seconds < NO_MODEL_NEEDED_S


@pytest.mark.parametrize("memory, message", [
    (1 << 20, "the KV cache holds 0 chunks; give it more memory"),
    (2 * 737280, "cannot hold a single sequence; raise kv_cache_memory"),  # 2 chunks of 16 tokens: 1 + a spare
])
def test_a_kv_cache_too_small_for_one_sequence(memory, message):
    out, _ = serve("--port", str(free_port()), "--kv-cache-memory", str(memory))
    assert out.returncode == 2 and message in last_error_line(out), out.stderr[-3000:]
