"""Helpers shared by the engine-level tests: transformers' reference outputs, and a generate
loop that checks the cache contract after every step."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _hf_model():
    from transformers import AutoModelForCausalLM

    from prefixserve.model.loader import embedded_gguf_path
    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compared with ignore_eos=True
    return model.eval()


def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt, no stopping at eos."""
    with torch.no_grad():
        out = _hf_model().generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def run_checked(llm, prompts, params, partitions=None) -> list:
    """Generate through the engine step by step, checking the cache contract after every step;
    at the end nothing may be in use. partitions: one (tenant, cache_salt) per prompt."""
    engine = llm.engine
    ids = [f"checked-{id(prompts)}-{i}" for i in range(len(prompts))]
    for rid, prompt, (tenant, salt) in zip(ids, prompts, partitions or [("", "")] * len(prompts), strict=True):
        engine.add_request(rid, prompt, params, tenant=tenant, cache_salt=salt)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    assert engine.kv_cache_stats().in_use_tokens == _pinned_slots(engine), "chunks leaked"
    return [done[rid] for rid in ids]


def _pinned_slots(engine) -> int:
    return sum(len(n.owned_chunks) for n in engine.tree.iter_nodes() if n.pins) * engine.pool.chunk_size
