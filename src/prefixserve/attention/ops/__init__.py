"""Attention ops: `reference` (PyTorch, the CPU path and test oracle); `triton` (GPU twins).

A scheduled backend runs its plans through one executor, picked once by device in
`kernels_for`: `triton.TritonKernels` on CUDA, `ReferenceKernels` elsewhere. Both compute the
same function from the same plan; an executor has

    plan_extra(batch, arrays) -> extra plan arrays/ints (kept in `DevicePlan.extra`)
    generation                -> bumped when what a captured CUDA graph holds changes
    run(q, k, v, k_cache, v_cache, plan, scale, window=None) -> o [T, Hq, D] in q's dtype,
                                 after writing the new k, v [T, Hkv, D] at plan.slots; window:
                                 a sliding layer's (see `reference`)
"""

from __future__ import annotations

import torch

from . import reference


class ReferenceKernels:
    """The PyTorch ops: store_kv, attend_items, then merge_partials if the schedule merges,
    then a cast."""

    generation = 0  # no buffers of its own (see AttentionBackend.generation)

    def __init__(self, shape):
        self.shape = shape

    def plan_extra(self, batch, arrays) -> dict:
        return {}

    def run(self, q, k, v, k_cache, v_cache, plan, scale: float, window: int | None = None) -> torch.Tensor:
        p = plan
        reference.store_kv(k_cache, v_cache, k, v, p.slots)
        o, lse = reference.attend_items(q, k_cache, v_cache, p.q_pos, p.item_q_start,
                                        p.item_q_len, p.item_out_start, p.item_kv_indptr,
                                        p.kv_chunk, p.kv_lo, p.kv_hi, p.kv_pos, scale,
                                        p.num_out_rows, window)
        if p.needs_merge:
            o, _ = reference.merge_partials(o, lse, p.row_indptr, p.row_parts)
        elif o.shape[0] < q.shape[0]:  # padding rows (a padded batch) attend to nothing
            o = torch.cat([o, o.new_zeros((q.shape[0] - o.shape[0], *o.shape[1:]))])
        return o.to(q.dtype)


def kernels_for(shape):
    """The executor for `shape.device`: Triton on CUDA (triton imported here, lazily)."""
    if torch.device(shape.device).type == "cuda":
        from .triton.kernels import TritonKernels
        return TritonKernels(shape)
    return ReferenceKernels(shape)
