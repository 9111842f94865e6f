"""Partitions and pins through the real engine: cache salts split sharing, public pins are read
by every partition, pins expire, are refused whole when they cannot fit, and obey quotas."""

from __future__ import annotations

import time

import pytest

from prefixserve import LLM, SamplingParams

from engine_checks import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(tokenizer, sharegpt_questions):
    return tokenizer.encode(" ".join(sharegpt_questions[:3]))[:120]


def cached(llm, prompt, salt=""):
    out = llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt=salt)[0]
    llm.check_integrity()
    return out.num_cached_tokens, out.outputs[0].token_ids


def test_cache_salts_share_nothing_but_outputs_are_unchanged(prompt):
    llm = LLM(kv_cache_memory=64 << 20, chunk_size=16)
    assert cached(llm, prompt, "a")[0] == 0
    hit_b, tokens_b = cached(llm, prompt, "b")
    assert hit_b == 0  # b is told nothing about a's prompt
    hit_a, tokens_a = cached(llm, prompt, "a")
    assert hit_a == len(prompt) - 1  # the last prompt token is always computed
    assert tokens_a == tokens_b == hf_greedy(prompt, 6)
    outs = llm.generate([prompt, prompt], GREEDY, use_tqdm=False, cache_salt=["c", "a"])
    assert [o.num_cached_tokens for o in outs] == [0, len(prompt) - 1]
    with pytest.raises(ValueError, match="1 cache salts for 2 prompts"):
        llm.generate([prompt, prompt], GREEDY, use_tqdm=False, cache_salt=["a"])


def test_public_pins_are_read_by_every_salt_private_ones_by_their_own(prompt):
    llm = LLM(kv_cache_memory=64 << 20, chunk_size=16)
    room = llm.engine.max_sequence_tokens
    public = llm.pin_prefix(prompt[:64])
    private = llm.pin_prefix(prompt[64:96], public=False, cache_salt="a")
    assert cached(llm, prompt, "x")[0] == 64
    assert cached(llm, prompt[64:], "b")[0] == 0
    assert cached(llm, prompt[64:], "a")[0] == 32
    pins = {p.id: p for p in llm.engine.list_pins()}
    assert set(pins) == {public, private} and pins[public].public and not pins[private].public
    llm.unpin_prefix(private)
    llm.unpin_prefix(public)
    assert llm.kv_cache_stats().pinned_tokens == 0 and llm.engine.max_sequence_tokens == room
    with pytest.raises(ValueError, match="no pinned prefix"):
        llm.unpin_prefix(public)
    llm.check_integrity()


def test_a_pin_expires_after_its_ttl(prompt):
    llm = LLM(kv_cache_memory=64 << 20, chunk_size=16)
    pin = llm.engine.pin_prefix(prompt[:40], ttl=0.3)
    assert pin.expires_at is not None and llm.kv_cache_stats().pinned_tokens == 40
    time.sleep(0.4)
    assert llm.engine.list_pins() == []
    assert llm.kv_cache_stats().pinned_tokens == 0
    llm.check_integrity()
    with pytest.raises(ValueError, match="ttl must be a positive"):
        llm.pin_prefix(prompt[:40], ttl=0)


def test_a_pin_that_cannot_fit_is_refused_whole(prompt):
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 KV heads of 64, fp32
    llm = LLM(kv_cache_memory=200 * per_token, chunk_size=16)  # about a dozen chunks
    chunks, free = llm.engine.pool.num_chunks, llm.engine.pool.num_free
    with pytest.raises(ValueError, match="does not fit"):
        llm.pin_prefix(list(range(10, 10 + (chunks - 1) * 16)))  # leaves one chunk: no sequence and a spare
    assert llm.engine.pool.num_free == free and llm.engine.list_pins() == []
    llm.pin_prefix(prompt[:96])  # 6 chunks; sequences then get what is left but one spare chunk
    assert llm.engine.max_sequence_tokens == (chunks - 6 - 1) * 16 < len(prompt) + 80
    with pytest.raises(ValueError, match="can never fit"):
        llm.generate([prompt], SamplingParams(max_tokens=80), use_tqdm=False)
    llm.check_integrity()


def test_the_pinned_token_quota_is_per_tenant_and_public_pins_count_for_none(prompt):
    llm = LLM(kv_cache_memory=64 << 20, chunk_size=16, max_pinned_tokens_per_tenant=50)
    llm.pin_prefix(prompt[:100])  # public: no quota
    llm.engine.pin_prefix(prompt[:40], tenant="t1")
    with pytest.raises(ValueError, match="over its quota of 50"):
        llm.engine.pin_prefix(prompt[40:60], tenant="t1")
    llm.engine.pin_prefix(prompt[40:60], tenant="t2")
    usage = {u.tenant: u.pinned_tokens for u in llm.kv_cache_stats().tenants}
    assert usage == {"": 100, "t1": 40, "t2": 20}
    llm.check_integrity()


def test_a_pin_whose_step_fails_is_not_made(prompt, monkeypatch):
    llm = LLM(kv_cache_memory=64 << 20, chunk_size=16)
    launch = llm.engine.runner.launch

    def faulty(sched):
        if any(g.seq.request.prefill_only for g in sched.seqs):
            raise RuntimeError("injected step failure")
        return launch(sched)
    monkeypatch.setattr(llm.engine.runner, "launch", faulty)
    with pytest.raises(RuntimeError, match="failed"):
        llm.pin_prefix(prompt[:40])
    assert llm.engine.list_pins() == [] and llm.kv_cache_stats().pinned_tokens == 0
    monkeypatch.setattr(llm.engine.runner, "launch", launch)
    assert cached(llm, prompt)[1] == hf_greedy(prompt, 6)  # the engine serves on
    llm.check_integrity()
