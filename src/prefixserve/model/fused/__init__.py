"""The decoder's fused elementwise ops, dispatched by device: CUDA tensors run the Triton
kernels (`fused.triton`, imported on first use, so this package imports without triton),
all others their PyTorch twins (`fused.reference`: the CPU path, op for op HF transformers).

    rms_norm(x, weight, eps) -> out                       x: [T, H]
    gemma_rms_norm(x, weight, eps) -> out                 x: [T, H], the (1 + weight) norm
    add_rms_norm(x, residual, weight, eps) -> (out, x + residual)
    apply_rotary_(q, k, positions, inv_freq, scaling)     q, k: [T, Hq|Hkv, D], in place
    silu_mul(gate_up, invariant) -> silu(gate) * up       gate_up: [T, 2I]
    elementwise(fn, x, invariant) -> fn(x)                x: [T, W]; fn a torch activation

invariant (deterministic mode): every row's bits independent of the other rows. The kernels
are (one program per row, the same code for every element); on the CPU, torch's vector and
scalar code for exp and tanh may differ in the last bit, so the twins run each row alone
(`reference.rowwise`). Norms are per-row reductions on both paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from . import reference


@functools.cache
def _kernels() -> ModuleType:
    from . import triton
    return triton


def _ops_for(x: torch.Tensor) -> ModuleType:
    return _kernels() if x.is_cuda else reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops_for(x).rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _ops_for(x).add_rms_norm(x, residual, weight, eps)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, scaling: float) -> None:
    _ops_for(q).apply_rotary_(q, k, positions, inv_freq, scaling)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops_for(x).gemma_rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    return _ops_for(gate_up).silu_mul(gate_up, invariant)


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                invariant: bool) -> torch.Tensor:
    """fn(x); on the CPU with `invariant`, row by row (`reference.rowwise`). CUDA runs every
    element with the same code."""
    return reference.activation(fn, x, invariant and not x.is_cuda)
