"""A dead engine never half-lives: with TP=3 on CPU, a worker killed mid-run turns the next
request into an OpenAI-shaped 5xx at once, and the server exits non-zero naming the rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from server_process import API_KEY, Server, _wait_healthy, free_port


def children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except OSError:
            pass
    return kids


def test_a_killed_worker_ends_the_server_with_an_error(tmp_path):
    port, log_path = free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-m", "prefixserve.cli", "serve", "--port", str(port), "--api-key", API_KEY,
           "--tensor-parallel-size", "3", "--device", "cpu", "--kv-cache-memory", str(16 << 20)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_healthy(server)
        model = server.get("/v1/models").json()["data"][0]["id"]
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        r = server.post("/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code in (500, 503) and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 1, server.log_tail()
    text = log_path.read_text(errors="replace")
    assert f"(pid {workers[1]}) was killed by SIGKILL" in text and "exiting: engine failed" in text, server.log_tail()
    assert not [p for p in workers if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    try:
        httpx.get(server.url + "/health", timeout=2)
        raise AssertionError("the server still answers after its engine died")
    except httpx.TransportError:
        pass
