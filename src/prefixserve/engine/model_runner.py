"""Turns a scheduled step into tensors, runs the model once (on every rank), samples.

The attention batch is built here from the prefix tree (host objects); the backend's `plan`
turns it into device tensors once per step, and every layer's `run` reuses them. Under tensor
parallelism the same inputs are broadcast to the other ranks before the forward.
"""

from __future__ import annotations

import torch

from ..attention.base import AttentionBatch, Segment, SeqQueries
from ..kvcache.prefix_tree import PrefixTree
from .sampler import Sampler, SampleOutput
from .scheduler import SchedulerOutput
from .workers import RankState, Workers


class ModelRunner:
    def __init__(self, rank: RankState, tree: PrefixTree, sampler: Sampler, workers: Workers | None):
        self.rank, self.tree, self.sampler, self.workers = rank, tree, sampler, workers

    def execute(self, sched: SchedulerOutput) -> SampleOutput | None:
        inputs = self.prepare(sched)
        if self.workers is not None:
            self.workers.broadcast(inputs)
        logits = self.rank.forward(*inputs)
        if logits is None:
            return None
        return self.sampler.sample(logits, [g.seq for g in sched.seqs if g.sample])

    def prepare(self, sched: SchedulerOutput):
        """-> input ids [T], positions [T], the AttentionBatch, rows whose logits are sampled."""
        ids, positions, slots, seqs, sample_rows, pinned = [], [], [], [], [], set()
        C = self.rank.pool.chunk_size
        for g in sched.seqs:
            q_start, end = len(ids), g.start + g.num_tokens
            ids += g.seq.token_ids[g.start:end]
            positions += range(g.start, end)
            segments = []
            for node in self.tree.path(g.seq.leaf):
                if node.pos_start >= end:
                    break
                length = min(len(node.tokens), end - node.pos_start)
                segments.append(Segment(node.id, node.pos_start, length, node.chunk_tuple(), node.offset))
                lo = max(g.start, node.pos_start)
                slots += (node.slot(p - node.pos_start, C) for p in range(lo, node.pos_start + length))
                if node.pins:
                    pinned.add(node.id)
            seqs.append(SeqQueries(q_start, g.num_tokens, g.start, tuple(segments)))
            if g.sample:
                sample_rows.append(len(ids) - 1)
        batch = AttentionBatch(tuple(seqs), C, torch.tensor(slots, dtype=torch.int64), frozenset(pinned))
        return torch.tensor(ids), torch.tensor(positions), batch, sample_rows
