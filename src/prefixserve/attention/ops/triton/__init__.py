"""Triton twins of `ops.reference` (same signatures), and `TritonKernels`, the GPU executor.

    store.py     store_kv        scatter new K/V into chunk slots
    attend.py    attend_items    every work unit in one launch (tensor-core products, split-K)
    merge.py     merge_partials  log-sum-exp merge, one pass per row
    worklist.py  units and split-K merge CSR, built on the host at plan time (numpy only)
    kernels.py   TritonKernels   plan/run glue for `backends.scheduled`
    cells.py     CellKernels     deterministic mode: key cells in position tiles (cell_worklist.py)
    hopper.py    the wide launch on sm_90, in Gluon: TMA, wgmma, warp specialization
    hopper_rows.py  the narrow launch of G 1 decode tails on sm_90, in Gluon: a row walk

triton is imported lazily (attribute access below), so this package imports on a CPU-only
machine without triton; `worklist` never needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names __getattr__ serves, for the type checker
    from .attend import attend_items as attend_items
    from .kernels import TritonKernels as TritonKernels
    from .merge import merge_partials as merge_partials
    from .store import store_kv as store_kv
    from .worklist import KernelConfig as KernelConfig

_WHERE = {"store_kv": "store", "attend_items": "attend", "merge_partials": "merge",
          "TritonKernels": "kernels", "KernelConfig": "worklist"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
