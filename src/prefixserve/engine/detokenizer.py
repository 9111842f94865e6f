"""Token ids -> text, one token at a time, and stop strings over the growing text.

Incremental decoding uses vLLM's two offsets into the token ids, so a step decodes only a
short window, never the whole sequence:

    ids:  ... | prefix_offset ........ read_offset ........ end
                 \\_ already emitted _/  \\_ not yet emitted _/

    new text = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

Decoding from a few tokens before the unread ones keeps word-boundary effects (SentencePiece's
leading space) right. While the window's decoded text ends in U+FFFD the last token ended
inside a multi-byte UTF-8 character; nothing is emitted and the offsets wait, so no delta ever
contains half a character. The window starts on the prompt's last few tokens so the first
output token is decoded in context too.

Stop strings are matched on the accumulated text without holding anything back while
streaming (as vLLM): text before a stop string may already have been sent, but nothing past it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from prefixserve.sampling_params import Logprob

# How many prompt tokens of context the first output token is decoded with (vLLM's value).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> None:
        """tokenizer: a Hugging Face tokenizer (anything with `decode(ids, skip_special_tokens=)`)."""
        self.tokenizer = tokenizer
        self._decode_ids = _decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        # Only the window is kept: the prompt's tail, then output ids from prefix_offset on.
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._emitted_text: str | None = None  # decode(ids[prefix:read]), cached until the offsets move

    def append(self, token_id: int) -> str:
        """Adds one output token; returns the text it completes ("" while a character is unfinished)."""
        self._ids.append(token_id)
        if self._emitted_text is None:
            self._emitted_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._emitted_text) or window_text.endswith("\ufffd"):
            return ""
        delta = window_text[len(self._emitted_text) :]
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._emitted_text = None
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)


def _decoder(tokenizer: Any) -> Callable[..., str]:
    """`tokenizer.decode`, or the Rust tokenizer's own decode where that is all it does (a fast
    tokenizer without clean-up of spaces): the Python wrapper costs ~4x the decode itself, and
    a decode step calls this twice per sequence."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode: Callable[..., str] = tokenizer.decode
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        decode = backend.decode
    return decode


def with_decoded_tokens(tokenizer: Any, logprobs: dict[int, Logprob]) -> dict[int, Logprob]:
    """Fills `decoded_token` of a sampler logprobs entry, each token decoded on its own (as vLLM)."""
    return {
        t: dataclasses.replace(lp, decoded_token=tokenizer.decode([t])) for t, lp in logprobs.items()
    }


@dataclasses.dataclass(frozen=True)
class StopResult:
    text: str  # the accumulated text to keep
    delta: str  # the part of `text` not yet emitted: what to stream now
    stop_str: str | None  # the stop string that ended the request, None to continue


def check_stop_strings(text: str, delta: str, stop: Sequence[str], include_stop_str: bool) -> StopResult:
    """text: all text so far, ending with `delta`, the newest part (no stop string before it).

    The stop string that wins is the one that completes first reading left to right (earliest
    end; on a tie, earliest start), so the result does not depend on how the text was cut into
    deltas. A stop string may begin in an earlier delta. The kept text ends just before the stop
    string, or just after it when `include_stop_str`.
    """
    assert text.endswith(delta), (text, delta)
    old_len = len(text) - len(delta)
    matches = []  # (end, start, stop string): min() is the winner
    for s in stop:
        # Only a match ending inside the delta is new; the earliest such start also ends earliest.
        start = text.find(s, max(0, old_len - len(s) + 1))
        if start != -1:
            matches.append((start + len(s), start, s))
    if not matches:
        return StopResult(text, delta, None)
    end, _, s = min(matches)
    keep = text[:end] if include_stop_str else text[: end - len(s)]
    return StopResult(keep, keep[old_len:], s)
