"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine.engine import KVCacheStats, LLMEngine
from .engine.request import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]
Conversation = list[dict[str, str]]


class LLM:
    """An engine for offline batches. Keyword arguments are those of the configs in config.py
    (model, dtype, chunk_size, kv_cache_memory, max_num_seqs, attention_backend, ...), plus
    `pinned_prefixes`: prompts (text or token ids) prefilled once at start and never evicted."""

    def __init__(self, model: str | None = None, *, pinned_prefixes: Sequence[Prompt] = (), **kwargs):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()
        for prefix in pinned_prefixes:
            self.pin_prefix(prefix)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in the order of the prompts."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, p)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params=None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def pin_prefix(self, prefix: Prompt) -> list[int]:
        """Prefill `prefix` now and keep it cached until unpinned; returns its token ids."""
        return self.engine.pin_prefix(prefix)

    def unpin_prefix(self, prefix: Prompt) -> None:
        self.engine.unpin_prefix(prefix)

    def kv_cache_stats(self) -> KVCacheStats:
        return self.engine.kv_cache_stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
