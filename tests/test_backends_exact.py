"""Greedy outputs are token-identical across every attention backend and transformers, on
shared-system-prompt and hierarchical workloads, with n > 1, with a pinned system prompt, and
with tenants (prompts spread over tenants and cache salts, reading public pinned prefixes)."""

from __future__ import annotations

import pytest

from prefixserve import LLM, SamplingParams

from engine_checks import hf_greedy, run_checked

BACKENDS = ("paged", "relay", "hydragen", "chunk", "auto")
NEW = 24


@pytest.fixture(scope="module")
def workloads(tokenizer, sharegpt_questions):
    system = tokenizer.encode(" ".join(sharegpt_questions[20:26]))[:300]
    shared_system = [system + tokenizer.encode(q)[:60] for q in sharegpt_questions[:6]]
    fewshot = tokenizer.encode(" ".join(sharegpt_questions[26:30]))[:200]
    problems = [tokenizer.encode(q)[:50] for q in sharegpt_questions[6:9]]
    hierarchical = [fewshot + p for p in problems]
    return {"shared-system": (system, shared_system), "hierarchical": (fewshot, hierarchical)}


@pytest.fixture(scope="module")
def references(workloads):
    return {name: [hf_greedy(p, NEW) for p in prompts] for name, (_, prompts) in workloads.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["unpinned", "pinned", "tenants"])
def test_greedy_identical_across_backends(workloads, references, backend, mode):
    prefixes = [prefix for prefix, _ in workloads.values()]
    llm = LLM(attention_backend=backend, kv_cache_memory=128 << 20, chunk_size=16,
              pinned_prefixes=prefixes if mode != "unpinned" else ())
    params = SamplingParams(temperature=0, n=2, max_tokens=NEW, ignore_eos=True)
    spread = [("a", ""), ("b", ""), ("a", "salt")]
    for name, (prefix, prompts) in workloads.items():
        partitions = [spread[i % 3] for i in range(len(prompts))] if mode == "tenants" else None
        outs = run_checked(llm, prompts, params, partitions)
        for out, ref in zip(outs, references[name], strict=True):
            assert [c.token_ids for c in out.outputs] == [ref, ref], (name, backend)
            if mode != "unpinned":  # the public pin is read whatever the partition
                assert out.num_cached_tokens >= len(prefix), (name, backend)
    assert llm.engine.runner.advanced_steps > 0  # decode steps advanced the last plan
