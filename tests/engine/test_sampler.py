import dataclasses
import math

import pytest
import torch

from prefixserve.engine.sampler import Sampler, _apply_penalties
from prefixserve.sampling_params import SamplingParams

EOS = 3


@dataclasses.dataclass
class Row:
    params: SamplingParams
    sample_seed: int | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)


def seeded(seed: int, **kwargs) -> Row:
    return Row(SamplingParams(seed=seed, **kwargs), seed)


def batch(params: SamplingParams, n: int) -> list[Row]:
    return [Row(params) for _ in range(n)]


def sample_counts(logits: torch.Tensor, params: SamplingParams, n: int = 20000) -> torch.Tensor:
    """Draws n tokens from one row of logits [V]; returns their empirical frequencies [V]."""
    torch.manual_seed(0)
    out = Sampler((EOS,)).sample(logits.expand(n, -1).contiguous(), batch(params, n))
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()).float() / n


def test_greedy_is_argmax_with_ties_to_lowest_index():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    logits[2, [7, 11, 40]] = 100.0
    out = Sampler((EOS,)).sample(logits, batch(SamplingParams(temperature=0), 8))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[2] == 7
    assert out.logprobs == [None] * 8


def test_caller_logits_not_modified():
    logits = torch.randn(2, 10)
    before = logits.clone()
    rows = [Row(SamplingParams(repetition_penalty=1.5, min_tokens=2, top_k=3), None, [1, 2], [4])] * 2
    Sampler((EOS,)).sample(logits, rows)
    assert torch.equal(logits, before)


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5, -2.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    row = Row(params, None, prompt_token_ids=[0, 1], output_token_ids=[2, 2, 4])
    _apply_penalties(logits, [row])
    # token 0: prompt, >0 -> 2/2.  token 1: prompt, <0 -> -1*2.  token 2: output x2 -> 1/2 - 0.5 - 2*0.25.
    # token 3: unseen.  token 4: output x1 -> -2*2 - 0.5 - 0.25.  token 5: unseen.
    expected = torch.tensor([[1.0, -2.0, 1 / 2 - 0.5 - 0.5, 0.5, -4.0 - 0.75, 3.0]])
    torch.testing.assert_close(logits, expected)


def test_penalties_only_touch_rows_that_ask():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [
        Row(SamplingParams(), None, [2], [2]),
        Row(SamplingParams(frequency_penalty=2.0), None, [0], [2, 2]),
    ]
    _apply_penalties(logits, rows)
    torch.testing.assert_close(logits, torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, -1.0]]))


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 1.5, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert Sampler((EOS,)).sample(logits, [Row(params, None, [0], [1])]).token_ids == [2]
    assert Sampler((EOS,)).sample(logits, [Row(params, None, [0], [2])]).token_ids == [1]


PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


@pytest.mark.parametrize(
    "params, support",
    [
        (SamplingParams(), {0, 1, 2, 3, 4}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(top_p=0.8), {0, 1, 2}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(top_k=4, top_p=0.9, min_p=0.3), {0, 1, 2}),
    ],
)
def test_truncation_restricts_support_and_renormalises(params, support):
    freq = sample_counts(PROBS.log(), params)
    assert set(freq.nonzero().flatten().tolist()) == support
    kept = torch.zeros_like(PROBS)
    kept[list(support)] = PROBS[list(support)]
    torch.testing.assert_close(freq, kept / kept.sum(), atol=0.02, rtol=0)


def test_temperature_sharpens_the_distribution():
    logits = PROBS.log()
    freq = sample_counts(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(freq, (logits / 0.5).softmax(-1), atol=0.02, rtol=0)


def run_steps(rows: list[Row], watch: int, steps: int = 12, vocab: int = 64) -> list[int]:
    """Samples `steps` tokens for every row (random logits per step); returns rows[watch]'s tokens."""
    logits_rng = torch.Generator().manual_seed(123)
    sampler = Sampler((EOS,))
    for _ in range(steps):
        logits = torch.randn(vocab, generator=logits_rng).expand(len(rows), -1).contiguous()
        for row, token in zip(rows, sampler.sample(logits, rows).token_ids, strict=True):
            row.output_token_ids.append(token)
    return rows[watch].output_token_ids


def test_seeded_row_reproducible_and_independent_of_batch():
    kw = dict(top_p=0.95, presence_penalty=0.3)
    alone = run_steps([seeded(7, **kw)], watch=0)
    assert run_steps([seeded(7, **kw)], watch=0) == alone
    others = [
        Row(SamplingParams()),
        seeded(8, **kw),
        Row(SamplingParams(temperature=0)),
        seeded(7, top_k=5),
        Row(SamplingParams(temperature=0.7, logprobs=3, min_tokens=4)),
    ]
    for position in (0, 2, 5):
        torch.manual_seed(position)  # the shared generator's state must not matter
        rows = others[:position] + [seeded(7, **kw)] + others[position:]
        rows = [dataclasses.replace(r, output_token_ids=[]) for r in rows]
        assert run_steps(rows, watch=position) == alone
    assert run_steps([seeded(9, **kw)], watch=0) != alone


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.0, -1.0], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=10.0), None, [1], []),
        Row(SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = Sampler((EOS,)).sample(logits, rows)
    raw = logits.log_softmax(-1)
    # Row 0: the penalty moves the greedy choice off token 1, but logprobs stay those of the raw logits.
    assert out.token_ids == [2, 5]
    first = out.logprobs[0]
    assert list(first) == [2, 1, 4]  # sampled first, then the top-3 (token 2 ties token 4)
    assert {t: lp.rank for t, lp in first.items()} == {2: 2, 1: 1, 4: 2}
    for t, lp in first.items():
        assert math.isclose(lp.logprob, raw[0, t].item(), rel_tol=1e-6)
        assert lp.decoded_token is None
    assert list(out.logprobs[1]) == [5]
    assert out.logprobs[1][5].rank == 1
    assert math.isclose(out.logprobs[1][5].logprob, raw[1, 5].item(), rel_tol=1e-6)


def test_sampled_rank_outside_top_k():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    row = Row(SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=100.0), None, [0, 1, 2], [])
    out = Sampler((EOS,)).sample(logits, [row])
    assert out.token_ids == [3]
    assert {t: lp.rank for t, lp in out.logprobs[0].items()} == {3: 4, 0: 1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_tokens(temperature):
    logits = torch.full((1, 8), -5.0)
    logits[0, EOS] = 20.0
    logits[0, 6] = 19.0
    logits[0, 1] = 1.0
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[6])
    sampler = Sampler((EOS,))
    assert sampler.sample(logits, [Row(params, None, [], [0, 0])]).token_ids == [1]
    if temperature == 0:
        assert sampler.sample(logits, [Row(params, None, [], [0, 0, 0])]).token_ids == [EOS]


def test_ignore_eos_does_not_mask_eos():
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 20.0
    logits[0, 6] = 19.0
    params = SamplingParams(temperature=0, min_tokens=5, ignore_eos=True, stop_token_ids=[6])
    assert Sampler((EOS,)).sample(logits, [Row(params)]).token_ids == [EOS]


def test_seeded_rows_draw_from_the_right_distribution():
    """The counter-based noise of seeded rows is a fair Exp(1) race: over many seeds (and over
    the steps of one seed) tokens come with their probabilities."""
    logits = PROBS.log().expand(20000, -1).contiguous()
    rows = [Row(SamplingParams(seed=s), s) for s in range(20000)]
    out = Sampler((EOS,)).sample(logits, rows).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=PROBS.numel()).float() / len(out)
    torch.testing.assert_close(freq, PROBS, atol=0.02, rtol=0)
    row = Row(SamplingParams(seed=5), 5)
    steps = []
    for _ in range(3000):
        steps += Sampler((EOS,)).sample(PROBS.log()[None], [row]).token_ids
        row.output_token_ids.append(steps[-1])
    freq = torch.bincount(torch.tensor(steps), minlength=PROBS.numel()).float() / len(steps)
    torch.testing.assert_close(freq, PROBS, atol=0.04, rtol=0)


def test_deterministic_rows_do_not_depend_on_the_batch():
    """Deterministic mode: each row's token and logprobs the same alone as in any batch (top-k,
    top-p and min-p over the row's whole vocabulary, ties in bf16-rounded logits included).
    PREFIXSERVE_TRITON_TEST_DEVICE=cuda runs it on a GPU, where torch's scans follow the shape."""
    import os
    device = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 4000, generator=gen) * 3).bfloat16().float().to(device)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, seed=s, logprobs=lp)
              for t, k, p, mp, s, lp in [(0.8, 0, 0.9, 0, 1, 3), (1.0, 20, 1.0, 0, 2, 1), (0.7, 50, 0.95, 0, 3, 0),
                                         (0, 0, 1.0, 0, 4, 5), (1.2, 0, 0.5, 0.05, 5, 2), (0.9, 7, 0.99, 0, 6, 4)] * 2]
    rows = [Row(p, p.seed) for p in params]
    sampler = Sampler((EOS,), deterministic=True)
    together = sampler.sample(logits, rows)
    for i in range(len(rows)):
        for others in ([], [(i + 1) % len(rows)], [(i + 3) % len(rows), (i + 5) % len(rows)]):
            at = [i, *others]
            out = sampler.sample(logits[at], [rows[j] for j in at])
            assert out.token_ids[0] == together.token_ids[i] and out.logprobs[0] == together.logprobs[i], (i, others)
