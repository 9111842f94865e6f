"""`store_kv` on the GPU: scatter this step's new K/V rows into their cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .worklist import next_pow2


@triton.jit
def _store_kv_kernel(k_cache, v_cache, k, v, slots,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per new token t: copies k[t], v[t] ([HKV, HEAD_DIM], any row/head strides)
    # to the contiguous cache row slots[t] ([HKV * HEAD_DIM] elements), casting to the cache's dtype.
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < HEAD_DIM)
    dst = slot * (HKV * HEAD_DIM) + h * HEAD_DIM + d
    kt = tl.load(k + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache + dst, kt.to(k_cache.dtype.element_ty), mask=mask)
    vt = tl.load(v + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache + dst, vt.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Twin of `ops.reference.store_kv`: k_cache, v_cache [N, C, Hkv, D] contiguous;
    k, v [T, Hkv, D] (last dim contiguous); slots [T] int64 flat slots chunk * C + offset."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape == v_cache.shape and k.shape == v.shape
    assert k.shape[1:] == k_cache.shape[2:] and slots.shape == k.shape[:1], (k.shape, slots.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and slots.dtype == torch.int64
    assert k.device == k_cache.device == slots.device
    num_tokens, hkv, d = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HKV=hkv, HEAD_DIM=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d))
