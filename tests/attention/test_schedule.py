"""How each schedule cuts hand-built batches into work items."""

import pytest
import torch

from prefixserve.attention.base import AttentionBatch, Segment, SeqQueries
from prefixserve.attention.schedule import Piece, chunk, hydragen, paged, relay, split_shared

C = 16
R = Segment(0, 0, 20, (3, 7), 0)  # root: chunk 3 full, chunk 7 slots 0..3
X = Segment(1, 20, 30, (7, 8, 2), 4)  # continues R inside chunk 7
Y = Segment(2, 50, 5, (5,), 0)
Z = Segment(3, 50, 2, (6,), 0)
W = Segment(4, 20, 6, (9,), 0)


def batch(*paths, pinned=(), q_starts=None):
    """Decode batch: one query per path, rows in path order unless q_starts given."""
    q_starts = q_starts or range(len(paths))
    seqs = tuple(SeqQueries(qs, 1, sum(s.length for s in p) - 1, tuple(p))
                 for qs, p in zip(q_starts, paths, strict=True))
    return AttentionBatch(seqs, C, torch.arange(len(paths)), frozenset(pinned))


def layout(sched):
    """Items as (q_start, q_len, [(node_id, lo, hi), ...])."""
    return [(it.q_start, it.q_len, [(p.seg.node_id, p.lo, p.hi) for p in it.pieces])
            for it in sched.items]


def test_paged_one_item_per_sequence():
    b = batch([R, X, Y], [R, W])
    assert layout(paged(b)) == [(0, 1, [(0, 0, 20), (1, 0, 30), (2, 0, 5)]),
                                (1, 1, [(0, 0, 20), (4, 0, 6)])]
    assert not paged(b).needs_merge


def test_relay_shares_the_prefix_common_to_all():
    b = batch([R, X, Y], [R, X, Z], [R, W])
    assert layout(relay(b)) == [(0, 3, [(0, 0, 20)]), (0, 1, [(1, 0, 30), (2, 0, 5)]),
                                (1, 1, [(1, 0, 30), (3, 0, 2)]), (2, 1, [(4, 0, 6)])]
    assert relay(b).needs_merge


def test_relay_pinned_nodes_only():
    b = batch([R, X, Y], [R, X, Z], pinned={0})
    assert layout(relay(b))[0] == (0, 2, [(0, 0, 20)])
    assert layout(relay(batch([R, X, Y], [R, X, Z])))[0] == (0, 2, [(0, 0, 20), (1, 0, 30)])


@pytest.mark.parametrize("paths", [
    ([R, X], [W]),  # different roots
    ([R, X], [Segment(0, 0, 12, (3,), 0)]),  # same node, other length: not identical
])
def test_relay_falls_back_to_paged(paths):
    b = batch(*paths)
    assert relay(b) == paged(b)


def test_relay_pinned_node_not_shared_by_all_is_paged():
    assert relay(batch([R, X], [R, W], pinned={1})) == paged(batch([R, X], [R, W]))


def test_hydragen_shares_every_node_of_two_or_more():
    b = batch([R, X, Y], [R, X, Z], [R, W])
    assert layout(hydragen(b)) == [(0, 3, [(0, 0, 20)]), (0, 2, [(1, 0, 30)]),
                                   (0, 1, [(2, 0, 5)]), (1, 1, [(3, 0, 2)]), (2, 1, [(4, 0, 6)])]


def test_hydragen_fuses_a_chain_read_by_the_same_sequences():
    assert layout(hydragen(batch([R, X, Y], [R, X, Z])))[0] == (0, 2, [(0, 0, 20), (1, 0, 30)])


def test_prefixes_of_one_node_share_their_common_part():
    short = Segment(0, 0, 12, (3,), 0)
    shared, private = split_shared(batch([short], [R, X, Y], [R, X, Z]))
    assert shared == [(0, 3, Piece(short, 0, 12)), (1, 3, Piece(R, 12, 20)),
                      (1, 3, Piece(X, 0, 30))]
    assert private == [[], [Piece(Y, 0, 5)], [Piece(Z, 0, 2)]]


def test_chunk_one_item_per_shared_chunk():
    b = batch([R, X, Y], [R, X, Z])
    # R: keys 0-15 in chunk 3, 16-19 in chunk 7;
    # X (offset 4): keys 0-11 in chunk 7, 12-27 in chunk 8, 28-29 in chunk 2
    assert layout(chunk(b)) == [(0, 2, [(0, 0, 16)]), (0, 2, [(0, 16, 20)]), (0, 2, [(1, 0, 12)]),
                                (0, 2, [(1, 12, 28)]), (0, 2, [(1, 28, 30)]),
                                (0, 1, [(2, 0, 5)]), (1, 1, [(3, 0, 2)])]


def test_non_contiguous_query_rows_split_an_item():
    b = batch([R, X, Y], [R, X, Z], [R, W], q_starts=[0, 2, 1])
    assert layout(hydragen(b))[:3] == [(0, 1, [(0, 0, 20)]), (2, 1, [(0, 0, 20)]),
                                       (1, 1, [(0, 0, 20)])]


def test_inconsistent_lengths_are_rejected():
    bad = AttentionBatch((SeqQueries(0, 1, 5, (R,)),), C, torch.arange(1))
    with pytest.raises(ValueError, match="lengths disagree"):
        hydragen(bad)
