"""Turns a scheduled step into tensors, runs the model once (on every rank), samples.

The attention batch is built here from the prefix tree (host objects); the backend's `plan`
turns it into device tensors once per step, and every layer's `run` reuses them. Under tensor
parallelism the same inputs are broadcast to the other ranks before the forward.

A decode step of the same sequences as the last step, in a tree of unchanged topology, is
sent as an *advanced* batch (`AttentionBatch.advance`): the new keys' slots only, O(1) per
sequence, and the backend moves its last plan one token on instead of rebuilding it.

`launch` queues a step on the device and returns at once; `collect` reads its sampled tokens.
A step may be launched before the last one is collected (overlapped scheduling): the tokens
still PENDING in its inputs are then taken, on the device, from the last step's samples.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..attention.base import AttentionBatch, Segment, SeqQueries
from ..kvcache.prefix_tree import PENDING, PrefixTree
from .request import Sequence
from .sampler import DeviceSample, SampleOutput, Sampler
from .scheduler import SchedulerOutput
from .workers import RankState, Workers

# One step's inputs: input ids [T] (host), positions [T], the attention batch, the rows whose
# logits are sampled. Also what tensor-parallel workers are sent.
StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[int]]


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """A profiled CUDA step, from events around its forward and sampling: its GPU time, how
    long the GPU sat idle before it (host work not hidden behind the previous step; None for
    the first step), and how long the host waited to read its tokens."""

    rows: int  # query rows of the step
    device_s: float
    idle_s: float | None
    wait_s: float


@dataclasses.dataclass
class Launched:
    """A step queued on the device."""

    rows: list[Sequence]  # the sequences of the sampled rows, in row order, then the forks' followers
    sampled: DeviceSample | None  # None: the step samples nothing
    num_rows: int  # query rows
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # profiling: CUDA (start, end) events


class ModelRunner:
    def __init__(self, rank: RankState, tree: PrefixTree, sampler: Sampler, workers: Workers | None):
        self.rank, self.tree, self.sampler, self.workers = rank, tree, sampler, workers
        self._last: tuple[tuple[int, ...], int] | None = None  # (sequence ids, tree version) of the last decode step
        self._prev: tuple[tuple[int, ...], torch.Tensor] | None = None  # last launch: (seq ids of its rows, sampled [B])
        self._prev_end: torch.cuda.Event | None = None  # profiling: the last launch's end event
        self.advanced_steps = 0  # decode steps sent as advanced batches (for tests and profiles)
        self.profile = False  # CUDA: time each step into `timing` (events; no extra sync)
        self.timing: StepTiming | None = None

    def launch(self, sched: SchedulerOutput) -> Launched:
        ids, positions, batch, sample_rows = self.prepare(sched)
        if self.workers is not None:  # their ranks take the ids as sent: none may be pending
            self.workers.broadcast((ids, positions, batch, sample_rows))
        events = None
        if self.profile and self.rank.device.type == "cuda":
            # torch's Event.__new__ is unannotated
            events = (torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
                      torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
            events[0].record()
        logits = self.rank.forward(self._fill_pending(ids, sched), positions, batch, sample_rows)
        rows = [g.seq for g in sched.seqs if g.sample]
        if sched.forks and logits is not None:  # followers draw from their leaders' rows
            row_of = {seq: r for r, seq in enumerate(rows)}
            src = torch.tensor([row_of[leader] for _, leader in sched.forks])
            logits = torch.cat([logits, logits[self.rank.upload(src)]])
            rows += [follower for follower, _ in sched.forks]
        sampled = None if logits is None else self.sampler.sample_on_device(logits, rows)
        if events:
            events[1].record()
        self._prev = None if sampled is None else (tuple(s.seq_id for s in rows), sampled.token_ids)
        return Launched(rows, sampled, len(ids), events)

    def forget(self) -> None:
        """After a failed step: the next step is built in full and takes no pending token."""
        self._last = self._prev = None

    def collect(self, step: Launched) -> SampleOutput | None:
        """The step's sampled tokens on the host (waits for that step only)."""
        if step.sampled is None:
            return None
        t = time.perf_counter()
        out = step.sampled.result()
        wait = time.perf_counter() - t
        if step.events:
            start, end = step.events
            end.synchronize()  # recorded just after the copies `result` waited for
            idle = self._prev_end.elapsed_time(start) / 1e3 if self._prev_end is not None else None
            self.timing = StepTiming(step.num_rows, start.elapsed_time(end) / 1e3, idle, wait)
            self._prev_end = end
        return out

    def _fill_pending(self, ids: torch.Tensor, sched: SchedulerOutput) -> torch.Tensor:
        """ids [T] (host) -> the step's input ids, each PENDING one replaced on the device by
        the last launch's sample of its sequence. Only a grant's last token can be pending."""
        at: list[int] = []  # rows of the pending tokens
        seq_ids: list[int] = []  # their sequences
        q = 0
        for g in sched.seqs:
            q += g.num_tokens
            if g.seq.pending and g.start + g.num_tokens == g.seq.num_tokens:
                at.append(q - 1)
                seq_ids.append(g.seq.seq_id)
        if not at:
            return ids
        assert self._prev is not None, "a pending token was sampled by the last launch"
        prev_ids, prev_tokens = self._prev
        if len(at) == len(ids) and tuple(seq_ids) == prev_ids:  # a decode step of the same rows
            return prev_tokens
        row = {sid: r for r, sid in enumerate(prev_ids)}
        out = self.rank.upload(ids.masked_fill(ids == PENDING, 0))
        src = torch.tensor([row[sid] for sid in seq_ids])
        out[self.rank.upload(torch.tensor(at))] = prev_tokens[self.rank.upload(src)]
        return out

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """-> input ids [T], positions [T], the AttentionBatch, rows whose logits are sampled."""
        decode = all(g.num_tokens == 1 and g.sample for g in sched.seqs)
        key = (tuple(g.seq.seq_id for g in sched.seqs), self.tree.version) if decode else None
        advance = key is not None and key == self._last and self.rank.backend.can_advance()
        self._last = key
        self.advanced_steps += advance
        return self._advance(sched) if advance else self._full(sched)

    def _advance(self, sched: SchedulerOutput) -> StepInputs:
        """The last step's sequences, each one token further: only the new tokens and slots."""
        C = self.rank.pool.chunk_size
        ids = [g.seq.tokens_from(g.start, g.start + 1)[0] for g in sched.seqs]
        positions = [g.start for g in sched.seqs]
        slots = [self.tree.slot(g.seq.held_leaf, g.start) for g in sched.seqs]
        batch = AttentionBatch((), C, torch.tensor(slots, dtype=torch.int64), advance=True)
        return torch.tensor(ids), torch.tensor(positions), batch, list(range(len(ids)))

    def _full(self, sched: SchedulerOutput) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[SeqQueries] = []
        sample_rows: list[int] = []
        pinned: set[int] = set()  # ids of the pinned nodes on the step's paths
        C = self.rank.pool.chunk_size
        for g in sched.seqs:
            q_start, end = len(ids), g.start + g.num_tokens
            ids += g.seq.tokens_from(g.start, end)
            positions += range(g.start, end)
            segments: list[Segment] = []
            for s in self.tree.segments(g.seq.held_leaf, end):
                segments.append(Segment(s.node_id, s.pos_start, s.length, s.chunks, s.offset))
                slots += s.slots(g.start, C)
                if s.pinned:
                    pinned.add(s.node_id)
            seqs.append(SeqQueries(q_start, g.num_tokens, g.start, tuple(segments)))
            if g.sample:
                sample_rows.append(len(ids) - 1)
        batch = AttentionBatch(tuple(seqs), C, torch.tensor(slots, dtype=torch.int64), frozenset(pinned))
        return torch.tensor(ids), torch.tensor(positions), batch, sample_rows
