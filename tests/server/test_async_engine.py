"""AsyncEngine in-process, over the real engine: the handoff between asyncio and the engine thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixserve.config import EngineConfig
from prefixserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestAborted
from prefixserve.engine.engine import LLMEngine
from prefixserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_engine():
    return LLMEngine(EngineConfig.from_kwargs(kv_cache_memory=64 << 20, max_num_seqs=16))


def run(llm_engine, body):
    """Run `body(async_engine)` in a fresh event loop around a started AsyncEngine; shut it down after."""
    async def main():
        engine = AsyncEngine(llm_engine)
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()
    return asyncio.run(main())


async def collect(engine: AsyncEngine, request_id: str, prompt, params=GREEDY):
    return [out async for out in await engine.add_request(request_id, prompt, params)]


def test_outputs_stream_in_and_the_cache_ends_clean(llm_engine):
    async def body(engine):
        outs = await collect(engine, "a", "The capital of France is")
        report = await engine.inspect()
        return outs, report
    outs, report = run(llm_engine, body)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(outs[-1].outputs[0].token_ids) == 6
    assert report["integrity"] == "ok" and report["running"] == report["waiting"] == report["streams"] == 0


def test_concurrent_requests_match_their_solo_runs(llm_engine):
    prompts = [f"Tell me about the number {i}." for i in range(6)]

    async def body(engine):
        solo = [(await collect(engine, f"solo{i}", p))[-1].outputs[0].text for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(engine, f"batch{i}", p) for i, p in enumerate(prompts)))
        return solo, [outs[-1].outputs[0].text for outs in together]
    solo, together = run(llm_engine, body)
    assert together == solo


def test_add_request_errors_reach_the_caller_and_the_engine_goes_on(llm_engine):
    async def body(engine):
        with pytest.raises(ValueError, match="context"):
            await engine.add_request("big", [1] * (llm_engine.max_model_len + 5), GREEDY)
        await collect(engine, "dup", "hello")
        stream = await engine.add_request("dup2", "hello", LONG)
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("dup2", "hello", GREEDY)
        stream.abort()
        return (await collect(engine, "after", "hello"))[-1]
    assert run(llm_engine, body).finished


def test_abort_releases_the_request(llm_engine):
    async def body(engine):
        stream = await engine.add_request("long", "Count:", LONG)
        first = await stream.__anext__()
        stream.abort()
        rest = [out async for out in stream]
        return first, rest, await engine.inspect()
    first, rest, report = run(llm_engine, body)
    assert not first.finished and rest == []
    assert report["running"] == report["waiting"] == report["streams"] == 0


def test_health_reports_a_stalled_step(llm_engine, monkeypatch):
    step = llm_engine.step

    def slow_step():
        time.sleep(0.5)
        return step()
    monkeypatch.setattr(llm_engine, "step", slow_step)

    async def body(engine):
        assert engine.health(stall_timeout=0.2) is None  # idle is healthy
        stream = await engine.add_request("slow", "Hi", SamplingParams(max_tokens=3))
        await asyncio.sleep(0.35)
        stalled = engine.health(stall_timeout=0.2)
        outs = [out async for out in stream]
        deadline = time.monotonic() + 10
        while engine.health(stall_timeout=0.2) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the thread goes idle just after sending the last output
        return stalled, outs[-1].finished, engine.health(stall_timeout=0.2)
    stalled, finished, after = run(llm_engine, body)
    assert "no progress" in stalled and finished and after is None


def test_shutdown_aborts_requests_in_flight(llm_engine):
    async def body(engine):
        stream = await engine.add_request("inflight", "Count:", LONG)
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(RequestAborted):
            async for _ in stream:
                pass
        assert engine.health(stall_timeout=1.0) is not None
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "Hi", GREEDY)
    run(llm_engine, body)
    assert not llm_engine.has_unfinished()


def test_a_failing_step_fails_every_stream_and_health(llm_engine, monkeypatch):
    """Last: leaves the engine with a request it will never finish."""
    def broken_step():
        raise RuntimeError("kernel exploded")

    async def body(engine):
        monkeypatch.setattr(llm_engine, "step", broken_step)
        stream = await engine.add_request("doomed", "Hi", GREEDY)
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            async for _ in stream:
                pass
        assert "kernel exploded" in engine.health(stall_timeout=1.0)
        with pytest.raises(EngineDeadError):
            await engine.add_request("next", "Hi", GREEDY)
    run(llm_engine, body)
