"""Exact shared-prefix attention: the engine's seam (base.py), schedules, plans, backends, ops.

Glossary, coarse to fine (C = chunk_size; "keys" means K/V positions):

    chunk    C slots of the KV pool (kvcache/chunk_pool.py; vLLM's block): the unit of memory
    node     a prefix-tree node: token ids stored in slot order in its chunks (kvcache/prefix_tree.py)
    segment  `base.Segment`: (a prefix of) one node on a sequence's root-to-leaf path, as keys at
             positions [pos_start, pos_start + length) from slot `offset` of chunks[0]
    piece    `schedule.Piece`: keys [lo, hi) of one segment, the span a schedule assigns to an item
    item     `schedule.Item`: query rows [q_start, +q_len) x pieces; one partial per row (a
             shared item: the rows of every sequence reading its pieces; private: one sequence's)
    partial  an item's (o, lse) for one query row; a row's partials are merged by log-sum-exp
    entry    a plan's kv entry (plan.py): one item's keys within one chunk, (kv_chunk, kv_lo,
             kv_hi, kv_pos); an item's entries are item_kv_indptr[i] .. item_kv_indptr[i+1]
    unit     the Triton attend kernel's work (ops/triton/worklist.py): a block of one item's
             query rows x a contiguous split of its entries; one program per (unit, KV head)
    tile     block_n keys of a unit loaded at once by the kernel (entries padded to a power of two)

The backends are registered by name when this package is imported (registry.py).
"""

from . import backends  # noqa: F401  (importing it registers the built-in backends)
from .base import AttentionBackend, AttentionBatch, AttentionShape, Segment, SeqQueries
from .registry import backend_names, create_backend, register_backend

__all__ = ["AttentionBackend", "AttentionBatch", "AttentionShape", "SeqQueries", "Segment",
           "backend_names", "create_backend", "register_backend"]
