"""Attention ops: `reference` (PyTorch, the CPU path and test oracle); `triton` (GPU twins).

A scheduled backend runs its plans through one executor, picked once by device in
`kernels_for`: `triton.TritonKernels` on CUDA (`triton.cells.CellKernels` in deterministic
mode), `ReferenceKernels` elsewhere. Both compute the
same function from the same plan; an executor has

    plan_extra(batch, arrays) -> extra plan arrays/ints (kept in `DevicePlan.extra`)
    generation                -> bumped when what a captured CUDA graph holds changes
    run(q, k, v, k_cache, v_cache, plan, scale, window=None, kv_scale=None)
                              -> o [T, Hq, D] in q's dtype, after writing the new k, v
                                 [T, Hkv, D] at plan.slots; window: a sliding layer's;
                                 kv_scale: an fp8 cache's [4, Hkv] (see `reference`)
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..base import AttentionBatch, AttentionShape
from ..plan import DevicePlan, HostArrays, HostExtras
from . import reference


class Executor(Protocol):
    """What a scheduled backend runs its plans with (see the module docstring)."""

    @property
    def generation(self) -> int: ...

    def plan_extra(self, batch: AttentionBatch, arrays: HostArrays) -> HostExtras: ...

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, plan: DevicePlan, scale: float,
            window: int | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor: ...


class ReferenceKernels:
    """The PyTorch ops: store_kv, attend_items, then merge_partials if the schedule merges,
    then a cast. Deterministic mode (`shape.cell`): attend_cells and merge_in_order instead."""

    generation = 0  # no buffers of its own (see AttentionBackend.generation)

    def __init__(self, shape: AttentionShape) -> None:
        self.shape = shape

    def plan_extra(self, batch: AttentionBatch, arrays: HostArrays) -> HostExtras:
        return {}

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, plan: DevicePlan, scale: float,
            window: int | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        p, cell = plan, self.shape.cell
        reference.store_kv(k_cache, v_cache, k, v, p.slots, kv_scale)
        args = (q, k_cache, v_cache, p.q_pos, p.item_q_start, p.item_q_len, p.item_out_start,
                p.item_kv_indptr, p.kv_chunk, p.kv_lo, p.kv_hi, p.kv_pos, scale, p.num_out_rows)
        o, lse = reference.attend_items(*args, window, kv_scale) if cell is None else \
            reference.attend_cells(*args, cell, window, kv_scale)
        if p.needs_merge:
            assert p.row_indptr is not None and p.row_parts is not None  # what needs_merge means
            merge = reference.merge_partials if cell is None else reference.merge_in_order
            o, _ = merge(o, lse, p.row_indptr, p.row_parts)
        elif o.shape[0] < q.shape[0]:  # padding rows (a padded batch) attend to nothing
            o = torch.cat([o, o.new_zeros((q.shape[0] - o.shape[0], *o.shape[1:]))])
        return o.to(q.dtype)


def kernels_for(shape: AttentionShape) -> Executor:
    """The executor for `shape.device`: Triton on CUDA (triton imported here, lazily), its cell
    executor in deterministic mode (`shape.cell`)."""
    if torch.device(shape.device).type == "cuda":
        if shape.cell is not None:
            from .triton.cells import CellKernels
            return CellKernels(shape)
        from .triton.kernels import TritonKernels
        return TritonKernels(shape)
    return ReferenceKernels(shape)
