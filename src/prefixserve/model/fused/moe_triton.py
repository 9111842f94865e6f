"""Triton twin of `moe_reference.expert_outputs`: two grouped GEMMs over the (token, slot)
pairs sorted by expert (`align_pairs`), one launch each.

    up:    program (block b, column tile n): the block_m pairs of block b (one expert e) times
           the gate and up rows n of w13[e] -> h[pair, n] = round(silu(round(g)) ) * round(u)
    down:  program (block b, column tile n): h[pairs] times rows n of w2[e] -> y[pair, n] =
           round(round(h W_down^T) * weight)

Each block reads its expert's weight tiles once for up to block_m pairs: the weights, not the
tokens, dominate the bytes of a decode step (Qwen3-30B-A3B: 128 experts x 4.7 MB in bf16).
Products accumulate in fp32 (tl.dot, IEEE fp32 inputs: no TF32) and round where torch rounds
(`fused.triton._round`); the sums' order differs from torch's, so results match the twin to
the bounds in tests/model/test_moe.py. Grids depend on T, K and E only (CUDA-graph safe);
blocks past the routing's last (block_expert -1) exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton import _DTYPES, _exp, _round, _rounded


def align_pairs(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's run padded to a multiple of block_m rows, on the
    device and without reading anything back (CUDA-graph safe: shapes depend on T, K, E only).

    -> pair_ids [B * block_m] int32: pair t*K + k per row, P = T*K on padding rows;
       block_expert [B] int32: the expert of each block of block_m rows, -1 past the last.
    B = ceil((P + E * (block_m - 1)) / block_m), the most blocks any routing needs.
    """
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    # (bincount would read the largest id back to size its output: not capturable)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    blocks = (pairs + num_experts * (block_m - 1) + block_m - 1) // block_m
    pair_ids = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    pair_ids[(padded_end - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_ids, block_expert


@triton.jit
def _up_kernel(x, w13, h, pair_ids, block_expert, stride_x, stride_we, stride_wn, stride_h,
               num_pairs, K: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(block_expert + b).to(tl.int64)
    if e >= 0:
        pair = tl.load(pair_ids + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        ok = pair < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < INTER
        x_rows = x + (pair // K)[:, None] * stride_x
        w_gate = w13 + e * stride_we + cols[None, :] * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_rows + kk[None, :], mask=ok[:, None] & (kk < H)[None, :], other=0.0)
            w_ok = (kk < H)[:, None] & col_ok[None, :]
            wg = tl.load(w_gate + kk[:, None], mask=w_ok, other=0.0)
            wu = tl.load(w_gate + INTER * stride_wn + kk[:, None], mask=w_ok, other=0.0)
            if DOT_FP32:
                xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            acc_g = tl.dot(xt, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xt, wu, acc_u, input_precision=PRECISION)
        dtype = h.dtype.element_ty
        g = _rounded(acc_g, dtype)
        silu = _rounded(tl.math.div_rn(g, 1.0 + _exp(-g)), dtype)
        tl.store(h + pair[:, None] * stride_h + cols[None, :], _round(silu * _rounded(acc_u, dtype), dtype),
                 mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h, w2, y, weights, pair_ids, block_expert, stride_h, stride_we, stride_wn,
                 stride_y, num_pairs, H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 DOT_FP32: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(block_expert + b).to(tl.int64)
    if e >= 0:
        pair = tl.load(pair_ids + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        ok = pair < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            ht = tl.load(h + pair[:, None] * stride_h + kk[None, :],
                         mask=ok[:, None] & (kk < INTER)[None, :], other=0.0)
            wt = tl.load(w2 + e * stride_we + cols[None, :] * stride_wn + kk[:, None],
                         mask=(kk < INTER)[:, None] & col_ok[None, :], other=0.0)
            if DOT_FP32:
                ht, wt = ht.to(tl.float32), wt.to(tl.float32)
            acc = tl.dot(ht, wt, acc, input_precision=PRECISION)
        dtype = y.dtype.element_ty
        w = tl.load(weights + pair, mask=ok, other=0.0).to(tl.float32)
        tl.store(y + pair[:, None] * stride_y + cols[None, :],
                 _round(_rounded(acc, dtype) * w[:, None], dtype), mask=ok[:, None] & col_ok[None, :])


def block_m_for(pairs: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) while experts see few pairs each (decode), 64 once
    an average expert fills such a block (prefill)."""
    return 16 if pairs < 64 * num_experts else 64


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Twin of `moe_reference.expert_outputs` (same shapes and dtypes)."""
    (t, hidden), (experts, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    inter = two_i // 2
    assert w13.shape == (experts, 2 * inter, hidden) and w2.shape == (experts, hidden, inter)
    assert x.dtype in _DTYPES and w13.dtype == w2.dtype == topk_weights.dtype == x.dtype
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert topk_weights.shape == topk_ids.shape == (t, k)
    pairs = t * k
    y = x.new_empty((pairs, hidden))
    if pairs == 0:
        return y
    block_m = block_m_for(pairs, experts)
    pair_ids, block_expert = align_pairs(topk_ids, experts, block_m)
    h = x.new_empty((pairs, inter))
    # fp32: IEEE products, not TF32. The interpreter (CPU tensors) multiplies raw bf16 bits in
    # tl.dot (triton 3.9): there bf16 tiles are upcast, exactly (the same products, in fp32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    dot_fp32 = x.device.type == "cpu" and x.dtype == torch.bfloat16
    blocks = block_expert.numel()
    common = dict(BLOCK_M=block_m, BLOCK_K=64, PRECISION=precision, DOT_FP32=dot_fp32)
    _up_kernel[(blocks, triton.cdiv(inter, 64))](
        x, w13, h, pair_ids, block_expert, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        pairs, K=k, H=hidden, INTER=inter, BLOCK_N=64, **common, enable_fp_fusion=False)
    _down_kernel[(blocks, triton.cdiv(hidden, 64))](
        h, w2, y, topk_weights.contiguous().view(-1), pair_ids, block_expert, h.stride(0),
        w2.stride(0), w2.stride(1), y.stride(0), pairs, H=hidden, INTER=inter, BLOCK_N=64, **common,
        enable_fp_fusion=False)
    return y
