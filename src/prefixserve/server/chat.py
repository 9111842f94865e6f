"""POST /v1/chat/completions, and the chat-template arithmetic behind pinned system prompts."""

from __future__ import annotations

from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse

from ..engine.async_engine import RequestStream
from ..engine.request import RequestOutput
from .errors import APIError
from .generation import DeltaTracker, Generation, ServerState, logprob_value, parse_body, request_params, usage
from .protocol import ChatCompletionRequest, ChatMessage


async def create_chat_completion(state: ServerState, request: Request):
    req = await parse_body(request, ChatCompletionRequest)
    max_tokens = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                  else (req.max_tokens, "max_tokens"))
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None, "top_logprobs")
    params = request_params(state, req, max_tokens, logprobs)
    tokenizer = state.engine.tokenizer
    messages = [_as_dict(m) for m in req.messages]

    def prompt_ids() -> list[int]:  # runs off the event loop: templates and tokenizers take time
        return tokenizer.encode(render_prompt(tokenizer, messages), add_special_tokens=False)

    gen = await Generation(state, "chatcmpl").start(prompt_ids, params, request, req.cache_salt)
    render = _Render(gen.request_id, gen.created, state.cfg.served_model_name, req.top_logprobs or 0)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return gen.sse(lambda stream: render.chunks(stream, DeltaTracker(params.n, params), include_usage))
    return JSONResponse(render.response(await gen.collect(request)))


def _as_dict(m: ChatMessage) -> dict[str, str]:
    return {"role": "system" if m.role == "developer" else m.role, "content": m.text()}


def render_prompt(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from e


def system_prefix_ids(tokenizer, system_prompt: str | list[dict[str, str]]) -> list[int]:
    """The token ids every chat prompt with this system message (or these system turns) starts
    with, through the end of the system turns: what `--pin-system-prompt` pins. The system turn rendered on its own is used
    when its tokens really begin the rendered conversations; otherwise (a template that changes
    the system turn when a user turn follows) the tokens two different conversations share."""
    def ids(*user: str) -> list[int]:
        system = [{"role": "system", "content": system_prompt}] if isinstance(system_prompt, str) else system_prompt
        messages = system + [{"role": "user", "content": u} for u in user]
        return tokenizer.encode(render_prompt(tokenizer, messages, add_generation_prompt=bool(user)),
                                add_special_tokens=False)
    a, b = ids("a"), ids("b")
    shared = a[:next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))]
    alone = ids()
    return alone if alone and shared[:len(alone)] == alone else shared


class _Render:
    def __init__(self, request_id: str, created: int, model: str, top_logprobs: int):
        self.top = top_logprobs
        self.head = {"id": request_id, "created": created, "model": model}

    def response(self, out: RequestOutput) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs), "finish_reason": c.finish_reason}
                   for c in out.outputs]
        return {**self.head, "object": "chat.completion", "choices": choices, "usage": usage(out)}

    async def chunks(self, stream: RequestStream, tracker: DeltaTracker, include_usage: bool) -> AsyncIterator[dict]:
        extra = {"usage": None} if include_usage else {}
        for i in range(len(tracker.done)):
            yield self._chunk(i, {"role": "assistant", "content": ""}, None, None, extra)
        out = None
        async for out in stream:
            for d in tracker.deltas(out):
                delta = {"content": d.text} if d.text or not d.finish_reason else {}
                yield self._chunk(d.index, delta, self._logprobs(d.token_ids, d.logprobs), d.finish_reason, extra)
        if include_usage and out is not None:
            yield {**self.head, "object": "chat.completion.chunk", "choices": [], "usage": usage(out)}

    def _chunk(self, index: int, delta: dict, logprobs, finish_reason: str | None, extra: dict) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.head, "object": "chat.completion.chunk", "choices": [choice], **extra}

    def _logprobs(self, token_ids: list[int], logprobs: list[dict] | None) -> dict | None:
        if logprobs is None:
            return None
        content = []
        # not strict: logprobs may be the sequence's live list (Request.output does not copy it),
        # a step ahead of token_ids when the engine thread has appended since
        for token, entry in zip(token_ids, logprobs, strict=False):
            top = sorted(entry.values(), key=lambda lp: lp.rank)[:self.top]
            content.append({**_entry(entry[token]), "top_logprobs": [_entry(lp) for lp in top]})
        return {"content": content, "refusal": None}


def _entry(lp) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": logprob_value(lp), "bytes": list(text.encode("utf-8"))}
