"""Triton twins of `ops.reference` (same signatures), and `TritonKernels`, the GPU executor.

    store.py     store_kv        scatter new K/V into chunk slots
    attend.py    the attend kernel: every work unit of a launch (tensor-core products, split-K)
    launch.py    attend_items    the launches, host side: checks, grids, which kernel runs one
    merge.py     merge_partials  log-sum-exp merge, one pass per row
    configs.py   KernelConfig    launch shapes, and the (narrow, wide) pair a plan takes
    worklist.py  units and split-K merge CSR, built on the host at plan time (numpy only)
    grids.py     how many splits an item gets, over how many SMs the wide units run (numpy)
    kernels.py   TritonKernels   plan/run glue for `backends.scheduled`
    cells.py     CellKernels     deterministic mode: key cells in position tiles (cell_worklist.py)
    hopper.py    the wide launch on sm_90, in Gluon: TMA, wgmma, warp specialization
    hopper_products.py  its row warpgroups: the Q tile, the pipelined walk, the online softmax
    hopper_pairs.py  the same over 128-key tiles of two chunks, for steps the products bound
    hopper_rows.py  the narrow launch of G 1 decode tails on sm_90, in Gluon: a row walk
    hopper_tails.py  the narrow launch of G 2-16 decode tails on sm_90, in Gluon: keys as wgmma's M

triton is imported lazily (attribute access below), so this package imports on a CPU-only
machine without triton; `worklist` never needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names __getattr__ serves, for the type checker
    from .configs import KernelConfig as KernelConfig
    from .kernels import TritonKernels as TritonKernels
    from .launch import attend_items as attend_items
    from .merge import merge_partials as merge_partials
    from .store import store_kv as store_kv

_WHERE = {"store_kv": "store", "attend_items": "launch", "merge_partials": "merge",
          "TritonKernels": "kernels", "KernelConfig": "configs"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
