"""Requests and their sequences (one per sample), and the outputs users see.

A request with `n` samples owns n `Sequence`s; each is scheduled on its own and holds one
root-to-leaf path of the prefix tree while running. Lengths are named by meaning:
`num_tokens` (prompt + generated, all in the tree while running), `num_prompt_tokens`.

With overlapped scheduling a token is sampled on the device one step before the host reads
it; until then it stands in `output_token_ids` (and in the tree) as `PENDING`:

    output_token_ids:  [ read ................. | PENDING x pending ]   (pending <= 2)
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from ..kvcache.prefix_tree import DEFAULT, PENDING, Node, Partition
from ..sampling_params import Logprob, SamplingParams
from .detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request: Request, index: int, tokenizer: Any) -> None:
        """tokenizer: a Hugging Face tokenizer, or None (no text: token ids only)."""
        self.seq_id, self.request, self.index = seq_id, request, index
        self.params: SamplingParams = request.params
        self.prompt_token_ids: list[int] = request.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.pending = 0  # trailing PENDING entries of output_token_ids
        self.logprobs: list[dict[int, Logprob]] | None = [] if self.params.logprobs is not None else None
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.leaf: Node | None = None  # the held path's leaf while running
        self.cached_prompt_tokens: int | None = None  # prompt tokens found in the tree at first admission
        # sample i of a seeded request draws with seed + i (vLLM's convention)
        self.sample_seed = None if self.params.seed is None else self.params.seed + index
        self.detok = IncrementalDetokenizer(tokenizer, self.prompt_token_ids,
                                            self.params.skip_special_tokens) if tokenizer else None
        self.text = ""

    @property
    def held_leaf(self) -> Node:
        """`leaf` where the sequence must hold a path (it is running)."""
        assert self.leaf is not None, f"sequence {self.seq_id} holds no path"
        return self.leaf

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_from(self, start: int, end: int | None = None) -> list[int]:
        """token_ids[start:end] without building token_ids (a decode step asks for one token
        of a sequence whose prompt may be thousands long)."""
        n = len(self.prompt_token_ids)
        end = self.num_tokens if end is None else end
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - n)]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def max_tokens(self) -> int:
        """`params.max_tokens`, which the engine resolves (never None) when it adds the request."""
        assert self.params.max_tokens is not None, "max_tokens is resolved when the request is added"
        return self.params.max_tokens

    @property
    def at_max_tokens(self) -> bool:
        """Its output (pending tokens included) is as long as allowed: it takes no more steps."""
        return self.params.max_tokens is not None and len(self.output_token_ids) >= self.params.max_tokens

    @property
    def num_read(self) -> int:
        """Output tokens read so far (the pending ones not counted)."""
        return len(self.output_token_ids) - self.pending

    @property
    def read_token_ids(self) -> list[int]:
        """The output tokens read so far (a copy)."""
        return self.output_token_ids[:self.num_read]

    def resolve_pending(self, token: int) -> int:
        """The oldest pending token is `token`; -> its position in the sequence."""
        i = self.num_read
        assert self.pending and self.output_token_ids[i] == PENDING, (self.pending, i)
        self.output_token_ids[i] = token
        self.pending -= 1
        return len(self.prompt_token_ids) + i

    def drop_pending(self) -> None:
        """Finished: tokens sampled after the last one read are not part of the output."""
        if self.pending:
            del self.output_token_ids[-self.pending:]
            self.pending = 0


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, prefill_only: bool = False, tenant: str = "",
                 partition: Partition = DEFAULT):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids = prompt_token_ids
        self.tenant = tenant  # who sent it (metrics); never widens sharing
        self.partition = partition  # the tree nodes it may share (prefix_tree.py)
        self.prefill_only = prefill_only  # pin requests: compute the prompt, sample nothing
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.seqs: list[Sequence] = []

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text, s.read_token_ids, s.finish_reason,
                                 s.logprobs) for s in self.seqs]
        cached = min((s.cached_prompt_tokens or 0 for s in self.seqs), default=0)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.finished, cached)
