"""Sliding-window layers (Gemma 3: 5 of every 6): the batch their plan is built from.

A sliding layer with window W lets the query at position p see keys at positions
(p - W, p]. Exactness comes from the kernels' mask (`ops.reference`: a per-row lower bound
on the key position); this module only removes keys that no query row of the step could see,
so that a sliding layer reads at most about W keys per sequence, and the cost model (which
rates the schedules of this batch, `backends.auto`) counts only those:

    sequence s, first query row at q_pos:   keys below lb(s) = q_pos - W + 1 are invisible
    node n (a segment shared by the sequences below it): keys below min lb(s) over those
    sequences are invisible to all of them -> the segment is cut to start there

A segment is cut the same way in every sequence that holds it, so the shared-prefix
schedules still see one node with one layout; segments cut to nothing are dropped. Decode
steps that advance the plan (`plan.PlanCache`) keep the cut of the last rebuild: the keys
that slide out meanwhile are still read and masked, until the next rebuild re-cuts.

Memory. Chunks wholly outside every sliding layer's window are kept, for two reasons: a
chunk id holds its tokens' K/V for every layer (the pool is [L, chunks, C, Hkv, D]), and
Gemma 3's full-attention layers (1 in 6) still read every key, so only the sliding layers'
share of the chunk could be released, which would take a second pool with its own ids per
layer group (vLLM's hybrid allocator); and the prefix cache serves a cached prefix to later
requests whose queries start right after it, inside the window. What windows save here is
the bandwidth of reading those chunks, not their memory.
"""

from __future__ import annotations

import dataclasses

from .base import AttentionBatch, Segment, SeqQueries


def windowed(batch: AttentionBatch, window: int) -> AttentionBatch:
    """`batch` with every segment cut to the keys some query row of the step may see under
    `window`. An advanced batch names no segments and is returned as it is."""
    if batch.advance:
        return batch
    lowest: dict[int, int] = {}  # node id -> the lowest position a reader of it may see
    for s in batch.seqs:
        for seg in s.segments:
            lb = s.q_pos - window + 1
            lowest[seg.node_id] = min(lowest.get(seg.node_id, lb), lb)
    seqs = tuple(dataclasses.replace(s, segments=tuple(
        cut for seg in s.segments if (cut := _cut(seg, lowest[seg.node_id], batch.chunk_size))))
        for s in batch.seqs)
    return dataclasses.replace(batch, seqs=seqs, windowed=True)


def _cut(seg: Segment, lowest: int, chunk_size: int) -> Segment | None:
    """The keys of `seg` at positions >= lowest (None if none); whole chunks before them are
    dropped from its chunk list."""
    drop = min(max(0, lowest - seg.pos_start), seg.length)
    if drop == seg.length:
        return None
    if drop == 0:
        return seg
    first = seg.offset + drop  # slot of the first kept key, counted from chunks[0]
    return Segment(seg.node_id, seg.pos_start + drop, seg.length - drop,
                   seg.chunks[first // chunk_size:], first % chunk_size)


def kv_bounds_ok(s: SeqQueries, windowed: bool) -> bool:
    """Unless `windowed`, the segments hold kv_len keys. Cut (`windowed`), they hold keys
    disjoint and in increasing position, the last one the newest key; a cut sequence may skip
    a segment in the middle: one that only it reads, below its window, under one that a
    sequence with an earlier window still reads."""
    if not windowed:
        return sum(seg.length for seg in s.segments) == s.kv_len
    end = s.kv_len
    for seg in reversed(s.segments):
        if seg.length < 0 or seg.pos_start + seg.length > end:
            return False
        end = seg.pos_start
    return end >= 0 and bool(s.segments) and s.segments[-1].pos_start + s.segments[-1].length == s.kv_len
