"""Schedules: how each backend cuts a batch's keys into work items (host only, no tensors).

Every schedule partitions each sequence's keys into pieces and pairs pieces with query rows:

    seq 0: |---- shared A ----|-- shared B --|-- private 0 --|
    seq 1: |---- shared A ----|-- shared B --|-- private 1 ----|
    seq 2: |---- shared A ----|------ private 2 ------|

An `Item` is (a contiguous run of query rows, pieces): a shared item holds the queries of all
sequences that read its pieces, a private item one sequence's queries. Each item yields one
partial per query row; a row's partials are merged by log-sum-exp, which is exact for any
partition, so the schedules differ only in cost:

    paged     one item per sequence: its whole path (no merge)
    relay     one item for the leading segments identical (node id and length) in every
              sequence, or for those of them that are pinned when the batch pins nodes; the
              rest of each sequence paged. Nothing common: exactly `paged`.
    hydragen  every key range that 2+ sequences read (`split_shared`): one item per distinct
              set of sequences (consecutive pieces read by the same set fuse); private tails.
    chunk     ChunkAttention's two phases: chunk-first, one item per shared chunk (a shared
              piece cut at chunk boundaries); sequence-first, one item per sequence's private rest.

Sequences are in depth-first order, so the sequences reading a piece form a range [i, j). If
their query rows are not contiguous (the engine may order rows differently), the range becomes
one item per contiguous run of rows: less batching, still exact.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable

from .base import AttentionBatch, Segment, SeqQueries
from .window import kv_bounds_ok


@dataclasses.dataclass(frozen=True)
class Piece:
    """Keys [lo, hi) of `seg`, counted from the segment's first key."""

    seg: Segment
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class Item:
    q_start: int
    q_len: int
    pieces: tuple[Piece, ...]

    @property
    def num_keys(self) -> int:
        return sum(p.hi - p.lo for p in self.pieces)


@dataclasses.dataclass(frozen=True)
class Schedule:
    items: tuple[Item, ...]
    num_rows: int  # T, the batch's query rows; every row is in at least one item

    @property
    def needs_merge(self) -> bool:
        """False iff every row is in exactly one item (then partials are the output)."""
        return sum(it.q_len for it in self.items) != self.num_rows


Group = tuple[int, int, tuple[Piece, ...]]  # sequences [i, j) read these pieces


def segment_pieces(segments: Iterable[Segment]) -> tuple[Piece, ...]:
    return tuple(Piece(s, 0, s.length) for s in segments if s.length > 0)


def q_runs(seqs: Iterable[SeqQueries]) -> list[tuple[int, int]]:
    """The query rows of `seqs` as maximal contiguous runs (start, length)."""
    runs: list[tuple[int, int]] = []
    for s in seqs:
        if runs and runs[-1][0] + runs[-1][1] == s.q_start:
            runs[-1] = (runs[-1][0], runs[-1][1] + s.q_len)
        else:
            runs.append((s.q_start, s.q_len))
    return runs


def _check(batch: AttentionBatch) -> None:
    for s in batch.seqs:
        if s.q_len < 1 or not kv_bounds_ok(s, batch.windowed):
            raise ValueError(f"sequence lengths disagree: {s}")
    if sum(s.q_len for s in batch.seqs) != batch.num_tokens:
        raise ValueError("sum of q_len differs from the number of slots")


def _assemble(batch: AttentionBatch, groups: list[Group]) -> Schedule:
    _check(batch)
    items = tuple(Item(qs, n, pieces) for i, j, pieces in groups if pieces
                  for qs, n in q_runs(batch.seqs[i:j]))
    return Schedule(items, batch.num_tokens)


def paged(batch: AttentionBatch) -> Schedule:
    return _assemble(batch, [(i, i + 1, segment_pieces(s.segments)) for i, s in enumerate(batch.seqs)])


def _common_prefix(batch: AttentionBatch) -> tuple[Segment, ...]:
    """The leading segments with the same (node_id, length) in every sequence."""
    first = batch.seqs[0].segments if batch.seqs else ()
    k = 0
    while k < len(first) and all(
            len(s.segments) > k and (s.segments[k].node_id, s.segments[k].length)
            == (first[k].node_id, first[k].length) for s in batch.seqs):
        k += 1
    return first[:k]


def relay(batch: AttentionBatch) -> Schedule:
    shared = [i for i, seg in enumerate(_common_prefix(batch))
              if not batch.pinned_node_ids or seg.node_id in batch.pinned_node_ids]
    if not shared:
        return paged(batch)
    segs = batch.seqs[0].segments
    groups: list[Group] = [(0, len(batch.seqs), segment_pieces(segs[i] for i in shared))]
    for i, s in enumerate(batch.seqs):
        rest = (g for n, g in enumerate(s.segments) if n not in shared)
        groups.append((i, i + 1, segment_pieces(rest)))
    return _assemble(batch, groups)


def _advance(seq: SeqQueries, k: int, off: int) -> tuple[int, int]:
    """Normalize a cursor (segment k, `off` keys read in it): skip finished and empty segments."""
    while k < len(seq.segments) and off >= seq.segments[k].length:
        k, off = k + 1, 0
    return k, off


def split_shared(batch: AttentionBatch) -> tuple[list[tuple[int, int, Piece]], list[list[Piece]]]:
    """Every key range read by 2+ sequences: (shared, private).

    shared: (i, j, piece) with j - i >= 2, read by sequences [i, j), parents before children;
    private[i]: the rest of sequence i. Together they partition every sequence's keys.
    Sequences may hold different-length prefixes of one node: the common part is shared and
    the longer ones go on below it.
    """
    seqs = batch.seqs
    cursor = [_advance(s, 0, 0) for s in seqs]  # per sequence: (segment, keys read in it)
    shared: list[tuple[int, int, Piece]] = []
    private: list[list[Piece]] = [[] for _ in seqs]

    def seg_at(a: int) -> Segment | None:  # under sequence a's cursor; None: all keys read
        k = cursor[a][0]
        return seqs[a].segments[k] if k < len(seqs[a].segments) else None

    def reading(a: int) -> Segment:  # seg_at(a) of a sequence that `walk` found sharing one
        seg = seg_at(a)
        assert seg is not None, "a sequence sharing a segment has keys left in it"
        return seg

    def share(a: int, b: int, seg: Segment) -> None:  # [a, b) all read `seg` next
        off = cursor[a][1]
        end = min(reading(s).length for s in range(a, b))
        for s in range(a, b):
            mine = reading(s)
            assert cursor[s][1] == off and (mine.pos_start, mine.offset) == (
                seg.pos_start, seg.offset), "one node, two layouts"
            cursor[s] = _advance(seqs[s], cursor[s][0], end)
        shared.append((a, b, Piece(seg, off, end)))

    def walk(i: int, j: int) -> None:  # sequences [i, j) have read identical keys so far
        a = i
        while a < j:
            seg, b = seg_at(a), a + 1
            while seg is not None and b < j and getattr(seg_at(b), "node_id", None) == seg.node_id:
                b += 1
            if seg is not None and b - a == 1:
                k, off = cursor[a]
                private[a] = [Piece(seg, off, seg.length), *segment_pieces(seqs[a].segments[k + 1:])]
            elif seg is not None:
                share(a, b, seg)
                walk(a, b)
            a = b

    walk(0, len(seqs))
    return shared, private


def hydragen(batch: AttentionBatch) -> Schedule:
    shared, private = split_shared(batch)
    by_range: dict[tuple[int, int], list[Piece]] = {}
    for i, j, piece in shared:
        by_range.setdefault((i, j), []).append(piece)
    groups = [(i, j, tuple(p)) for (i, j), p in by_range.items()]
    groups += [(i, i + 1, tuple(p)) for i, p in enumerate(private)]
    return _assemble(batch, groups)


def _per_chunk(piece: Piece, chunk_size: int) -> list[Piece]:
    """Cut a piece at chunk boundaries (key j sits in chunk (offset + j) // C of its segment)."""
    off = piece.seg.offset
    cuts = range((off + piece.lo) // chunk_size * chunk_size + chunk_size - off, piece.hi,
                 chunk_size)
    bounds = [piece.lo, *cuts, piece.hi]
    return [Piece(piece.seg, lo, hi) for lo, hi in itertools.pairwise(bounds)]


def chunk(batch: AttentionBatch) -> Schedule:
    shared, private = split_shared(batch)
    groups: list[Group] = [(i, j, (p,)) for i, j, piece in shared
                           for p in _per_chunk(piece, batch.chunk_size)]
    groups += [(i, i + 1, tuple(p)) for i, p in enumerate(private)]
    return _assemble(batch, groups)


SCHEDULES: dict[str, Callable[[AttentionBatch], Schedule]] = {
    "paged": paged, "relay": relay, "hydragen": hydragen, "chunk": chunk,
}
