"""CUDA graphs of decode steps: one graph per padded batch size, replayed instead of ~15 kernel
launches per layer.

A decode step (every sequence one query row) of B rows runs padded to the smallest bucket
R >= B (`buckets`). Everything a captured graph reads lives at a fixed address:

    ids, positions    [R] views of this object's static buffers; padding rows: token 0 at
                      position 0, writing their K/V to the pool's pad slot (`ChunkPool`)
    the plan          the backend's plan buffers (`plan.PlanCache`: per-field buffers that only
                      grow; a padded plan fixes the kernels' grids and scratch, see
                      `ops.triton.kernels`), stable while `backend.generation` is unchanged
    the KV pool       allocated once

So a graph of R rows stays valid until the backend's generation moves; it is then captured
again. The first step of a bucket runs eagerly (which also compiles any Triton kernel) and
captures the graph for the steps after it. All graphs share one memory pool: they never run
at the same time. Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..attention.base import AttentionBatch

log = logging.getLogger(__name__)


def buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 256, then of 64: at most 1/16 padding past 16
    rows (vLLM's choice), capped by (and including) max_rows."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(320, max_rows + 64, 64)]
    return sorted({min(s, max_rows) for s in sizes})


class DecodeGraphs:
    def __init__(self, device: torch.device, max_rows: int):
        self.device, self.sizes = device, buckets(max_rows)
        self.ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[int, torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def rows_for(self, batch: AttentionBatch) -> int | None:
        """The bucket a decode batch replays in; None for other steps (run eagerly)."""
        n = batch.num_tokens
        decode = batch.advance or (n == len(batch.seqs) and all(s.q_len == 1 for s in batch.seqs))
        if not decode or n == 0 or n > self.sizes[-1]:
            return None
        return next(r for r in self.sizes if r >= n)

    def run(self, rows: int, ids: torch.Tensor, positions: torch.Tensor, generation: int,
            forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Hidden states [rows, hidden] of the planned padded step; ids, positions: [n] on the
        device; forward(ids, positions) is the model on the plan (padding rows past n)."""
        n = ids.numel()
        self.ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.ids[n:rows].zero_()
        self.positions[n:rows].zero_()
        static = (self.ids[:rows], self.positions[:rows])
        entry = self.graphs.get(rows)
        if entry is not None and entry[0] == generation:
            entry[1].replay()
            return entry[2]
        hidden = forward(*static)  # eager: the result of this step, and the warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward(*static)
        self.graphs[rows] = (generation, graph, out)
        log.debug("captured a decode graph of %d rows (plan generation %d)", rows, generation)
        return hidden
