"""The decoder's fused elementwise ops, dispatched by device: CUDA tensors run the Triton
kernels (`fused.triton`, imported on first use, so this package imports without triton),
all others their PyTorch twins (`fused.reference`: the CPU path, op for op HF transformers).

    rms_norm(x, weight, eps) -> out                       x: [T, H]
    add_rms_norm(x, residual, weight, eps) -> (out, x + residual)
    apply_rotary_(q, k, positions, inv_freq, scaling)     q, k: [T, Hq|Hkv, D], in place
    silu_mul(gate_up) -> silu(gate) * up                  gate_up: [T, 2I]
"""

from __future__ import annotations

import functools
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


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _ops_for(gate_up).silu_mul(gate_up)
