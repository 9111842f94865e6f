"""Chunked prefill lets others through: a long prompt is prefilled over several steps of at most
`max_num_batched_tokens` tokens while the running requests keep decoding in the same steps and a
request that arrives meanwhile is admitted and finishes its prefill first; greedy outputs stay
those of transformers whatever the chunking."""

from __future__ import annotations

import pytest

from prefixserve import SamplingParams

from engine_checks import hf_greedy, run_checked

BUDGET = 32
LONG = 320  # tokens: ten steps of the budget at least
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ids(tokenizer, sharegpt_questions):
    ids = tokenizer.encode("\n\n".join(sharegpt_questions))
    assert len(ids) > 3000
    return ids


def _record_grants(engine) -> list[dict[str, int]]:
    """Wraps the scheduler: -> the list that receives, per step, {request id: tokens granted}."""
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append({g.seq.request.request_id: g.num_tokens for g in out.seqs})
        return out
    engine.scheduler.schedule = recording
    return steps


def test_a_long_prompt_is_prefilled_beside_decodes_and_a_new_arrival(make_llm, ids):
    llm = make_llm(max_num_batched_tokens=BUDGET)
    engine = llm.engine
    steps = _record_grants(engine)
    prompts = {"a": ids[:12], "b": ids[40:57], "long": ids[100:100 + LONG], "late": ids[2000:2012]}
    new_tokens = {"a": 24, "b": 24, "long": 3, "late": 4}
    done, first_token_step = {}, {}

    def add(rid):
        engine.add_request(rid, prompts[rid], SamplingParams(max_tokens=new_tokens[rid], **GREEDY))

    add("a"), add("b")
    while engine.has_unfinished():
        for out in engine.step():
            first_token_step.setdefault(out.request_id, len(steps))
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        if len(steps) == 2:
            add("long")  # a and b are decoding
        if sum(s.get("long", 0) for s in steps) >= 3 * BUDGET and "late" not in engine.requests and "late" not in done:
            add("late")  # arrives while the long prompt is mid-prefill

    long_steps = [i for i, s in enumerate(steps) if "long" in s]
    assert all(sum(s.values()) <= BUDGET for s in steps), steps
    assert len(long_steps) >= LONG // BUDGET, steps
    # while the long prompt prefills, a and b get their decode token in every step
    prefill = long_steps[:-1]
    assert all(steps[i].get("a") == 1 and steps[i].get("b") == 1 for i in prefill), steps
    # the late request is granted beside the long prefill and has its first token before the long one
    late_steps = [i for i, s in enumerate(steps) if "late" in s]
    assert late_steps[0] < long_steps[-1], steps
    assert first_token_step["late"] < first_token_step["long"], (first_token_step, steps)
    for rid, prompt in prompts.items():
        assert done[rid].outputs[0].token_ids == hf_greedy(prompt, new_tokens[rid]), rid


def test_two_long_prompts_share_the_budget(make_llm, ids):
    llm = make_llm(max_num_batched_tokens=BUDGET)
    steps = _record_grants(llm.engine)
    outs = run_checked(llm, [ids[:160], ids[500:660]], SamplingParams(max_tokens=2, **GREEDY))
    rids = [o.request_id for o in outs]
    both = [s for s in steps if all(s.get(r, 0) > 1 for r in rids)]
    assert len(both) >= 4, steps  # both prefill in the same steps, neither waits for the other
    assert all(sum(s.values()) <= BUDGET for s in steps), steps
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(p, 2) for p in (ids[:160], ids[500:660])]


@pytest.fixture(scope="module")
def sharing(ids):
    """Prompts that share a prefix (in-batch sharing and cache hits), one longer than the
    budgets, and transformers' greedy continuations of them."""
    prompts = [ids[:100], ids[:60] + ids[700:720], ids[:20], ids[1200:1240]]
    return prompts, [hf_greedy(p, 8) for p in prompts]


@pytest.mark.parametrize("budget", [7])
def test_greedy_outputs_match_transformers_whatever_the_budget(make_llm, sharing, budget):
    """Batched: the chunk boundaries move with the budget, the tokens do not."""
    prompts, references = sharing
    outs = run_checked(make_llm(max_num_batched_tokens=budget, chunk_size=16), prompts,
                       SamplingParams(max_tokens=8, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == references
