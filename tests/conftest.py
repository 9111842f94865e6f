"""Shared fixtures: the real embedded model, its tokenizer, real prompts, and the transformers
reference outputs (computed once per session)."""

from __future__ import annotations

import pytest

from prefixserve import LLM


@pytest.fixture(scope="session")
def make_llm():
    """LLM instances on the embedded model, cached by their arguments (each load is seconds)."""
    cache = {}

    def make(**kwargs):
        kwargs.setdefault("kv_cache_memory", 256 << 20)
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
        if key not in cache:
            if len(cache) >= 6:
                cache.pop(next(iter(cache)))
            cache[key] = LLM(**kwargs)
        return cache[key]
    return make


@pytest.fixture(scope="session")
def tokenizer(make_llm):
    return make_llm().get_tokenizer()


@pytest.fixture(scope="session")
def sharegpt_questions():
    from prefixserve.bench.datasets import sharegpt_conversations
    return [q for q, _ in sharegpt_conversations(64, seed=0)]

