"""Triton twins of `fused.reference` (same signatures): the decoder's elementwise ops on the GPU.

Each kernel reproduces its twin's rounding points: values are loaded as fp32, and wherever the
twin's torch op rounds to the model dtype the kernel rounds with `_round` (round to nearest
even, as torch's casts do). What can still differ from torch, and only by rounding: the order
of the sum in RMSNorm's mean (and on CUDA torch's mean and rsqrt, which are not correctly
rounded) and the transcendental functions: compiled, cos, sin and exp are libdevice's, as in
torch's CUDA kernels (bit-identical on an H100 and an H200); interpreted, numpy's.

All launches are CUDA-graph safe: grids and constexprs come from shapes only, nothing is read
back to the host. They pass enable_fp_fusion=False: in fp32 the roundings are no-ops, and a
fused multiply-add would round `a * b + c` once where torch rounds twice.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# as triton.jit decides it: kernels defined while TRITON_INTERPRET is set run in the interpreter
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even. bf16 by bit arithmetic: equal to compiled Triton's
    cvt.rn for every non-NaN input, while the interpreter's cast truncates (triton 3.9), so the
    CPU tests check bf16 rounding too. NaNs are truncated, which keeps them NaN."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += tl.where(x == x, 0x7FFF + ((bits >> 16) & 1), 0)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE, as fp32 again (what the next torch op computes with)."""
    return _round(x, DTYPE).to(tl.float32)


@triton.jit
def _exp(x):
    """fp32 exp: libdevice's expf, the one torch's CUDA ops call (tl.exp compiles to
    ex2.approx.f32: up to 16 ulp off, measured on an H100); tl.exp in the interpreter, which
    has no libdevice."""
    if _INTERPRETED:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


def _num_warps(block: int) -> int:
    """About 8 elements per thread for a program over `block` elements, 1 to 16 warps."""
    return min(max(block // 256, 1), 16)


@triton.jit
def _rms_norm_kernel(out, new_residual, x, residual, weight, stride_x, stride_r, stride_o,
                     stride_n, eps, H: tl.constexpr, BLOCK_H: tl.constexpr, ADD: tl.constexpr,
                     GEMMA: tl.constexpr):
    # One program per row t. v = x[t], or with ADD v = x[t] + residual[t] rounded (and stored);
    # out[t] = weight * round(v * 1 / sqrt(sum(v^2) / H + eps)), the division and the square
    # root correctly rounded as torch's CPU mean and rsqrt are; GEMMA: out[t] =
    # round(v * 1 / sqrt(...) * (1 + weight)), all in fp32.
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    mask = h < H
    dtype = out.dtype.element_ty
    v = tl.load(x + t * stride_x + h, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        v += tl.load(residual + t * stride_r + h, mask=mask, other=0.0).to(tl.float32)
        v = _rounded(v, dtype)
        tl.store(new_residual + t * stride_n + h, v.to(dtype), mask=mask)
    mean_sq = tl.math.div_rn(tl.sum(v * v, axis=0), H)
    inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    w = tl.load(weight + h, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        y = _round((v * inv_rms) * (1.0 + w), dtype)
    else:
        y = _round(w * _rounded(v * inv_rms, dtype), dtype)
    tl.store(out + t * stride_o + h, y, mask=mask)


def _launch_rms_norm(x, residual, weight, eps, out, new_residual, gemma: bool = False) -> None:
    """x, residual, out, new_residual: [T, H]; weight: [H]. residual None: no add. gemma: the
    (1 + weight) norm, whose weight may be of any float dtype."""
    num_tokens, hidden = x.shape
    assert x.dtype in _DTYPES and (gemma or weight.dtype == x.dtype) and weight.shape == (hidden,)
    assert x.stride(-1) == 1 and weight.is_contiguous() and x.device == weight.device
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1 and residual.device == x.device
    if num_tokens == 0:
        return
    add = residual is not None
    residual, new_residual = (residual, new_residual) if add else (x, out)  # unread if not add
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        out, new_residual, x, residual, weight, x.stride(0), residual.stride(0), out.stride(0),
        new_residual.stride(0), eps, H=hidden, BLOCK_H=block, ADD=add, GEMMA=gemma,
        num_warps=_num_warps(block), enable_fp_fusion=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin of `reference.rms_norm`: x [T, H] (last dim contiguous), weight [H] -> [T, H]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None)
    return out


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Twin of `reference.gemma_rms_norm`: x [T, H] (last dim contiguous), weight [H] -> [T, H]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None, gemma=True)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `reference.add_rms_norm`: x, residual [T, H] -> (out, x + residual) [T, H]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(out)
    _launch_rms_norm(x, residual, weight, eps, out, new_residual)
    return out, new_residual


@triton.jit
def _rotate_heads(x, stride_h, cos, sin, H: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # x: one token's [H, 2 * HALF] heads; cos, sin: [1, BLOCK_HALF] fp32 values of the dtype.
    # With halves (x1, x2): x * cos + rotate_half(x) * sin = (x1 cos - x2 sin, x2 cos + x1 sin),
    # every product and sum rounded as torch rounds it (round(-a) = -round(a), so the
    # subtraction equals torch's addition of the negated half).
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < H) & (j < HALF)
    lo = x + h * stride_h + j
    hi = lo + HALF
    dtype = x.dtype.element_ty
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(hi, mask=mask, other=0.0).to(tl.float32)
    out1 = _rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype)
    out2 = _rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype)
    tl.store(lo, _round(out1, dtype), mask=mask)
    tl.store(hi, _round(out2, dtype), mask=mask)


@triton.jit
def _rotary_kernel(q, k, positions, inv_freq, stride_qt, stride_qh, stride_kt, stride_kh,
                   scaling, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One program per token t: its HALF angles once (fp32 position * fp32 inv_freq, as torch's
    # outer product), cos/sin * scaling rounded to the dtype, then all heads of q[t] and k[t].
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    freq = tl.load(inv_freq + j, mask=j < HALF, other=0.0).to(tl.float32)
    freq = tl.load(positions + t).to(tl.float32) * freq
    dtype = q.dtype.element_ty
    cos = _rounded(tl.cos(freq) * scaling, dtype)[None, :]
    sin = _rounded(tl.sin(freq) * scaling, dtype)[None, :]
    _rotate_heads(q + t * stride_qt, stride_qh, cos, sin, HQ, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k + t * stride_kt, stride_kh, cos, sin, HKV, HALF, BLOCK_HKV, BLOCK_HALF)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, scaling: float) -> None:
    """Twin of `reference.apply_rotary_`, one launch for q and k: q [T, Hq, D], k [T, Hkv, D]
    (any token/head strides, last dim contiguous, e.g. views of one qkv tensor), in place;
    positions [T] int32/int64; inv_freq [D/2] (any float dtype, read as fp32)."""
    (num_tokens, hq, d), hkv = q.shape, k.shape[1]
    assert k.shape == (num_tokens, hkv, d) and d % 2 == 0 and inv_freq.shape == (d // 2,)
    assert q.dtype == k.dtype and q.dtype in _DTYPES and inv_freq.is_floating_point()
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and inv_freq.is_contiguous()
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64)
    assert q.device == k.device == positions.device == inv_freq.device
    if num_tokens == 0:
        return
    block_hq, block_hkv, block_half = (triton.next_power_of_2(n) for n in (hq, hkv, d // 2))
    _rotary_kernel[(num_tokens,)](
        q, k, positions, inv_freq, q.stride(0), q.stride(1), k.stride(0), k.stride(1), scaling,
        HQ=hq, HKV=hkv, HALF=d // 2, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv,
        BLOCK_HALF=block_half, num_warps=_num_warps(block_hq * block_half),
        enable_fp_fusion=False)


@triton.jit
def _silu_mul_kernel(out, gate_up, stride_g, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    # Program (t, b): columns [b * BLOCK, (b + 1) * BLOCK) of row t. silu(g) = g / (1 + exp(-g))
    # in fp32 (correctly rounded division, as torch's), rounded; then times up, rounded.
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < INTER
    dtype = out.dtype.element_ty
    g = tl.load(gate_up + t * stride_g + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + t * stride_g + INTER + i, mask=mask, other=0.0).to(tl.float32)
    silu = _rounded(tl.math.div_rn(g, 1.0 + _exp(-g)), dtype)
    tl.store(out + t * stride_o + i, _round(silu * up, dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """Twin of `reference.silu_mul`: gate_up [T, 2I] (last dim contiguous) -> [T, I]. Every
    row is computed alike whatever the batch (invariant either way)."""
    num_tokens, width = gate_up.shape
    assert width % 2 == 0 and gate_up.dtype in _DTYPES and gate_up.stride(-1) == 1
    size = width // 2
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(size), 1024)
    _silu_mul_kernel[(num_tokens, triton.cdiv(size, block))](
        out, gate_up, gate_up.stride(0), out.stride(0), INTER=size, BLOCK=block,
        num_warps=_num_warps(block), enable_fp_fusion=False)
    return out
