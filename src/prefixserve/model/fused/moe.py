"""The fused MoE op: every token's top-k experts' gated MLPs, weighted and summed, in one call.

    fused_moe(x, w13, w2, topk_weights, topk_ids) -> out              x, out: [T, H]
        w13: [E, 2I, H] (each expert's gate rows, then up rows); w2: [E, H, I]
        topk_weights: [T, K] in x's dtype; topk_ids: [T, K] int (distinct per token)

It is HF transformers' Qwen3-MoE expert loop, op for op: per expert e and each (token, slot)
routed to it, y = (silu(x W_gate^T) * (x W_up^T)) W_down^T * weight, each op rounded to the
dtype; then out[t] = the sum of token t's K results in ascending expert order, rounded after
each add (HF's index_add_ in expert order, from zero).

The two grouped GEMMs (`expert_outputs`: [T*K, H], one row per (token, slot) pair) are what
the device picks: CUDA runs the Triton kernels of `moe_triton` (one launch each over the
pairs sorted by expert, `moe_triton.align_pairs`); other devices the PyTorch twin in `moe_reference`.
The routing and the final ordered sum are shared torch ops.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from . import moe_reference


@functools.cache
def _kernels() -> ModuleType:
    from . import moe_triton
    return moe_triton


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] in the logits' dtype, expert ids [T, K] int64):
    softmax in fp32, top-k, optionally renormalized to sum to 1 (Qwen3-MoE's norm_topk_prob)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """-> y: [T*K, H], row t*K + k: token t's weighted output of expert topk_ids[t, k].
    invariant: each row's bits independent of the other tokens (deterministic mode). The
    kernels' sums run over the hidden dimension in one order whatever the block of pairs (on
    sm_90 the tile shape changes no bit: `prefixserve bench gemm`); the twin then runs its
    products in fixed row blocks (`linear_reference`)."""
    if x.is_cuda:
        return _kernels().expert_outputs(x, w13, w2, topk_weights, topk_ids)
    return moe_reference.expert_outputs(x, w13, w2, topk_weights, topk_ids, invariant)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    y = expert_outputs(x, w13, w2, topk_weights, topk_ids, invariant)
    return sum_in_expert_order(y, topk_ids)


def sum_in_expert_order(y: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """y: [T*K, H], topk_ids: [T, K] -> [T, H]: each token's K rows summed by ascending expert
    id, rounded to the dtype after each add (0 + a == a exactly, so the first add is free)."""
    t, k = topk_ids.shape
    order = topk_ids.argsort(dim=1)  # distinct ids: no ties
    rows = y.view(t, k, -1).gather(1, order[..., None].expand(-1, -1, y.shape[-1]))
    out = rows[:, 0]
    for j in range(1, k):
        out = out + rows[:, j]
    return out.contiguous()

