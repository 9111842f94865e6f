"""POST /v1/completions: a prompt (text or token ids) in, `n` continuations out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from ..engine.async_engine import RequestStream
from ..engine.request import RequestOutput
from .errors import APIError
from .generation import Delta, DeltaTracker, Generation, ServerState, logprob_value, parse_body, request_params, usage
from .protocol import CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's, for completions


async def create_completion(state: ServerState, request: Request):
    req = await parse_body(request, CompletionRequest)
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = request_params(state, req, (max_tokens, "max_tokens"), (req.logprobs, "logprobs"))
    prompt = _single_prompt(req.prompt)
    tokenizer = state.engine.tokenizer

    def prompt_ids() -> list[int]:
        return prompt if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)

    gen = await Generation(state, "cmpl").start(prompt_ids, params, request, req.cache_salt)
    render = _Render(gen.request_id, gen.created, state.cfg.served_model_name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return gen.sse(lambda stream: render.chunks(stream, DeltaTracker(params.n, params), include_usage))
    return JSONResponse(render.response(await gen.collect(request)))


def _single_prompt(prompt: str | list) -> str | list[int]:
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return prompt
    if len(prompt) > 1:
        raise APIError(400, "batched prompts are not supported: send one prompt per request", "prompt")
    return prompt[0]


class _Render:
    def __init__(self, request_id: str, created: int, model: str):
        self.head = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def response(self, out: RequestOutput) -> dict:
        choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": None if c.logprobs is None else _logprobs(c.token_ids, c.logprobs, 0)[0]}
                   for c in out.outputs]
        return {**self.head, "choices": choices, "usage": usage(out)}

    async def chunks(self, stream: RequestStream, tracker: DeltaTracker, include_usage: bool) -> AsyncIterator[dict]:
        offsets: dict[int, int] = {}
        out = None
        async for out in stream:
            for d in tracker.deltas(out):
                yield {**self.head, "choices": [self._choice(d, offsets)], **({"usage": None} if include_usage else {})}
        if include_usage and out is not None:
            yield {**self.head, "choices": [], "usage": usage(out)}

    @staticmethod
    def _choice(d: Delta, offsets: dict[int, int]) -> dict:
        logprobs = None
        if d.logprobs is not None:
            logprobs, offsets[d.index] = _logprobs(d.token_ids, d.logprobs, offsets.get(d.index, 0))
        return {"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}


def _logprobs(token_ids: list[int], logprobs: list[dict], offset: int) -> tuple[dict, int]:
    """OpenAI's legacy shape; `text_offset` counts characters of the decoded tokens from the
    start of the completion. Returns it and the offset after its last token."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    # not strict: logprobs may be the sequence's live list (Request.output does not copy it),
    # a step ahead of token_ids when the engine thread has appended since
    for token, entry in zip(token_ids, logprobs, strict=False):
        text = entry[token].decoded_token or ""
        result["tokens"].append(text)
        result["token_logprobs"].append(logprob_value(entry[token]))
        result["top_logprobs"].append({lp.decoded_token or "": logprob_value(lp)
                                       for lp in sorted(entry.values(), key=lambda lp: lp.rank)})
        result["text_offset"].append(offset)
        offset += len(text)
    return result, offset
