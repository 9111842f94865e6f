"""Many clients at once, clients that leave early, and shutdown with requests in flight:
the server stays healthy and its KV cache ends exactly as it started."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import pytest

from server_process import launch

CLIENTS = 50


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from launch(tmp_path_factory)


@pytest.fixture(scope="module")
def baseline(server):
    """The idle state: only the pinned system prompt in use."""
    report = server.wait_idle()
    assert report["integrity"] == "ok"
    return report


def aborted_count(server) -> float:
    m = re.search(r'^prefixserve_requests_finished_total\{reason="abort"\} (\S+)$', server.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


async def stream_one(client: httpx.AsyncClient, server, i: int, leave_early: bool) -> bool:
    """One streaming chat; a leaver reads three events and hangs up. Returns whether [DONE] came."""
    body = {"model": server.model, "stream": True, "temperature": 0.7, "seed": i,
            "messages": [{"role": "system", "content": "You are a helpful assistant for load tests."},
                         {"role": "user", "content": f"Client {i}: tell me a fact about the number {i}."}],
            "max_tokens": 200 if leave_early else 12, "ignore_eos": leave_early}
    done, events = False, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            assert '"error"' not in line, line
            events += 1
            if leave_early and events == 3:
                break  # closes the connection mid-stream
    return done


def test_concurrent_streams_with_half_disconnecting(server, baseline):
    aborted_before = aborted_count(server)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=180,
                                     limits=httpx.Limits(max_connections=CLIENTS)) as client:
            return await asyncio.gather(*(stream_one(client, server, i, i % 2 == 1) for i in range(CLIENTS)))

    results = asyncio.run(run())
    assert results == [i % 2 == 0 for i in range(CLIENTS)]
    assert server.get("/health", headers={}).status_code == 200
    report = server.wait_idle(timeout=60)
    assert report["integrity"] == "ok"
    assert report["in_use_tokens"] == baseline["in_use_tokens"]  # nothing but the pins left in use
    assert aborted_count(server) - aborted_before == CLIENTS // 2  # the leavers were aborted, not run out


def test_non_streaming_client_that_leaves_is_aborted(server, baseline):
    aborted_before = aborted_count(server)
    body = {"model": server.model, "prompt": "Write a very long story.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", body, timeout=1.5)
    start = time.monotonic()
    report = server.wait_idle(timeout=20)  # 2000 tokens would take far longer than this
    assert time.monotonic() - start < 20
    assert report["integrity"] == "ok" and report["in_use_tokens"] == baseline["in_use_tokens"]
    assert aborted_count(server) - aborted_before == 1


def test_sigterm_with_a_stream_in_flight_shuts_down_gracefully(server):
    """The last test: new connections are refused at once; the in-flight stream is aborted after
    --shutdown-timeout and ends with an error event, not a cut connection; the process exits
    (the fixture's teardown checks that the engine thread was joined)."""
    body = {"model": server.model, "prompt": "Count forever:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer listening
            httpx.get(server.url + "/health")
        events = [line for line in lines if line.startswith("data: ")]  # until the server ends the stream
    assert '"error"' in events[-1] and "shutting down" in events[-1]
    server.proc.wait(timeout=30)
