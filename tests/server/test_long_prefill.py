"""A long prompt does not stall the server (FOUND 4: an 8,109-token prompt held a request beside it
for 194 s and turned /health 503). With a small step budget the long prompt is prefilled over many
steps: a short streaming request sent after it finishes before the long one's first token, and
/health answers 200 throughout."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server_process import launch

BUDGET = 32
LONG_WORDS = 300  # about 300 tokens: ten steps of the budget at least


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from launch(tmp_path_factory, "--max-num-batched-tokens", str(BUDGET), "--health-stall-timeout", "15")


async def first_and_last(client: httpx.AsyncClient, path: str, body: dict) -> tuple[float, float]:
    """Streams one completion to [DONE]: -> (time of the first event, which carries the first
    token, and time of [DONE])."""
    first = None
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return first, time.monotonic()
            if line.startswith("data: ") and first is None:
                first = time.monotonic()
    raise AssertionError("the stream ended without [DONE]")


async def long_beside_short(server) -> tuple[tuple[float, float], tuple[float, float], list[int]]:
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=600) as client:
        long = asyncio.create_task(first_and_last(client, "/v1/completions", {
            "model": server.model, "prompt": "word " * LONG_WORDS, "max_tokens": 2, "temperature": 0}))
        while (await client.get("/health?detail=1")).json()["running"] == 0:  # the long prompt is prefilling
            await asyncio.sleep(0.05)
        short = asyncio.create_task(first_and_last(client, "/v1/completions", {
            "model": server.model, "prompt": "Say hi.", "max_tokens": 4, "ignore_eos": True, "temperature": 0}))
        health = []
        while not long.done():
            health.append((await client.get("/health", headers={})).status_code)
            await asyncio.sleep(0.3)
        return await long, await short, health


def test_a_short_request_finishes_while_a_long_prompt_prefills(server):
    (long_first, _), (_, short_done), health = asyncio.run(long_beside_short(server))
    assert short_done < long_first, f"the short request ended {short_done - long_first:.1f} s after the long one's first token"
    assert health and set(health) == {200}, health
    report = server.wait_idle()
    assert report["integrity"] == "ok", report
