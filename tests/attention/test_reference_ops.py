"""The reference ops against float64 math: store, partial attention (GQA, causal), LSE merge."""

import math

import pytest
import torch

from prefixserve.attention.ops.reference import (
    attend_items,
    merge_partials,
    partial_attention,
    store_kv,
)

# fp32 error of one attention row, relative to max|v|: score rounding ~u*|s| plus softmax
# and PV summation ~u*sqrt(L), with |s| <~ 30 and L <~ 2000 here: < 80u = 5e-6.
FP32_TOL = 1e-5


def dense(q, k, v, q_pos, k_pos, scale):
    """float64 (o, lse) with GQA by repeating K/V heads; rows seeing nothing: (0, -inf)."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, dim=1) for x in (k, v))
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [Hq, n]
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.einsum("hnl,lhd->nhd", p, v), lse.T


def test_store_kv_writes_exactly_the_slots():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 4, 2, 8, generator=g).bfloat16()
    v_cache = torch.randn(6, 4, 2, 8, generator=g).bfloat16()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, 0, 23, 9], dtype=torch.int64)  # chunk * 4 + offset
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    store_kv(k_cache, v_cache, k, v, slots)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    for cache, before, new in ((k_cache, before_k, k), (v_cache, before_v, v)):
        flat = cache.view(24, 2, 8)
        assert torch.equal(flat[slots], new.bfloat16())
        assert torch.equal(flat[untouched], before.view(24, 2, 8)[untouched])


@pytest.mark.parametrize("group", [1, 3, 8])
def test_partial_attention_gqa_causal(group):
    g = torch.Generator().manual_seed(group)
    n, hkv, d, length = 7, 2, 16, 40
    q = torch.randn(n, hkv * group, d, generator=g)
    k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
    k_pos = torch.randperm(length, generator=g) + 10  # any order: causality is by position
    q_pos = torch.tensor([3, 9, 10, 20, 30, 49, 100], dtype=torch.int32)  # rows 0-1 see nothing
    o, lse = partial_attention(q, k, v, q_pos, k_pos.int(), 1 / math.sqrt(d))
    ref_o, ref_lse = dense(q, k, v, q_pos, k_pos, 1 / math.sqrt(d))
    assert o.dtype == lse.dtype == torch.float32 and o.shape == q.shape
    assert torch.equal(o[:2], torch.zeros_like(o[:2])) and torch.isneginf(lse[:2]).all()
    assert (o.double() - ref_o).abs().max() <= FP32_TOL * v.abs().max()
    assert torch.allclose(lse[2:].double(), ref_lse[2:], rtol=0, atol=FP32_TOL * 10)


def _split_merge(q, k, v, q_pos, k_pos, parts):
    """Partials over the key subsets `parts` (lists of key indices), merged per row."""
    outs = [partial_attention(q, k[p], v[p], q_pos, k_pos[p], 0.5) for p in parts]
    o = torch.cat([x for x, _ in outs])  # partial row i * n + r is row r's i-th partial
    lse = torch.cat([x for _, x in outs])
    n = q.shape[0]
    row_parts = torch.arange(len(parts) * n).view(len(parts), n).T.reshape(-1).int()
    row_indptr = (torch.arange(n + 1) * len(parts)).int()
    return merge_partials(o, lse, row_indptr, row_parts)


def test_merge_of_any_split_equals_whole():
    g = torch.Generator().manual_seed(1)
    n, length = 5, 30
    q = torch.randn(n, 4, 8, generator=g)
    k, v = torch.randn(length, 2, 8, generator=g), torch.randn(length, 2, 8, generator=g)
    k_pos = torch.arange(length)
    q_pos = torch.tensor([-1, 0, 7, 15, 29])  # row 0 sees no key: every partial -inf
    perm = torch.randperm(length, generator=g).tolist()
    parts = [perm[:3], [], perm[3:4], perm[4:20], perm[20:]]  # an empty part: all -inf
    o, lse = _split_merge(q, k, v, q_pos, k_pos, parts)
    ref_o, ref_lse = dense(q, k, v, q_pos, k_pos, 0.5)
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    assert (o.double() - ref_o).abs().max() <= FP32_TOL * v.abs().max()
    assert torch.allclose(lse[1:].double(), ref_lse[1:], rtol=0, atol=FP32_TOL * 10)


def test_merge_weighs_minus_inf_partials_zero():
    o_parts = torch.tensor([[[1.0, 2.0]], [[5.0, -3.0]], [[7.0, 7.0]]])  # [3, 1, 2]
    lse_parts = torch.tensor([[float("-inf")], [0.25], [float("-inf")]])
    o, lse = merge_partials(o_parts, lse_parts, torch.tensor([0, 2, 3, 3]).int(),
                            torch.tensor([0, 1, 2]).int())
    assert torch.equal(o[0], o_parts[1]) and lse[0].item() == 0.25  # exact, not just close
    assert torch.equal(o[1:], torch.zeros(2, 1, 2)) and torch.isneginf(lse[1:]).all()


def test_attend_items_rows_of_overlapping_items():
    """Two items over the same q rows and different chunks; unwritten partial rows stay empty."""
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(4, 8, 1, 4, generator=g), torch.randn(4, 8, 1, 4, generator=g)
    q = torch.randn(3, 2, 4, generator=g)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    o, lse = attend_items(q, k_cache, v_cache, q_pos=i32(100, 101, 102), item_q_start=i32(0, 1),
                          item_q_len=i32(3, 2), item_out_start=i32(0, 4),
                          item_kv_indptr=i32(0, 1, 3), kv_chunk=i32(2, 0, 3), kv_lo=i32(3, 0, 5),
                          kv_hi=i32(8, 2, 6), kv_pos=i32(0, 5, 7), scale=0.3, num_out_rows=7)
    flat_k, flat_v = k_cache.view(32, 1, 4), v_cache.view(32, 1, 4)
    first = torch.arange(19, 24)
    ref0, _ = dense(q, flat_k[first], flat_v[first], i32(100, 101, 102), torch.arange(5), 0.3)
    second = torch.tensor([0, 1, 29])
    ref1, _ = dense(q[1:], flat_k[second], flat_v[second], i32(101, 102), i32(5, 6, 7), 0.3)
    assert (o[:3].double() - ref0).abs().max() <= FP32_TOL * v_cache.abs().max()
    assert (o[4:6].double() - ref1).abs().max() <= FP32_TOL * v_cache.abs().max()
    assert torch.equal(o[[3, 6]], torch.zeros(2, 2, 4)) and torch.isneginf(lse[[3, 6]]).all()
