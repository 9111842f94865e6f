"""No request can kill the engine: every parameter is bounded at admission, and a step that
raises anyway ends only its own requests (finish_reason "error", chunks released, integrity
intact) while the engine serves on, with outputs still exact."""

from __future__ import annotations

import pytest

from prefixserve import SamplingParams
from prefixserve.engine.engine import STEP_ERROR

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer, sharegpt_questions):
    return [tokenizer.encode(q)[:60] for q in sharegpt_questions[20:23]]


@pytest.fixture(scope="module")
def expected(make_llm, prompts):
    return [o.outputs[0].token_ids for o in make_llm().generate(prompts, GREEDY, use_tqdm=False)]


def test_top_k_above_the_vocabulary_samples_like_no_top_k(make_llm, prompts):
    llm = make_llm()
    vocab = llm.engine.model.cfg.vocab_size
    wide, off = (SamplingParams(temperature=0.8, top_k=k, seed=3, max_tokens=8, ignore_eos=True) for k in (vocab + 1, 0))
    assert llm.generate(prompts[0], wide, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate(prompts[0], off, use_tqdm=False)[0].outputs[0].token_ids
    llm.check_integrity()


def test_a_tiny_temperature_is_greedy(make_llm, prompts, expected):
    tiny = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True)
    assert make_llm().generate(prompts[0], tiny, use_tqdm=False)[0].outputs[0].token_ids == expected[0]


def _fail_steps_of(monkeypatch, runner, victim: str) -> list[int]:
    """Make every step that samples for request `victim` raise after its forward ran (its K/V
    written, never marked computed). Returns a list that counts the failures."""
    failures, sample = [], runner.sampler.sample_on_device

    def faulty(logits, rows):
        if any(r.request.request_id == victim for r in rows):
            failures.append(1)
            raise RuntimeError("injected step failure")
        return sample(logits, rows)
    monkeypatch.setattr(runner.sampler, "sample_on_device", faulty)
    return failures


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_step_ends_only_its_requests(make_llm, prompts, expected, monkeypatch, overlap):
    llm = make_llm(max_num_seqs=1, overlap_schedule=overlap)  # one running: the others wait
    engine = llm.engine
    failures = _fail_steps_of(monkeypatch, engine.runner, "victim")
    engine.add_request("victim", prompts[0], GREEDY)
    engine.add_request("bystander", prompts[1], GREEDY)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
        engine.check_integrity()
    assert failures == [1]
    assert done["victim"].finished and done["victim"].outputs[0].finish_reason == STEP_ERROR
    assert done["bystander"].outputs[0].token_ids == expected[1]
    assert engine.kv_cache_stats().in_use_tokens == 0
    monkeypatch.undo()
    # The victim's prompt was written but never marked computed: the cache must not serve it.
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    llm.check_integrity()


def test_a_failure_mid_decode_with_forks(make_llm, prompts, expected, monkeypatch):
    llm = make_llm(max_num_seqs=8)
    engine = llm.engine
    engine.add_request("victim", prompts[0], SamplingParams(temperature=0, n=2, max_tokens=8, ignore_eos=True))
    engine.add_request("bystander", prompts[1], GREEDY)
    for _ in range(3):  # prefill and a few decode steps, together
        engine.step()
    failures = _fail_steps_of(monkeypatch, engine.runner, "victim")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
        engine.check_integrity()
    assert failures == [1]
    assert [c.finish_reason for c in done["victim"].outputs] == [STEP_ERROR] * 2
    # The bystander shared the failed step: it failed too; nothing is left in use.
    assert done["bystander"].outputs[0].finish_reason == STEP_ERROR
    assert engine.kv_cache_stats().in_use_tokens == 0
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
