"""PyTorch twin of the MoE kernels (`moe_triton`): the CPU path and the oracle they are tested
against; the loop over experts of HF transformers' Qwen3-MoE, with the same rounding points."""

from __future__ import annotations

import torch
from torch import nn

from . import linear_reference
from .reference import activation


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights, topk_ids: [T, K]
    -> y: [T*K, H] in x's dtype, row t*K + k = weight * down(silu(gate) * up) of token t under
    expert topk_ids[t, k]; each expert runs once, on all its tokens (one product per matrix;
    invariant: in fixed row blocks, so a row's bits do not depend on the expert's other tokens)."""
    linear = linear_reference.linear if invariant else nn.functional.linear
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    y = x.new_empty((flat.numel(), x.shape[1]))
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        gate, up = linear(x[pairs // k], w13[e]).chunk(2, dim=-1)
        h = activation(nn.functional.silu, gate, invariant) * up
        y[pairs] = linear(h, w2[e]) * topk_weights.reshape(-1)[pairs, None]
    return y
