"""`merge_partials` on the GPU: the log-sum-exp merge of fp32 partials, one pass per row.

Program (row r, block of BLOCK_H heads) folds the row's partials in CSR order, UNROLL at a
time (a chunk; slots past the row's end load as -inf partials, which weigh exactly 0, so a
row inside one chunk folds the same, bit for bit, at any UNROLL). UNROLL is the plan's most
partials a row, as a power of two up to 8 (`unroll_for`): most shared-prefix steps have 2 a
row (one wide split and the tail), and a chunk of 8 spent its time on the 6 masked slots -- on
an H200 the Hydragen rows' steps 1-4.5% shorter at 2 (b1024 x 2K shared keys 216 -> 207 us,
issue 25 part twenty-one). A chunk's loads are all issued before its arithmetic, so a row
costs one chain of dependent loads (part indices, then lse and o) a chunk, not a partial: on
an H100, Table 3's all-shared steps 1.5-2 us shorter than the one-partial-a-time loop, where
the merge follows the attend launch. A chunk folds into the running (m, denom, acc) with its
maximum taken first, so that no exponential waits on a partial's o; its partials stay
separate registers (a [UNROLL, BLOCK_H, D] tile summed over its first axis ran 1.3-4x slower
on an H200: the sum crosses warps):

    m' = max(m, max_i lse_i);  acc = acc e^(m - m') + sum_i e^(lse_i - m') o_i;  denom likewise
    o = acc / denom,  lse = m' + ln denom;  no finite partial: (0, -inf)
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .configs import next_pow2

UNROLL = 8  # partials a chunk at most (each of Table 3's rows has at most 5)


def unroll_for(row_indptr: np.ndarray | None) -> int:
    """Partials a chunk for rows with these CSR bounds ([rows + 1]; None: a plan with no
    merge): the most a row has, as a power of two in [2, UNROLL]; UNROLL where there are no
    rows. (A graph's plan takes UNROLL instead: `kernels.TritonKernels.plan_extra`.)"""
    if row_indptr is None or len(row_indptr) < 2:
        return UNROLL
    return min(UNROLL, next_pow2(max(2, int(np.diff(row_indptr).max()))))


@triton.jit
def _part_indices(parts, base, end, UNROLL: tl.constexpr):
    """The part indices parts[base : base + UNROLL] as a tuple of int64 scalars (0 past end)."""
    ps = ()
    for j in tl.static_range(UNROLL):
        p = tl.load(parts + base + j, mask=base + j < end, other=0).to(tl.int64)
        ps = ps + (p,)  # type: ignore[assignment]  # a tuple grown in a static loop
    return ps


@triton.jit
def _fold_chunk(m, denom, acc, ps, base, end, o_parts, lse_parts, stride_pt, stride_ph, stride_lp,
                hs, d, h_ok, d_ok, UNROLL: tl.constexpr):
    """Fold partials ps (slots base.. of the row; those at or past end weigh 0) into the running
    (m [BLOCK_H], denom [BLOCK_H], acc [BLOCK_H, BLOCK_D]): every load, then the chunk's maximum,
    then the sums (folded one partial at a time, ptxas issued the later partials' o loads after
    the first exponential, which waits on a round trip)."""
    lses = ()
    outs = ()
    for j in tl.static_range(UNROLL):
        ok = h_ok & (tl.zeros_like(hs) + base + j < end)  # [BLOCK_H]: the interpreter's & takes no scalar
        lse_j = tl.load(lse_parts + ps[j] * stride_lp + hs, mask=ok, other=float("-inf"))
        o_j = tl.load(o_parts + ps[j] * stride_pt + hs[:, None] * stride_ph + d[None, :],
                      mask=ok[:, None] & d_ok[None, :], other=0.0)
        lses = lses + (lse_j,)  # type: ignore[assignment]  # a tuple grown in a static loop
        outs = outs + (o_j,)  # type: ignore[assignment]
    m_new = m
    for j in tl.static_range(UNROLL):
        m_new = tl.maximum(m_new, lses[j])
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    acc = acc * alpha[:, None]
    denom = denom * alpha
    for j in tl.static_range(UNROLL):
        w = tl.exp(lses[j] - m_safe)
        acc += w[:, None] * outs[j]
        denom += w
    return m_new, denom, acc


@triton.jit
def _merge_kernel(o_parts, lse_parts, indptr, parts, o, lse,
                  stride_pt, stride_ph, stride_lp, stride_ot, stride_oh, stride_lt, num_heads,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  WRITE_LSE: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr):
    r = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = hs < num_heads
    d_ok = d < HEAD_DIM
    start = tl.load(indptr + r)
    end = tl.load(indptr + r + 1)
    first = _part_indices(parts, start, end, UNROLL)  # the plan's, not the partials' writer's
    if PDL:  # started beside the launch that writes the partials: they are visible past this
        gdc_wait()
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m, denom, acc = _fold_chunk(m, denom, acc, first, start, end, o_parts, lse_parts, stride_pt,
                                stride_ph, stride_lp, hs, d, h_ok, d_ok, UNROLL)
    for base in range(start + UNROLL, end, UNROLL):
        ps = _part_indices(parts, base, end, UNROLL)
        m, denom, acc = _fold_chunk(m, denom, acc, ps, base, end, o_parts, lse_parts, stride_pt,
                                    stride_ph, stride_lp, hs, d, h_ok, d_ok, UNROLL)
    seen = denom > 0.0
    out = acc / tl.where(seen, denom, 1.0)[:, None]
    tl.store(o + r.to(tl.int64) * stride_ot + hs[:, None] * stride_oh + d[None, :],
             out.to(o.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse_r = tl.where(seen, m + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
        tl.store(lse + r.to(tl.int64) * stride_lt + hs, lse_r, mask=h_ok)


def merge_rows(o_parts: torch.Tensor, lse_parts: torch.Tensor, row_indptr: torch.Tensor,
               row_parts: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
               pdl: bool = False, unroll: int = UNROLL) -> None:
    """Merge into o [T, Hq, D] (any float dtype) and, unless None, lse [T, Hq] fp32, `unroll`
    partials a chunk (a power of two: `unroll_for`). pdl
    (CUDA): launched as a programmatic dependent of the launch before it, which triggers it
    (the attend launch, `launch_worklist`): its programs start beside that launch's and wait
    for its end before reading the partials (on an H200, Table 3's all-shared rows ~1 us
    sooner)."""
    num_rows = row_indptr.numel() - 1
    hq, d = o_parts.shape[1:]
    assert o_parts.dtype == lse_parts.dtype == torch.float32 and lse_parts.shape == o_parts.shape[:2]
    assert o_parts.stride(-1) == 1 and o.stride(-1) == 1 and o.shape == (num_rows, hq, d)
    assert row_indptr.dtype == row_parts.dtype == torch.int32
    assert lse is None or (lse.dtype == torch.float32 and lse.shape == (num_rows, hq))
    assert lse_parts.stride(-1) == 1 and (lse is None or lse.stride(-1) == 1)
    assert 1 <= unroll <= UNROLL and unroll & (unroll - 1) == 0, unroll
    if num_rows == 0:
        return
    block_d = next_pow2(d)
    # ~512 elements a program: many programs, each a short chain of partial loads. On an H200
    # (D 128) 4 heads a program took 1-2 us less than 8 on Table 3's merges, as fast at b1024
    block_h = min(next_pow2(hq), max(1, 512 // block_d))
    grid = (num_rows, triton.cdiv(hq, block_h))
    _merge_kernel[grid](
        o_parts, lse_parts, row_indptr, row_parts, o, o if lse is None else lse,
        o_parts.stride(0), o_parts.stride(1), lse_parts.stride(0), o.stride(0), o.stride(1),
        0 if lse is None else lse.stride(0), hq, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d,
        WRITE_LSE=lse is not None, PDL=pdl, UNROLL=unroll, **({"launch_pdl": True} if pdl else {}))


def merge_partials(o_parts: torch.Tensor, lse_parts: torch.Tensor, row_indptr: torch.Tensor,
                   row_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `ops.reference.merge_partials`: o_parts [P, Hq, D] fp32, lse_parts [P, Hq] fp32,
    row_indptr [T+1] int32, row_parts [M] int32 -> o [T, Hq, D] fp32, lse [T, Hq] fp32."""
    num_rows = row_indptr.numel() - 1
    o = torch.empty((num_rows, *o_parts.shape[1:]), dtype=torch.float32, device=o_parts.device)
    lse = torch.empty((num_rows, o_parts.shape[1]), dtype=torch.float32, device=o_parts.device)
    merge_rows(o_parts, lse_parts, row_indptr, row_parts, o, lse)
    return o, lse
