"""Deterministic mode's GEMM: y = x W^T (+ b) whose every row has the same bits however many
rows are computed with it, dispatched by device: CUDA runs the Triton kernel (`linear_triton`,
imported on first use), other devices the fixed-block twin (`linear_reference`).

    invariant_linear(x, weight, bias=None) -> y        x: [..., K]; weight: [N, K] -> y: [..., N]

Bits agree between calls on one device, not between the two devices.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from . import linear_reference


@functools.cache
def _kernels() -> ModuleType:
    from . import linear_triton
    return linear_triton


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    ops = _kernels() if x.is_cuda else linear_reference
    return ops.linear(x, weight, bias)
