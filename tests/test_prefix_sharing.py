"""Shared prefixes are found automatically, stored once and computed once; outputs do not change."""

from __future__ import annotations

import time

import pytest

from prefixserve import LLM, SamplingParams

from engine_checks import hf_greedy, run_checked

NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def distinct_prefix_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens that must be computed with each shared prefix computed once: the tokens of a
    prefix tree over the prompts, plus one for each repeated prompt (every sequence computes its
    own last prompt token, whose logits it samples from)."""
    tree = {tuple(p[:i + 1]) for p in prompts for i in range(len(p))}
    return len(tree) + len(prompts) - len({tuple(p) for p in prompts})


@pytest.fixture(scope="module")
def system_chats(tokenizer, sharegpt_questions):
    """32 chats: one ~1,000-token system prompt, each its own ShareGPT question."""
    system = " ".join(sharegpt_questions[32:])
    sys_ids = tokenizer.encode(system)[:1000]
    system = tokenizer.decode(sys_ids)
    def ids(messages, **kw):
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, **kw),
                                add_special_tokens=False)
    chats = [ids([{"role": "system", "content": system}, {"role": "user", "content": q[:300]}],
                 add_generation_prompt=True) for q in sharegpt_questions[:32]]
    shared = len(ids([{"role": "system", "content": system}]))
    return chats, shared


def test_shared_system_prompt_is_stored_and_computed_once(system_chats):
    chats, shared = system_chats
    llm = LLM(kv_cache_memory=512 << 20)
    outs = run_checked(llm, chats, GREEDY)
    stats = llm.kv_cache_stats()
    own = sum(len(c) - shared + NEW for c in chats)
    C = llm.engine.pool.chunk_size
    assert stats.peak_physical_tokens <= shared + own + len(chats) * C + C
    # the system prompt is computed once, every other prompt token once
    assert stats.computed_prompt_tokens == distinct_prefix_tokens(chats)
    assert distinct_prefix_tokens(chats) <= shared + sum(len(c) - shared for c in chats)
    assert stats.prefix_hit_tokens >= (len(chats) - 1) * shared

    nocache = LLM(kv_cache_memory=1536 << 20, enable_prefix_caching=False)
    ref = run_checked(nocache, chats, GREEDY)
    assert nocache.kv_cache_stats().computed_prompt_tokens == sum(map(len, chats))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    for chat, out in list(zip(chats, outs, strict=True))[::4]:
        assert out.outputs[0].token_ids == hf_greedy(chat, NEW)


@pytest.fixture(scope="module")
def hierarchy(tokenizer, sharegpt_questions):
    """A few-shot prefix, 3 problem descriptions below it, 4 samples of each."""
    fewshot = tokenizer.encode(" ".join(sharegpt_questions[40:48]))[:400]
    problems = [tokenizer.encode(q)[:120] for q in sharegpt_questions[48:51]]
    return fewshot, problems


def test_hierarchical_levels_are_each_stored_once(hierarchy):
    fewshot, problems = hierarchy
    llm = LLM(kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0.8, seed=3, n=4, max_tokens=NEW, ignore_eos=True)
    outs = run_checked(llm, [fewshot + p for p in problems], params)
    stats = llm.kv_cache_stats()
    C = llm.engine.pool.chunk_size
    unique = distinct_prefix_tokens([fewshot + p for p in problems])
    assert unique <= len(fewshot) + sum(len(p) for p in problems)
    assert stats.peak_physical_tokens <= unique + 12 * NEW + 12 * C + 3 * C + C
    # the prefix and each problem once: the other 3 samples fork from the first's last token
    assert stats.computed_prompt_tokens == unique
    assert all(len(o.outputs) == 4 for o in outs)


def test_outputs_identical_with_caching_on_and_off_under_memory_pressure(hierarchy):
    fewshot, problems = hierarchy
    prompts = [fewshot + p for p in problems] * 2
    params = SamplingParams(temperature=0, n=2, max_tokens=NEW, ignore_eos=True)
    per_token = 2 * 30 * 3 * 64 * 4
    small = dict(kv_cache_memory=700 * per_token, max_num_batched_tokens=256)
    on = LLM(**small)
    outs_on = run_checked(on, prompts, params)
    off = LLM(enable_prefix_caching=False, **small)
    outs_off = run_checked(off, prompts, params)
    assert on.engine.scheduler.num_preemptions + off.engine.scheduler.num_preemptions > 0
    assert ([[c.token_ids for c in o.outputs] for o in outs_on]
            == [[c.token_ids for c in o.outputs] for o in outs_off])


def test_pinned_prefix_is_prefilled_once_and_never_evicted(tokenizer, hierarchy):
    fewshot, problems = hierarchy
    llm = LLM(kv_cache_memory=256 << 20)
    pin_id = llm.pin_prefix(fewshot)
    assert llm.kv_cache_stats().pinned_tokens == len(fewshot)
    outs = run_checked(llm, [fewshot + p for p in problems], GREEDY)
    stats = llm.kv_cache_stats()
    assert stats.prefix_hit_tokens >= 3 * len(fewshot)
    assert stats.computed_prompt_tokens == distinct_prefix_tokens([fewshot + p for p in problems])
    llm.unpin_prefix(pin_id)
    assert llm.kv_cache_stats().pinned_tokens == 0
    llm.check_integrity()
    assert outs[0].outputs[0].token_ids == hf_greedy(fewshot + problems[0], NEW)


def test_cache_salts_split_sharing_and_keep_outputs(hierarchy):
    fewshot, problems = hierarchy
    prompt = fewshot + problems[0]
    llm = LLM(kv_cache_memory=256 << 20, max_pinned_tokens_per_tenant=len(fewshot) + 8)
    outs = llm.generate([prompt, prompt, prompt], GREEDY, use_tqdm=False, cache_salt=["x", "y", "x"])
    assert [o.num_cached_tokens for o in outs] == [0, 0, len(prompt) - 1]  # only within salt x
    assert {tuple(o.outputs[0].token_ids) for o in outs} == {tuple(hf_greedy(prompt, NEW))}
    pin = llm.pin_prefix(fewshot, public=False, cache_salt="z", ttl=2.0)  # private: salt z only
    expires_at = llm.engine.pins.pins[pin].expires_at
    assert llm.kv_cache_stats().pinned_tokens == len(fewshot)
    with pytest.raises(ValueError, match="quota"):
        llm.pin_prefix(problems[1], public=False, cache_salt="z")
    other = fewshot + problems[1]
    outs = llm.generate([other, other], GREEDY, use_tqdm=False, cache_salt=["z", "w"])
    assert outs[0].num_cached_tokens >= len(fewshot) and outs[1].num_cached_tokens == 0
    with pytest.raises(ValueError, match="does not fit"):
        llm.pin_prefix([7] * llm.kv_cache_stats().capacity_tokens)
    time.sleep(max(0.0, expires_at - time.time()) + 0.05)
    llm.generate(problems[2], GREEDY, use_tqdm=False)  # a step: the expired pin goes
    assert llm.kv_cache_stats().pinned_tokens == 0
    with pytest.raises(ValueError, match="no pinned prefix"):
        llm.unpin_prefix(pin)
    llm.check_integrity()
