"""`store_kv` on the GPU: scatter this step's new K/V rows into their cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import FP8, K_INV, K_SCALE, V_INV, V_SCALE
from .configs import next_pow2

# kv_scale's rows (reference.K_SCALE ...), as constants the kernels may read
K_SCALE_ROW: tl.constexpr = tl.constexpr(K_SCALE)
V_SCALE_ROW: tl.constexpr = tl.constexpr(V_SCALE)
K_INV_ROW: tl.constexpr = tl.constexpr(K_INV)
V_INV_ROW: tl.constexpr = tl.constexpr(V_INV)


@triton.jit
def quantize_fp8(x, inv):
    """x (any float) -> e4m3 of x * inv (fp32), saturated at +-448: `reference.quantize`,
    bit for bit. The value is rounded to e4m3's grid (nearest, ties to even) in fp32 first, so
    that the cast itself is exact: Triton's interpreter casts ties away from zero (triton 3.9),
    compiled code and torch to even."""
    y = tl.clamp(x.to(tl.float32) * inv, -448.0, 448.0)
    bits = y.to(tl.int32, bitcast=True)
    # normal (|y| >= 2^-6): keep 3 mantissa bits; the carry may run into the exponent
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # & 0xFFF00000
    # subnormal: multiples of 2^-9, rounded by an fp32 add at 1.5 x 2^14 (ulp 2^-9); y's sign
    # kept (-0 when a negative y rounds to zero, as torch gives)
    sub = ((y + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -0x80000000)
    y = tl.where((bits & 0x7FFFFFFF) >= 0x3C800000, normal, sub).to(tl.float32, bitcast=True)
    return y.to(tl.float8e4nv)


@triton.jit
def fp8_query(qt, scale_log2, BF16: tl.constexpr):
    """(q tile, score scale) for products over an fp8 cache, which run in fp16: e4m3 widens to
    fp16 in one instruction, to bf16 (sm_90) through fp32 (H200, bf16, paged decode of 32 x
    4,096 keys: 641 us widening to bf16, 337 to fp16). A bf16 tile becomes fp16 x 2^-8 (exact
    for |q| in 2^-6 .. 2^24) and the scale x 2^8 (BF16: qt is bf16); fp16 and fp32 tiles stay."""
    if BF16:
        qt = (qt.to(tl.float32) * 0.00390625).to(tl.float16)
        scale_log2 = scale_log2 * 256.0
    return qt, scale_log2


@triton.jit
def _store_kv_kernel(k_cache, v_cache, k, v, slots, kv_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_CACHE: tl.constexpr):
    # One program per new token t: copies k[t], v[t] ([HKV, HEAD_DIM], any row/head strides)
    # to the contiguous cache row slots[t] ([HKV * HEAD_DIM] elements), casting to the cache's
    # dtype (FP8_CACHE: quantized with the heads' inverse scales, kv_scale rows K_INV, V_INV).
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < HEAD_DIM)
    dst = slot * (HKV * HEAD_DIM) + h * HEAD_DIM + d
    kt = tl.load(k + t * stride_kt + h * stride_kh + d, mask=mask)
    vt = tl.load(v + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8_CACHE:
        kt = quantize_fp8(kt, tl.load(kv_scale + K_INV_ROW * HKV + h, mask=h < HKV, other=1.0))
        vt = quantize_fp8(vt, tl.load(kv_scale + V_INV_ROW * HKV + h, mask=h < HKV, other=1.0))
    tl.store(k_cache + dst, kt.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, vt.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Twin of `ops.reference.store_kv`: k_cache, v_cache [N, C, Hkv, D] contiguous;
    k, v [T, Hkv, D] (last dim contiguous); slots [T] int64 flat slots chunk * C + offset;
    kv_scale [4, Hkv] fp32 for an fp8 cache."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and k.shape == v.shape
    assert k.shape[1:] == k_cache.shape[2:] and slots.shape == k.shape[:1], (k.shape, slots.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and slots.dtype == torch.int64
    assert k.device == k_cache.device == slots.device
    fp8 = k_cache.dtype == FP8
    assert fp8 == (kv_scale is not None), "an fp8 cache, and only it, has scales"
    num_tokens, hkv, d = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, slots, slots if kv_scale is None else kv_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HKV=hkv, HEAD_DIM=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), FP8_CACHE=fp8)
