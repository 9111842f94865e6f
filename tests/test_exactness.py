"""Greedy outputs are token-identical to transformers on the embedded model: batched, alone,
across chunk sizes, and under preemption."""

from __future__ import annotations

import pytest

from prefixserve import SamplingParams

from engine_checks import hf_greedy, run_checked

LENGTHS = (2, 9, 37, 120, 300, 640, 1024, 1500)
NEW_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer, sharegpt_questions):
    text = "\n\n".join(sharegpt_questions)
    ids = tokenizer.encode(text)
    assert len(ids) > 3 * max(LENGTHS)
    # different starting points, so the prompts share no prefix here
    return [ids[i * 300:i * 300 + n] for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def references(prompts):
    return [hf_greedy(p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_batch_matches_transformers(make_llm, prompts, references, chunk_size):
    outs = run_checked(make_llm(chunk_size=chunk_size), prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == references


def test_each_alone_matches_transformers(make_llm, prompts, references):
    llm = make_llm(enable_prefix_caching=False)
    for p, ref in zip(prompts, references, strict=True):
        assert run_checked(llm, [p], GREEDY)[0].outputs[0].token_ids == ref


def test_preemption_matches_transformers(make_llm, prompts, references):
    per_token = 2 * 30 * 3 * 64 * 4  # K+V bytes of one token, all layers, fp32
    largest = max(map(len, prompts)) + NEW_TOKENS
    llm = make_llm(kv_cache_memory=(largest + 64) * per_token, chunk_size=16)  # 100 chunks
    # Admission order 1024, 300, 120, 37, 9, 2 fills 96 of the 100 chunks with prompts; their
    # 40 new tokens each need 15 more, so decoding must preempt. 640 and 1500 run later.
    order = [6, 4, 3, 2, 1, 0, 5, 7]
    before = llm.engine.scheduler.num_preemptions
    outs = run_checked(llm, [prompts[i] for i in order], GREEDY)
    assert llm.engine.scheduler.num_preemptions > before, "the budget was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == [references[i] for i in order]
