"""Every backend against dense float64 attention on random prefix trees laid out in chunks."""

import logging
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.attention import AttentionBatch, backend_names, create_backend
from prefixserve.attention.backends.auto import AutoBackend
from prefixserve.attention.cost import GPU_COST_MODEL

from attn_trees import dense_attention, make_case

EXACT = ["paged", "relay", "hydragen", "chunk", "auto"]
# Error of the fp32 computation relative to max|v|: ~u * (|score| + sqrt(keys)) with
# u = 2^-24, |score| <~ 30, keys <~ 1500: < 80u = 5e-6 (see test_reference_ops.FP32_TOL).
FP32_TOL = 1e-5
BF16_U = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits): the cast of o


def check_close(o: torch.Tensor, case, ref: torch.Tensor) -> None:
    """|o - ref| <= u_out * |ref| + FP32_TOL * max|v| per sequence, u_out = 0 for fp32."""
    u_out = BF16_U if o.dtype == torch.bfloat16 else 0.0
    for s, (_, v) in zip(case.batch.seqs, case.seq_kv, strict=True):
        rows = slice(s.q_start, s.q_start + s.q_len)
        err = (o[rows].double() - ref[rows]).abs()
        bound = u_out * ref[rows].abs() + FP32_TOL * v.double().abs().max()
        assert (err <= bound).all(), f"max excess {(err - bound).max():.3g} in {s}"


def run_backend(name, case):
    """Plan and run on copies of the caches; returns o and the caches after run()."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    backend = create_backend(name, case.shape)
    backend.plan(case.batch)
    return backend.run(case.q, case.k, case.v, k_cache, v_cache), k_cache, v_cache


def check_written(case, k_cache, v_cache) -> None:
    """The new K/V sit at their slots, and nothing else changed."""
    hkv, d = case.k.shape[1:]
    slots = case.batch.slots
    for cache, before, new in ((k_cache, case.k_cache, case.k), (v_cache, case.v_cache, case.v)):
        flat, flat_before = cache.view(-1, hkv, d), before.view(-1, hkv, d).clone()
        assert torch.equal(flat[slots], new)
        flat_before[slots] = new
        assert torch.equal(flat.nan_to_num(7.0), flat_before.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), size=st.sampled_from([1, 16, 64]), group=st.sampled_from([1, 3, 8]),
       seed=st.integers(0, 2**31))
def test_exact_backends_match_dense(dtype, prefill, data, size, group, seed):
    draw = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    case = make_case(draw, torch.Generator().manual_seed(seed), size, group, dtype, prefill)
    ref = dense_attention(case)
    for name in EXACT:
        o, k_cache, v_cache = run_backend(name, case)
        assert o.dtype == dtype and o.shape == case.q.shape
        check_close(o, case, ref)
        check_written(case, k_cache, v_cache)


def test_registry_has_exactly_the_backends():
    assert backend_names() == sorted([*EXACT, "no-attention"])
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("flash", None)


def _fixed_case(prefill=False, seed=3):
    rng = random.Random(seed)
    return make_case(rng.randint, torch.Generator().manual_seed(seed), 16, 3, torch.float32,
                     prefill)


def test_no_attention_writes_kv_and_returns_zeros():
    case = _fixed_case()
    o, k_cache, v_cache = run_backend("no-attention", case)
    assert torch.equal(o, torch.zeros_like(case.q))
    check_written(case, k_cache, v_cache)


def test_auto_logs_its_choice_and_is_exact(caplog):
    case = _fixed_case(prefill=True)
    backend = AutoBackend(case.shape, model=GPU_COST_MODEL)
    with caplog.at_level(logging.DEBUG, logger="prefixserve.attention.backends.auto"):
        backend.plan(case.batch)
    assert f"auto attention: {backend.chosen}" in caplog.text
    o = backend.run(case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone())
    check_close(o, case, dense_attention(case))


@pytest.mark.parametrize("name", [*EXACT, "no-attention"])
def test_empty_batch(name):
    shape = _fixed_case().shape
    backend = create_backend(name, shape)
    backend.plan(AttentionBatch((), 16, torch.zeros(0, dtype=torch.int64)))
    q = torch.zeros(0, shape.num_heads, shape.head_dim)
    kv = torch.zeros(0, shape.num_kv_heads, shape.head_dim)
    cache = torch.zeros(2, 16, shape.num_kv_heads, shape.head_dim)
    assert backend.run(q, kv, kv, cache, cache.clone()).shape == q.shape
