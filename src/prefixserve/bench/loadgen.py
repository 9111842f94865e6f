"""The client side of `bench serve`: Poisson arrivals of streaming /v1/completions requests.

Each request is token ids (so any model, tokenizer or not), greedy, `ignore_eos`, streamed
with `stream_options.include_usage`; its timeline is recorded on the client's monotonic clock:

    send ---- first chunk ---- chunk ---- chunk ... ---- last chunk (usage)
         TTFT           ITL        ITL                   end-to-end latency
    normalized latency = end-to-end latency / output tokens   (RelayAttention Fig. 8, vLLM's benchmark)

A run is bounded: every request is sent once and the run ends when all have answered, failed
or timed out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import random
import statistics
import time
from typing import Any

import httpx


@dataclasses.dataclass
class RequestRecord:
    prompt_tokens: int
    sent: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    done: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    replica: str | None = None  # the `x-prefixserve-replica` header, behind `serve --replicas`

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None and self.output_tokens > 0

    @property
    def latency(self) -> float:
        """End-to-end seconds, send to [DONE] (of a finished request)."""
        assert self.done is not None, "a request that did not finish has no latency"
        return self.done - self.sent


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord,
                            headers: dict) -> RequestRecord:
    rec.sent = time.monotonic()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            rec.replica = r.headers.get("x-prefixserve-replica")
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                _on_line(line, rec)
    except (httpx.HTTPError, TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    if rec.error is None and rec.done is None:
        rec.error = "the stream ended without [DONE]"
    return rec


def _on_line(line: str, rec: RequestRecord) -> None:
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    now = time.monotonic()
    if data == "[DONE]":
        rec.done = now
        return
    event = json.loads(data)
    if "error" in event:
        rec.error = str(event["error"])[:200]
    if event.get("choices"):
        rec.chunk_times.append(now)
    if usage := event.get("usage"):
        rec.output_tokens = usage["completion_tokens"]
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def poisson_run(base_url: str, model: str, prompts: list[list[int]], max_tokens: list[int],
                      rate: float, seed: int, headers: dict, timeout_s: float, progress: bool = True,
                      desc: str = "") -> tuple[list[RequestRecord], float]:
    """Send every prompt once, inter-arrival times exponential with mean 1/rate (rate=inf: all
    at once); -> (records in prompt order, wall time from the first send to the last answer)."""
    from tqdm.auto import tqdm
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30), limits=limits) as client:
        tasks = []
        start = time.monotonic()
        for prompt, n in zip(prompts, max_tokens, strict=True):
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            task = asyncio.create_task(stream_completion(client, url, body, RequestRecord(len(prompt)), headers))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
            if not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
    bar.close()
    end = max((r.done or r.sent for r in records), default=start)
    return list(records), end - start


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """Throughput and latency statistics of one run (failed requests counted, not timed)."""
    ok = [r for r in records if r.ok]
    norm = [r.latency / r.output_tokens for r in ok]
    e2e = [r.latency for r in ok]
    ttft = [r.chunk_times[0] - r.sent for r in ok if r.chunk_times]
    itl = [b - a for r in ok for a, b in itertools.pairwise(r.chunk_times)]
    out_tokens = sum(r.output_tokens for r in ok)
    stats: dict[str, Any] = {
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3] or None,
        "duration_s": round(duration, 3), "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens or 0 for r in ok),
        "requests_per_s": round(len(ok) / duration, 4) if duration > 0 else None,
        "output_tokens_per_s": round(out_tokens / duration, 3) if duration > 0 else None,
        "normalized_latency_mean_s": _round(statistics.fmean(norm)) if norm else None,
        "latency_mean_s": _round(statistics.fmean(e2e)) if e2e else None,
    }
    for name, values in (("normalized_latency", norm), ("ttft", ttft), ("itl", itl)):
        if name != "normalized_latency":
            stats[f"{name}_mean_s"] = _round(statistics.fmean(values)) if values else None
        for q in (50, 90, 99):
            stats[f"{name}_p{q}_s"] = _round(_pct(values, q / 100))
    return stats


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 5)
