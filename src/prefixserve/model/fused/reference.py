"""PyTorch twins of the fused kernels: the CPU path, and the oracle the kernels are tested against.

This is the decoder's elementwise arithmetic exactly as it ran before the kernels existed
(op for op HF transformers' Llama, which the exactness tests compare greedy tokens with), so not
one result bit changes on CPU. A torch op on fp16/bf16 tensors computes in fp32 and rounds its
result to the dtype; those rounding points are the ones the Triton twins reproduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H]; weight: [H] in x's dtype -> [T, H] in x's dtype.

    x * rsqrt(mean(x^2) + eps) in fp32, rounded to the dtype, then times weight (rounded again).
    """
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H]; weight: [H] -> x * rsqrt(mean(x^2) + eps) * (1 + weight), all in fp32, rounded
    once to x's dtype (Gemma's norm, op for op HF's Gemma3RMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> (rms_norm(x + residual), x + residual), both [T, H].

    The sum is rounded to the dtype (it is the residual stream, `h = h + layer(h)` of the
    unfused decoder: addition commutes exactly, so the operand order does not matter).
    """
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int; inv_freq: [D/2] -> cos, sin: [T, 1, D] in `dtype`.

    Angles positions * inv_freq in fp32, each repeated for both halves of a head.
    """
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(dtype)
    sin = (emb.sin() * scaling).to(dtype)
    return cos[:, None, :], sin[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] -> x * cos + rotate_half(x) * sin, [T, H, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, scaling: float) -> None:
    """Rotary embedding of q: [T, Hq, D] and k: [T, Hkv, D] (views of any strides), in place.

    positions: [T] int; inv_freq: [D/2] (read as fp32); scaling: the rotary's attention scaling.
    """
    cos, sin = rotary_cos_sin(positions, inv_freq, scaling, q.dtype)
    q.copy_(rotate(q, cos, sin))
    k.copy_(rotate(k, cos, sin))


def silu_mul(gate_up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """gate_up: [T, 2I] (gate, then up) -> silu(gate) * up: [T, I], each op rounded to the dtype.
    invariant: each row's bits independent of the other rows (`rowwise`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(nn.functional.silu, gate, invariant) * up


# At most this many elements, torch's CPU elementwise kernels run on one thread (larger runs are
# split between threads at element counts: at::internal::GRAIN_SIZE is 32768, GELU's own 16384).
_ONE_THREAD = 16384


def activation(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               invariant: bool) -> torch.Tensor:
    """fn(x) for an elementwise `fn` of x: [T, W]; invariant: row by row (`rowwise`)."""
    return rowwise(fn, x) if invariant else fn(x)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise `fn` of x: [T, W] (last dim contiguous), every row's bits
    independent of the other rows (deterministic mode). torch's CPU kernels compute whole SIMD
    vectors, then the leftover elements with scalar code, and split work between threads at
    element counts; their vector exp and tanh do not always round as the scalar ones, so an
    element's bits depend on where its row falls in the run. Here each row is a run of its own,
    as when it is alone ([1, W]): rows of a view that torch cannot merge into one run (a row
    stride other than W), in blocks that stay on one thread."""
    t, w = x.shape
    if t > 1 and x.stride(0) == w:
        padded = x.new_empty(t, w + 1)
        padded[:, :w] = x
        x = padded[:, :w]
    rows = max(1, _ONE_THREAD // w)
    return fn(x) if t <= rows else torch.cat([fn(x[i:i + rows]) for i in range(0, t, rows)])
