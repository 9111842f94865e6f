"""Triton twin of `linear_reference.linear`: y = x W^T (+ b) whose rows do not depend on how
many rows there are (deterministic mode's GEMM).

Program (tile m, tile n) walks K from 0 in steps of BLOCK_K, `acc = dot(x_tile, w_tile^T, acc)`,
fp32 accumulators, then adds the bias and rounds once to the dtype (to nearest even, `fused.triton._round`):

    y[r, n] = round(bias[n] + (((0 + x[r, 0:BK] . w[n, 0:BK]) + x[r, BK:2BK] . w[n, BK:2BK]) + ...))

No split-K and no stream-K: an element's sum is one chain over K in one program, so its bits
depend on K's order only, never on M -- which cuBLAS does not promise (its split-K and tile
choices follow M). On sm_90 the matrix instructions add each k16 slice into the accumulator
the same way whatever the tile's shape (wgmma or mma.sync, any BLOCK_M / BLOCK_N, BLOCK_K 64
or 128 over a K they divide: measured by `prefixserve bench gemm`, which checks every shape it
may pick), so there the launch shape follows M for speed (`config`); BLOCK_K is the same for
every M wherever it would leave a K tail (a masked last block: BLOCK_K is then a function of K
alone). Elsewhere one shape serves every M.

Masked rows and K tails load 0 and add exact zeros, so padding changes no bit. In fp32 the
products are IEEE (no TF32): tests run fp32 and bf16.

cuBLAS where it computes the same bits. At large M cuBLAS splits no K either, and its kernels
then sum in this kernel's order (on an H100, every Llama-2-7B layer shape from M = 176 rows up:
`bench gemm`, `cublas_identical_rows`), ~1.35x faster than this kernel. It is used only where
that was checked, here and now: rows padded up to a multiple of 64 (so a shape is one of few),
the first call per (shape, padded rows) runs both on random inputs and keeps cuBLAS iff every
bit agrees; anything else, and anything first seen inside a CUDA-graph capture (which cannot
wait for the check), runs this kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import nn

from .triton import _round


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # tiles of M per L2 group (programs of a group share W's column tiles)


@triton.jit
def _linear_kernel(x, w, b, y, M, N, K, stride_x, stride_w, stride_y, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # grouped order: GROUP_M row tiles run next to each other over the same column tiles
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptr = x + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptr = w + rn[None, :].to(tl.int64) * stride_w + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(x_ptr + k0, mask=(rm < M)[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(w_ptr + k0, mask=k_ok[:, None] & (rn < N)[None, :], other=0.0)
        if DOT_FP32:
            a, bt = a.to(tl.float32), bt.to(tl.float32)
        acc = tl.dot(a, bt, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_ptr = y + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    tl.store(y_ptr, _round(acc, y.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


# Launch shapes by rows (sm_90, 16-bit): every one is wgmma (BLOCK_M >= 64, 4 or 8 warps), so all
# give the same bits (see the module docstring); which one runs is a matter of speed only,
# from `prefixserve bench gemm` on an H100 (benchmarks/results/gemm-*.json).
_SM90_SHAPES = ((64, GemmConfig(64, 64, 128, 4, 4)),
                (256, GemmConfig(64, 128, 64, 4, 4)),
                (1 << 62, GemmConfig(128, 256, 64, 8, 3)))
_FIXED = GemmConfig(64, 64, 64, 4, 3)  # every M, on other GPUs and in the interpreter


def config(m: int, k: int, x: torch.Tensor) -> GemmConfig:
    """The launch shape for M = m rows, K = k, of x's dtype on x's device (see `_SM90_SHAPES`)."""
    if not (x.is_cuda and x.element_size() == 2 and _sm90(x.device.index or 0)):
        return _FIXED
    c = next(c for rows, c in _SM90_SHAPES if m <= rows)
    if k % 128:  # one K loop for every M: the largest BLOCK_K <= 64 that divides K, else 16
        c = dataclasses.replace(c, block_k=next((b for b in (64, 32) if k % b == 0), 16))
    return c


CUBLAS_MIN_ROWS, CUBLAS_ROW_STEP = 256, 64
_cublas_same: dict[tuple[object, ...], bool] = {}  # (device, dtype, n, k, padded rows, bias) -> checked


def _cublas_rows(m: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    """The padded row count at which cuBLAS gives this kernel's bits for x W^T + b, or None."""
    if m < CUBLAS_MIN_ROWS or not (x.is_cuda and x.element_size() == 2 and _sm90(x.device.index or 0)):
        return None
    rows = -(-m // CUBLAS_ROW_STEP) * CUBLAS_ROW_STEP
    key = (x.device, x.dtype, *weight.shape, rows, bias is not None)
    if key not in _cublas_same:
        if torch.cuda.is_current_stream_capturing():
            return None
        gen = torch.Generator(device=x.device).manual_seed(rows)
        probe = torch.randn(rows, weight.shape[1], generator=gen, device=x.device, dtype=x.dtype)
        _cublas_same[key] = torch.equal(nn.functional.linear(probe, weight, bias),
                                        _launch(probe, weight, bias, config(rows, weight.shape[1], x)))
    return rows if _cublas_same[key] else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           cfg: GemmConfig | None = None) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype; weight: [N, K] (nn.Linear's); bias: [N] or None.
    cfg: a launch shape (benchmarks sweep them); None: `config`."""
    *lead, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.shape, x.dtype)
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    rows = None if cfg else _cublas_rows(m, x2, weight, bias)
    if rows is not None:  # cuBLAS, checked to agree at this shape (module docstring), on an
        # operand laid out as the check's was: contiguous and aligned as an allocation
        if m != rows or not x2.is_contiguous() or x2.data_ptr() % 256:
            padded = x2.new_zeros((rows, k))
            padded[:m] = x2
            x2 = padded
        return nn.functional.linear(x2, weight, bias)[:m].reshape(*lead, n)
    return _launch(x2, weight, bias, cfg or config(m, k, x)).reshape(*lead, n)


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, c: GemmConfig) -> torch.Tensor:
    """The kernel on x2 [M, K] (row stride any, last dim contiguous) -> [M, N]."""
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _linear_kernel[grid](x2, weight, weight if bias is None else bias, y, m, n, k, x2.stride(0),
                         weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                         BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                         PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
                         # the interpreter multiplies raw bf16 bits in tl.dot: upcast there (exact)
                         DOT_FP32=x2.device.type == "cpu" and x2.dtype == torch.bfloat16,
                         num_warps=c.num_warps, num_stages=c.num_stages)
    return y
