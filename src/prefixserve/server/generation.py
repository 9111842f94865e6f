"""One generation request's life, shared by both endpoints:

    parse_body (400) -> request_params: model (404), limits and SamplingParams (400) ->
    admission slot (429) -> tokenize, off the event loop -> engine.add_request (400 on its
    ValueError) -> stream (SSE) or collect -> release the slot

A client that disconnects aborts its request: while streaming, Starlette cancels the body
iterator (whose `finally` aborts); while collecting, a watcher on `receive()` does. The slot
and the engine request are released exactly once, whichever way the request ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from ..engine.async_engine import AsyncEngine, EngineDeadError, RequestAborted, RequestFailed, RequestStream
from ..engine.request import RequestOutput
from ..sampling_params import SamplingParams
from .config import ServerConfig, ServerLimits
from .errors import APIError, error_body, from_validation_error
from .protocol import SamplingFields

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    cfg: ServerConfig
    in_flight: int = 0
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))


async def parse_body(request: Request, model: type[M]) -> M:
    """Bytes -> UTF-8 -> the pydantic model; each failure is a 400. pydantic's JSON parser also
    refuses what Python's json module lets through: lone surrogates (which no tokenizer can
    encode), NaN, numbers too large for an int64."""
    body = await request.body()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        raise from_validation_error(e) from e


def request_params(state: ServerState, req: SamplingFields, max_tokens: tuple[int | None, str],
                   logprobs: tuple[int | None, str]) -> SamplingParams:
    """Every check that needs no engine (model 404, server limits 400, SamplingParams' own 400),
    then the SamplingParams. max_tokens / logprobs: (value, the request field it came from)."""
    if req.model != state.cfg.served_model_name:
        raise APIError(404, f"the model `{req.model}` does not exist; this server serves "
                       f"`{state.cfg.served_model_name}`", "model", "model_not_found")
    _check_limits(state.cfg.limits, req, max_tokens, logprobs)
    optional: dict[str, Any] = dict(n=req.n, temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop=req.stop,
                                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                    top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                                    min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs[0],
                                    stop_token_ids=req.stop_token_ids, include_stop_str_in_output=req.include_stop_str_in_output,
                                    skip_special_tokens=req.skip_special_tokens)
    try:  # a field left None takes SamplingParams' default; max_tokens None: see fit_max_tokens
        return SamplingParams(max_tokens=max_tokens[0], **{k: v for k, v in optional.items() if v is not None})
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), name if name in _PARAM_NAMES else None) from e


def _check_limits(limits: ServerLimits, req: SamplingFields, max_tokens: tuple[int | None, str],
                  logprobs: tuple[int | None, str]) -> None:
    for (value, param), limit in ((max_tokens, limits.max_tokens), (logprobs, limits.max_logprobs),
                                  ((req.n, "n"), limits.max_n)):
        if value is not None and limit is not None and value > limit:
            raise APIError(400, f"{param} must be <= {limit}, got {value}", param)
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > limits.max_stop:
        raise APIError(400, f"at most {limits.max_stop} stop strings are allowed, got {len(stops)}", "stop")
    if any(len(s) > limits.max_stop_length for s in stops):
        raise APIError(400, f"stop strings must be at most {limits.max_stop_length} characters", "stop")


def fit_max_tokens(state: ServerState, params: SamplingParams, prompt_len: int) -> SamplingParams:
    """max_tokens unset (chat's default): as many as the sequence can hold (the context, or less
    with a small KV cache), capped by the server's limit when it has one."""
    if params.max_tokens is not None:
        return params
    room = state.engine.max_sequence_tokens - prompt_len
    limit = state.cfg.limits.max_tokens
    room = room if limit is None else min(room, limit)
    return dataclasses.replace(params, max_tokens=room) if room >= 1 else params  # else the engine says why


class Generation:
    """An admitted request: its slot, its engine stream, and its cleanup (run once)."""

    def __init__(self, state: ServerState, prefix: str):
        limit = state.cfg.limits.max_concurrent_requests
        if state.in_flight >= limit:
            raise APIError(429, f"the server is at its limit of {limit} concurrent requests; retry later",
                           None, "too_many_requests")
        state.in_flight += 1
        self.state, self.request_id = state, f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stream: RequestStream | None = None
        self._closed = False

    async def start(self, prompt_ids: Callable[[], list[int]], params: SamplingParams, request: Request,
                    cache_salt: str | None) -> Generation:
        """Tokenize (off the event loop) and hand the request to the engine, in the partition of
        its key's tenant and its cache_salt (server/tenancy.py). Closes on failure."""
        try:
            ids = await asyncio.to_thread(prompt_ids)
            params = fit_max_tokens(self.state, params, len(ids))
            self.stream = await self.state.engine.add_request(self.request_id, ids, params, request.state.tenant,
                                                              cache_salt or "")
        except ValueError as e:
            self.close()
            raise APIError(400, str(e)) from e
        except EngineDeadError as e:
            self.close()
            raise APIError(503, str(e), None, "engine_unavailable") from e
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.state.in_flight -= 1
            if self.stream is not None:
                self.stream.abort()

    async def collect(self, request: Request) -> RequestOutput:
        """The final output; aborts and raises ClientGone if the client disconnects first."""
        assert self.stream is not None, "collect follows a successful start"
        result = asyncio.ensure_future(_last(self.stream))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                raise ClientGone(self.request_id)
            return _engine_result(result)
        finally:
            gone.cancel()
            result.cancel()
            self.close()

    def sse(self, events: Callable[[RequestStream], AsyncIterator[dict]]) -> StreamingResponse:
        """Stream `events(stream)` as server-sent events, then `[DONE]`; an engine failure or
        shutdown mid-stream becomes an error event."""
        async def body():
            try:
                async for event in events(self.stream):
                    yield _sse(event)
                yield "data: [DONE]\n\n"
            except (RequestAborted, EngineDeadError, RequestFailed) as e:
                yield _sse(error_body(*_stopped(e)))
            finally:
                self.close()
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(self.close))


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready."""


def _engine_result(task: asyncio.Future[RequestOutput]) -> RequestOutput:
    try:
        return task.result()
    except (RequestAborted, EngineDeadError, RequestFailed) as e:
        raise APIError(*_stopped(e)) from e


def _stopped(e: Exception) -> tuple[int, str, None, str]:
    """(status, message, param, code) of a request the engine ended without finishing it."""
    if isinstance(e, RequestFailed):
        return 500, f"{e}; the server is still serving: retry", None, "internal_error"
    return 503, f"the request was stopped: {e}", None, "engine_unavailable"


async def _last(stream: RequestStream) -> RequestOutput:
    """The stream's finished output (a stream that does not end with one raises)."""
    out = None
    async for item in stream:
        out = item
    assert out is not None, "a stream yields its finished output before it ends"
    return out


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


@dataclasses.dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None


class DeltaTracker:
    """Turns cumulative outputs into per-choice deltas for streaming.

    With stop strings, the last (longest stop - 1) characters of an unfinished choice are held
    back: a stop string may start in text already decoded and then cut it (see
    engine/detokenizer.py), so sending them early could send text the final answer does not
    have. Held back this way, the streamed text always equals the non-streamed text."""

    def __init__(self, n: int, params: SamplingParams):
        self.hold = max((len(s) for s in params.stop or ()), default=1) - 1
        self.text_sent, self.tokens_sent = [0] * n, [0] * n
        self.done = [False] * n

    def deltas(self, out: RequestOutput) -> list[Delta]:
        result = []
        for c in out.outputs:
            i = c.index
            if self.done[i]:
                continue
            end = len(c.text) if c.finish_reason else max(self.text_sent[i], len(c.text) - self.hold)
            text, tokens = c.text[self.text_sent[i]:end], c.token_ids[self.tokens_sent[i]:]
            logprobs = c.logprobs[self.tokens_sent[i]:] if c.logprobs is not None else None
            if text or tokens or c.finish_reason:
                result.append(Delta(i, text, tokens, logprobs, c.finish_reason))
            self.text_sent[i], self.tokens_sent[i] = end, len(c.token_ids)
            self.done[i] = c.finish_reason is not None
        return result


def logprob_value(lp) -> float:
    """JSON has no -inf; clamp as vLLM does."""
    return max(lp.logprob, -9999.0)
