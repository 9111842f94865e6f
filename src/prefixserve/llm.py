"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

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
    `pinned_prefixes`: prompts (text or token ids) prefilled once at start and never evicted
    (public: every cache salt reads them)."""

    def __init__(self, model: str | None = None, *, pinned_prefixes: Sequence[Prompt] = (), **kwargs: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()
        for prefix in pinned_prefixes:
            self.pin_prefix(prefix)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also at interpreter exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, cache_salt: str | Sequence[str] = "") -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in the order of the prompts.
        `cache_salt` (one for all, or one per prompt): prompts share cached prefixes only with
        prompts of the same salt, and with public pins."""
        prompts = _as_batch(prompts)
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        salts = [cache_salt] * len(prompts) if isinstance(cache_salt, str) else list(cache_salt)
        for name, given in (("sampling params", params), ("cache salts", salts)):
            if len(given) != len(prompts):
                raise ValueError(f"got {len(given)} {name} for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p, salt in zip(prompts, params, salts, strict=True):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, p, cache_salt=salt)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def pin_prefix(self, prefix: Prompt, *, ttl: float | None = None, public: bool = True,
                   cache_salt: str = "") -> str:
        """Prefill `prefix` now and keep it cached until unpinned or `ttl` seconds have passed;
        returns the pin's id. Public pins are read under every cache salt; a private one only
        under `cache_salt`. Raises ValueError if it cannot fit beside what may run."""
        return self.engine.pin_prefix(prefix, ttl=ttl, public=public, cache_salt=cache_salt).id

    def unpin_prefix(self, pin_id: str) -> None:
        self.engine.unpin(pin_id)

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


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or token ids), or a sequence of prompts -> the list of prompts."""
    # The casts state what the item check proves (mypy narrows on isinstance of the whole only).
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]  # text, or token ids: one prompt
    return list(cast(Sequence[Prompt], prompts))
