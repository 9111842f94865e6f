"""Turns a scheduled step into tensors, runs the model once (on every rank), samples.

The attention batch is built here from the prefix tree (host objects); the backend's `plan`
turns it into device tensors once per step, and every layer's `run` reuses them. Under tensor
parallelism the same inputs are broadcast to the other ranks before the forward.

A decode step of the same sequences as the last step, in a tree of unchanged topology, is
sent as an *advanced* batch (`AttentionBatch.advance`): the new keys' slots only, O(1) per
sequence, and the backend moves its last plan one token on instead of rebuilding it.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..attention.base import AttentionBatch, Segment, SeqQueries
from ..kvcache.prefix_tree import PrefixTree
from .sampler import Sampler, SampleOutput
from .scheduler import SchedulerOutput
from .workers import RankState, Workers


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """A profiled CUDA step: the forward's GPU time (events around it) and how long the host
    then sat waiting for it; the rest of the step's wall time is host work."""

    rows: int  # query rows of the step
    device_s: float
    wait_s: float


class ModelRunner:
    def __init__(self, rank: RankState, tree: PrefixTree, sampler: Sampler, workers: Workers | None):
        self.rank, self.tree, self.sampler, self.workers = rank, tree, sampler, workers
        self._last: tuple | None = None  # (sequence ids, tree version) of the last decode step
        self.advanced_steps = 0  # decode steps sent as advanced batches (for tests and profiles)
        self.profile = False  # CUDA: time each step's forward into `timing` (adds one sync)
        self.timing: StepTiming | None = None

    def execute(self, sched: SchedulerOutput) -> SampleOutput | None:
        inputs = self.prepare(sched)
        if self.workers is not None:
            self.workers.broadcast(inputs)
        if self.profile and self.rank.device.type == "cuda":
            logits = self._profiled(inputs)
        else:
            logits = self.rank.forward(*inputs)
        if logits is None:
            return None
        return self.sampler.sample(logits, [g.seq for g in sched.seqs if g.sample])

    def _profiled(self, inputs) -> torch.Tensor | None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = self.rank.forward(*inputs)
        end.record()
        t = time.perf_counter()
        end.synchronize()
        self.timing = StepTiming(len(inputs[0]), start.elapsed_time(end) / 1e3, time.perf_counter() - t)
        return logits

    def prepare(self, sched: SchedulerOutput):
        """-> input ids [T], positions [T], the AttentionBatch, rows whose logits are sampled."""
        decode = all(g.num_tokens == 1 and g.sample for g in sched.seqs)
        key = (tuple(g.seq.seq_id for g in sched.seqs), self.tree.version) if decode else None
        advance = key is not None and key == self._last and self.rank.backend.can_advance()
        self._last = key
        self.advanced_steps += advance
        return self._advance(sched) if advance else self._full(sched)

    def _advance(self, sched: SchedulerOutput):
        """The last step's sequences, each one token further: only the new tokens and slots."""
        C = self.rank.pool.chunk_size
        ids = [g.seq.tokens_from(g.start, g.start + 1)[0] for g in sched.seqs]
        positions = [g.start for g in sched.seqs]
        slots = [g.seq.leaf.slot(g.start - g.seq.leaf.pos_start, C) for g in sched.seqs]
        batch = AttentionBatch((), C, torch.tensor(slots, dtype=torch.int64), advance=True)
        return torch.tensor(ids), torch.tensor(positions), batch, list(range(len(ids)))

    def _full(self, sched: SchedulerOutput):
        ids, positions, slots, seqs, sample_rows, pinned = [], [], [], [], [], set()
        C = self.rank.pool.chunk_size
        for g in sched.seqs:
            q_start, end = len(ids), g.start + g.num_tokens
            ids += g.seq.tokens_from(g.start, end)
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
