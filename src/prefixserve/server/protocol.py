"""Request bodies of the OpenAI API, as pydantic models: the only pydantic in prefixserve.

Strict: a string is not a number, 1 is not `true`, NaN is not a number, so a wrong type is a
400, never a guess.
Unknown fields are ignored (as OpenAI-compatible servers do); known fields this server cannot
honour (`echo`, `suffix`, `tools`, `logit_bias`, ...) are refused rather than silently dropped.
Responses are plain dicts, built in completions.py / chat.py.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class SamplingFields(_Strict):
    """Fields both endpoints share; None means "the default"."""

    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 63 - 1024)  # seed + i (one per sample) fits int64
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's, as are the fields below
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # known fields for output this server cannot produce: refused, not ignored
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # splits the tenant's cache further

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name in ("logit_bias", "prompt_logprobs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     *self.UNSUPPORTED):
            value = getattr(self, name)
            if value not in (None, False, {}, []):
                raise ValueError(f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    UNSUPPORTED = ("echo", "suffix")

    @model_validator(mode="after")
    def _check_best_of(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of other than n is not supported by this server")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None  # the tools API before tools
    function_call: Any = None
    audio: Any = None  # audio output
    modalities: list[str] | None = None
    echo: bool | None = None  # vLLM's
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "audio", "echo", "continue_final_message",
                   "chat_template_kwargs")

    @model_validator(mode="after")
    def _check_chat(self):
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format other than {'type': 'text'} is not supported by this server")
        if self.modalities not in (None, ["text"]):
            raise ValueError(f"modalities other than ['text'] are not supported by this server, got {self.modalities}")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self


class PinRequest(_Strict):
    """POST /v1/prefixes: `prompt` (text or token ids) or `messages` (system/developer turns only)."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    ttl_seconds: float | None = Field(None, gt=0, le=365 * 86400)
    public: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if self.messages and any(m.role not in ("system", "developer") for m in self.messages):
            raise ValueError("messages may hold only system and developer turns (the prefix to pin)")
        return self
