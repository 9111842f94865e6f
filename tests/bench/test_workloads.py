"""Each workload builds the sharing structure its seed experiment has, in the model's vocabulary."""

from __future__ import annotations

import pytest

from prefixserve.bench import workloads as W


@pytest.fixture(scope="module")
def src():
    return W.token_source({})


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_system_prompt_is_exact_and_realistic(src):
    for n in (64, 257, 2048):
        assert len(src.system_prompt(n)) == n
    assert src.system_prompt(64) == src.system_prompt(1024)[:64]  # one text, cut
    assert len(set(src.system_prompt(1024))) > 100  # a rule list, not one token repeated


def test_sharegpt_system_prompt_then_real_questions(src):
    wl = W.sharegpt(src, system_prompt_len=128, num_prompts=8, max_output_len=64, max_prompt_len=256)
    system = src.system_prompt(128)
    assert len(wl.prompts) == 8 and wl.shared_prefix_len == 128
    for p in wl.prompts:
        assert p[:128] == system and 4 <= len(p) - 128 <= 256
    assert all(_common(a, b) < len(a) for a in wl.prompts for b in wl.prompts if a is not b)
    assert wl.greedy and all(p.ignore_eos and 4 <= p.max_tokens <= 64 for p in wl.params)
    assert len({p.max_tokens for p in wl.params}) > 1, "output lengths come from the real answers"


def test_synthetic_fixed_lengths(src):
    wl = W.synthetic(src, system_prompt_len=64, num_prompts=5, prompt_len=32, gen_len=16)
    assert [len(p) for p in wl.prompts] == [96] * 5
    assert wl.output_tokens == 80 and wl.greedy


def test_multi_sample_one_prefix_n_completions(src):
    wl = W.multi_sample(src, prefix_len=100, batch=12, gen_len=8, seed=3)
    assert len(wl.prompts) == 1 and len(wl.prompts[0]) == 100
    (p,) = wl.params
    assert p.n == 12 and p.temperature > 0 and p.seed == 3 and p.ignore_eos
    assert wl.num_sequences == 12 and wl.output_tokens == 96 and not wl.greedy


def test_hierarchical_fewshot_then_problems_then_samples(src):
    wl = W.hierarchical(src, fewshot_len=80, problems=3, problem_len=20, samples=4, gen_len=8)
    fewshot = wl.prompts[0][:80]
    assert len(wl.prompts) == 3 and all(len(p) == 100 and p[:80] == fewshot for p in wl.prompts)
    pairs = [(a, b) for i, a in enumerate(wl.prompts) for b in wl.prompts[i + 1:]]
    assert all(_common(a, b) < 100 for a, b in pairs), "problem descriptions differ"
    assert [p.n for p in wl.params] == [4, 4, 4] and len({p.seed for p in wl.params}) == 3
    assert wl.num_sequences == 12 and wl.shared_prefix_len == 80


def test_long_doc_one_document_many_questions(src):
    wl = W.long_doc(src, doc_len=300, questions=6, question_len=12, gen_len=5)
    doc = wl.prompts[0][:300]
    assert all(p[:300] == doc and len(p) == 312 for p in wl.prompts)
    assert len({tuple(p[300:]) for p in wl.prompts}) == 6 and wl.greedy


def test_ids_map_into_a_small_vocabulary(src):
    small = W.TokenSource(src.tokenizer, vocab_size=1000)
    ids = small.system_prompt(200) + small.take(500)
    assert max(ids) < 1000 and len(ids) == 700


def test_sweep_points_are_hydragen_fig3():
    pts = W.sweep_points(("batch", [8, 16, 32]), ("prefix_len", [2048, 4096, 8192]))
    assert pts == [{"batch": 8, "prefix_len": 2048}, {"batch": 16, "prefix_len": 2048},
                   {"batch": 32, "prefix_len": 2048}, {"batch": 32, "prefix_len": 4096},
                   {"batch": 32, "prefix_len": 8192}]
    assert W.sweep_points(("system_prompt_len", [64, 256])) == [{"system_prompt_len": 64}, {"system_prompt_len": 256}]


def test_multi_tenant_distinct_system_prompts_interleaved(src):
    wl = W.multi_tenant(src, tenants=4, system_prompt_len=96, num_prompts=12, max_output_len=16)
    assert len(wl.prompts) == len(wl.tenants) == 12 and set(wl.tenants) == {0, 1, 2, 3}
    assert wl.tenants != tuple(sorted(wl.tenants)), "tenants arrive interleaved"
    systems = {t: p[:96] for t, p in zip(wl.tenants, wl.prompts, strict=True)}
    for t, p in zip(wl.tenants, wl.prompts, strict=True):
        assert p[:96] == systems[t] and len(p) > 96
    assert all(_common(systems[a], systems[b]) < 8 for a in systems for b in systems if a != b), \
        "tenants share no prefix beyond their first words"
    ideal = W.ideal_cached_tokens(wl)
    assert (12 - 4) * 96 <= ideal < (12 - 4) * 96 + 12 * 8, "each tenant's later requests hit its system prompt"
    other_run = W.multi_tenant(src, tenants=4, system_prompt_len=96, num_prompts=12, max_output_len=16, run=1)
    assert all(_common(a, b) < 8 for a in other_run.prompts for b in wl.prompts), "a run's tenants are its own"
    with pytest.raises(ValueError, match="tenants"):
        W.multi_tenant(src, tenants=13, system_prompt_len=96, num_prompts=12, max_output_len=16)
