"""Soak: a real server with a small KV cache (preemption) under bounded concurrent load of good
requests mixed with clients that disconnect mid-stream, clients that give up (aborts), oversized
bodies, malformed requests and prompts the cache can never hold. No request may get a 5xx or a status its kind does not allow; after
the drain nothing has leaked (KV chunks, requests, streams, threads, file descriptors, child
processes) and the integrity check holds.

CI runs it for SOAK_SECONDS=15 (the default); `make soak` runs it for minutes and prints the
figures (requests, outcomes by kind, p50/p99 latency of the good ones)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time

import httpx
import pytest

from server_process import launch

SECONDS = float(os.environ.get("SOAK_SECONDS", "15"))
CONCURRENCY = int(os.environ.get("SOAK_CONCURRENCY", "8"))
# 24 MiB holds ~34 chunks of 16 tokens on the embedded model: 8 clients with up to 32 new tokens
# each outgrow it, so decode steps preempt.
KV_CACHE = 24 << 20
# The statuses each kind may get (and, for `ok`/`disconnect`, must stream to the end or be cut by us).
ALLOWED = {"ok": {200}, "disconnect": {200}, "abort": {200, "gave up"}, "oversized": {413},
           "malformed": {400, 422}, "too_long": {400}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from launch(tmp_path_factory, "--kv-cache-memory", str(KV_CACHE), "--max-body-bytes", str(64 << 10))


def process_counts(pid: int) -> tuple[int, int, int]:
    """(threads, open fds, child processes) of the server process."""
    tasks = os.listdir(f"/proc/{pid}/task")
    children = sum(len(open(f"/proc/{pid}/task/{t}/children").read().split()) for t in tasks)
    return len(tasks), len(os.listdir(f"/proc/{pid}/fd")), children


def chat(server, rng: random.Random, i: int, stream: bool) -> dict:
    return {"model": server.model, "stream": stream, "seed": i, "temperature": rng.choice([0, 0.8]),
            "max_tokens": rng.randint(1, 32), "ignore_eos": rng.random() < 0.5,
            "messages": [{"role": "user", "content": f"Soak client {i}: say something about {rng.randint(0, 999)}."}]}


async def one(client: httpx.AsyncClient, server, rng: random.Random, i: int) -> tuple[str, object, float]:
    """-> (kind, status or 'gave up', seconds)."""
    kind = rng.choices(list(ALLOWED), weights=[10, 3, 2, 1, 2, 1])[0]
    t = time.monotonic()
    if kind in ("ok", "disconnect"):
        status = await stream_chat(client, chat(server, rng, i, True), cut_after=2 if kind == "disconnect" else None)
    elif kind == "abort":
        try:
            status = (await client.post("/v1/chat/completions", json=chat(server, rng, i, False),
                                        timeout=rng.uniform(0.05, 0.5))).status_code
        except httpx.TimeoutException:
            status = "gave up"
    elif kind == "oversized":
        status = (await client.post("/v1/completions", json={"model": server.model, "prompt": "x " * (48 << 10)})).status_code
    elif kind == "malformed":
        body = rng.choice([b'{"model": "m", "messages": [', b'[]', json.dumps({"model": server.model, "messages": "hi"}).encode(),
                           json.dumps({"model": server.model, "prompt": "hi", "max_tokens": -1}).encode()])
        status = (await client.post("/v1/chat/completions" if b"messages" in body else "/v1/completions", content=body,
                                    headers={"Content-Type": "application/json"})).status_code
    else:  # a prompt the small KV cache can never hold
        status = (await client.post("/v1/completions", json={"model": server.model, "prompt": "word " * 4000,
                                                             "max_tokens": 4})).status_code
    return kind, status, time.monotonic() - t


async def stream_chat(client: httpx.AsyncClient, body: dict, cut_after: int | None) -> int:
    """Streams to [DONE] (any error event fails the soak), or hangs up after `cut_after` events."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code
        events = 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return 200
            if line.startswith("data: "):
                assert '"error"' not in line, line
                events += 1
                if events == cut_after:
                    return 200
    raise AssertionError("the stream ended without [DONE]")


async def load(server) -> list[tuple[str, object, float]]:
    """CONCURRENCY clients, each sending requests back to back until SECONDS have passed."""
    deadline, results = time.monotonic() + SECONDS, []

    async def client_loop(c: int):
        rng = random.Random(c)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as client:
            i = c
            while time.monotonic() < deadline:
                results.append(await one(client, server, rng, i))
                i += CONCURRENCY
    await asyncio.gather(*(client_loop(c) for c in range(CONCURRENCY)))
    return results


def wait_for(predicate, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} after {timeout} s"
        time.sleep(0.2)
    return value


def test_soak(server):
    before = server.wait_idle()
    asyncio.run(load_warmup(server))  # thread pools and caches reach their steady size first
    server.wait_idle()
    threads, fds, _ = process_counts(server.proc.pid)
    results = asyncio.run(load(server))
    bad = [(k, s) for k, s, _ in results if s not in ALLOWED[k]]
    assert not bad, f"{len(bad)} requests got a status their kind does not allow: {collections.Counter(bad)}"
    after = server.wait_idle(timeout=120)
    assert after["integrity"] == "ok" and after["in_use_tokens"] == before["in_use_tokens"], (before, after)
    wait_for(lambda: process_counts(server.proc.pid)[:2] <= (threads, fds), "threads or fds leaked "
             f"(were {threads}, {fds}, now {process_counts(server.proc.pid)[:2]})")
    assert process_counts(server.proc.pid)[2] == 0, "the server has child processes"
    assert server.get("/health", headers={}).status_code == 200
    good = sorted(s for k, _, s in results if k == "ok")
    figures = {"seconds": SECONDS, "requests": len(results), "outcomes": collections.Counter(f"{k}:{s}" for k, s, _ in results),
               "kv_peak_use": round(after["peak_physical_tokens"] / after["capacity_tokens"], 3),
               "ok_p50_s": round(good[len(good) // 2], 3), "ok_p99_s": round(good[int(len(good) * 0.99)], 3),
               "leaks": {"chunks": 0, "requests": 0, "threads": 0, "fds": 0, "processes": 0}}
    print("soak:", json.dumps(figures, default=dict))  # noqa: T201 (make soak reports these figures)
    assert good, "no good request completed"


async def load_warmup(server):
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as client:
        rng = random.Random(-1)
        await asyncio.gather(*(stream_chat(client, chat(server, rng, i, True), None) for i in range(CONCURRENCY)))

