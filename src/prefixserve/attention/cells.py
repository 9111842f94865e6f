"""Deterministic mode's key cells: any schedule re-cut so that a row's result is one function of
its own keys, whatever the schedule, the batch or the sharing (host only, no tensors).

A row's attention is the log-sum-exp merge of partials; their bits depend on how its keys are
split and in which order the partials are merged. So every schedule here splits every row's
keys on one absolute grid of cells, [c * CELL, (c + 1) * CELL), computes each (row, cell)
partial with the same inner loop (`ops`: fixed shapes on the CPU, tiles at fixed positions on
the GPU), and merges a row's partials in cell order. Sharing survives where it is exact: a cell
that a schedule's shared item covers whole, for a sequence, is computed once for all its
sequences (the same keys, in the same places); a cell that the schedule splits -- a shared
prefix ending inside it -- is computed per sequence, from all of its keys:

    positions:      0        CELL      2 CELL     3 CELL
    seq 0:          |-- shared A ----------|-- private 0 -----|
    seq 1:          |-- shared A ----------|-- private 1 --|
    cells:          [ A, rows of 0 and 1 ][ seq 0 ........ ][ seq 0 ]
                                          [ seq 1 ........ ]
                      one item              the cell A splits: one item per sequence

Backends differ only in cost: every one of them yields the same partials for every row.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .base import AttentionBatch, SeqQueries
from .schedule import Item, Piece, Schedule, q_runs, segment_pieces

Interval = tuple[int, int]  # key positions [lo, hi)


def _span(p: Piece) -> Interval:
    return p.seg.pos_start + p.lo, p.seg.pos_start + p.hi


def _clip(pieces: Iterable[Piece], lo: int, hi: int) -> tuple[Piece, ...]:
    """The parts of `pieces` at key positions [lo, hi), in position order."""
    out = []
    for p in pieces:
        start, end = _span(p)
        a, b = max(start, lo), min(end, hi)
        if a < b:
            out.append(Piece(p.seg, a - p.seg.pos_start, b - p.seg.pos_start))
    return tuple(sorted(out, key=lambda p: p.seg.pos_start + p.lo))


def _merged(spans: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _keys(seq: SeqQueries) -> list[Interval]:
    """A sequence's key positions: [0, kv_len), or in a windowed batch what its segments keep
    (they start late and may skip a segment, `window.kv_bounds_ok`)."""
    return _merged((g.pos_start, g.pos_start + g.length) for g in seq.segments if g.length > 0)


def _cells_of(spans: list[Interval], cell: int) -> list[int]:
    return sorted({c for lo, hi in spans for c in range(lo // cell, (hi - 1) // cell + 1)})


def cells(sched: Schedule, batch: AttentionBatch, cell: int) -> Schedule:
    """`sched` with every item cut to cells (see the module docstring); items in cell order, so
    each row's partials merge in cell order (`plan._merge_csr` keeps item order per row)."""
    seq_at = {s.q_start: i for i, s in enumerate(batch.seqs)}  # first row -> sequence
    keys = [_keys(s) for s in batch.seqs]
    out: list[tuple[int, int, int, tuple[Piece, ...]]] = []  # (cell, q_start, q_len, pieces)
    done: set[tuple[int, int]] = set()  # (sequence, cell) computed by a shared item
    for item in sched.items:
        members = _members(item, batch, seq_at)
        spans = _merged(_span(p) for p in item.pieces)
        for c in _cells_of(spans, cell):
            whole = [i for i in members if _covers(spans, keys[i], c, cell)]
            pieces = _clip(item.pieces, c * cell, (c + 1) * cell)
            for q_start, q_len in q_runs(batch.seqs[i] for i in whole):
                out.append((c, q_start, q_len, pieces))
            done.update((i, c) for i in whole)
    for i, s in enumerate(batch.seqs):
        for c in _cells_of(keys[i], cell):
            if (i, c) not in done:
                out.append((c, s.q_start, s.q_len, _clip(segment_pieces(s.segments), c * cell, (c + 1) * cell)))
    out.sort(key=lambda x: x[0])  # stable: within a cell, the schedule's order
    return Schedule(tuple(Item(q, n, p) for _, q, n, p in out), sched.num_rows)


def _members(item: Item, batch: AttentionBatch, seq_at: dict[int, int]) -> list[int]:
    """The sequences whose rows the item holds (an item holds all rows of each of them)."""
    out, row = [], item.q_start
    while row < item.q_start + item.q_len:
        i = seq_at[row]
        out.append(i)
        row += batch.seqs[i].q_len
    return out


def _covers(spans: list[Interval], keys: list[Interval], c: int, cell: int) -> bool:
    """Whether the item's keys hold all of the sequence's keys in cell c."""
    for lo, hi in keys:
        lo, hi = max(lo, c * cell), min(hi, (c + 1) * cell)
        if lo < hi and not any(a <= lo and hi <= b for a, b in spans):
            return False
    return True


def crosses(next_positions: np.ndarray, cell: int) -> bool:
    """Whether a key at one of these positions opens a cell (an advanced plan cannot take it:
    its row needs a new partial)."""
    return bool((next_positions % cell == 0).any())

