"""Overlapped scheduling (step t+1 launched before step t's tokens are read) changes nothing a
user sees: outputs, logprobs, stops and the cache contract are those of one-step-at-a-time."""

from __future__ import annotations

import pytest

from prefixserve import SamplingParams
from prefixserve.kvcache.prefix_tree import PENDING

MIXED = [  # greedy forks, eos stops, stop strings, seeded draws, logprobs, min_tokens
    SamplingParams(temperature=0, max_tokens=24, n=3),
    SamplingParams(temperature=0, max_tokens=40, stop=[".", "\n"]),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, n=2, min_tokens=12),
    SamplingParams(temperature=0, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=32),
]


def _run(engine, prompts, params, abort_at=None):
    """Step to the end; -> (outputs by request, steps that ended with a step still in flight)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    done, overlapped, steps = {}, 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        overlapped += bool(engine._inflight)
        if steps == abort_at:
            engine.abort(ids[0])
        engine.check_integrity()
    return [done.get(rid) for rid in ids], overlapped


def _tokens(outs):
    return [None if o is None else [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs]
            for o in outs]


@pytest.mark.parametrize("with_penalty", [False, True])
def test_overlap_gives_the_same_outputs_as_one_step_at_a_time(make_llm, sharegpt_questions, with_penalty):
    prompts = sharegpt_questions[:len(MIXED)] + [sharegpt_questions[0]]
    # the last request outlasts the others; while a penalty runs, steps run one at a time
    params = MIXED + [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                     repetition_penalty=1.3 if with_penalty else 1)]
    on, off = make_llm(overlap_schedule=True), make_llm(overlap_schedule=False)
    got, overlapped = _run(on.engine, prompts, params)
    want, none = _run(off.engine, prompts, params)
    assert _tokens(got) == _tokens(want)
    assert none == 0 and (overlapped == 0) == with_penalty
    assert not any(PENDING in n.tokens for n in on.engine.tree.iter_nodes())


def test_abort_while_a_step_is_in_flight(make_llm, sharegpt_questions):
    prompts, params = sharegpt_questions[:3], [SamplingParams(temperature=0, max_tokens=20)] * 3
    got, overlapped = _run(make_llm(overlap_schedule=True).engine, prompts, params, abort_at=4)
    want, _ = _run(make_llm(overlap_schedule=False).engine, prompts, params)
    assert overlapped and got[0] is None and _tokens(got[1:]) == _tokens(want[1:])
