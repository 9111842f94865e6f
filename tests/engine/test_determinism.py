"""Deterministic mode (issue 24) on the embedded model, CPU: every request's tokens and logprobs
bit for bit those of the request run alone, under every setting of `prefixserve bench
determinism`'s matrix (backends, prefix caching, batch sizes, a prefix shared mid-flight,
chunked-prefill budgets, overlap, preemption), in fp32 and bf16, and across tensor-parallel
batches; and the default mode, which the test would catch, is not batch-invariant."""

from __future__ import annotations

import pytest

from prefixserve.bench import determinism as D

BASE = {"deterministic": True, "device": "cpu"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_setting_matches_each_request_alone(dtype):
    doc = D.check_matrix({**BASE, "dtype": dtype}, prefix_len=150, max_tokens=10)
    rows = {r["name"]: r for r in doc["settings"]}
    assert [n for n, r in rows.items() if not r["identical"]] == []
    assert rows["preemption"]["preemptions"] > 0, "the setting was meant to preempt"
    assert len(rows) >= 17


def test_tensor_parallel_ranks_sum_in_order():
    """Three CPU ranks (an all-reduce of 3 partial sums, whose order gloo does not fix): the
    workload batched, against each request alone at three ranks."""
    kw = {**BASE, "dtype": "float32", "tensor_parallel_size": 3, "attention_backend": "hydragen"}
    prompts = D._prompts(kw, 150, 0)
    alone, _ = D._run({**kw, "enable_prefix_caching": False}, prompts, 6, [([i], 0) for i in range(len(D.REQUESTS))])
    batched, _ = D._run(kw, prompts, 6, [(list(range(len(D.REQUESTS))), 2)])
    assert batched == alone


def test_the_default_mode_is_not_batch_invariant():
    """What the tests above would catch: without deterministic mode, batching changes bits."""
    kw = {"device": "cpu", "dtype": "float32", "attention_backend": "hydragen"}
    prompts = D._prompts(kw, 150, 0)
    alone, _ = D._run({**kw, "enable_prefix_caching": False}, prompts, 4, [([i], 0) for i in range(len(D.REQUESTS))])
    batched, _ = D._run(kw, prompts, 4, [(list(range(len(D.REQUESTS))), 0)])
    assert batched != alone
