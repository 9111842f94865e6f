"""`PrefixTree.segments` / `slot`: what the model runner reads of a path, checked against a
plain walk over the nodes (fresh paths, splits inside a chunk, tail children, partial chunks,
pins, cuts at every position)."""

from __future__ import annotations

import torch

from prefixserve.kvcache.chunk_pool import ChunkPool
from prefixserve.kvcache.prefix_tree import PrefixTree

C = 4


def make_tree(num_chunks=32) -> PrefixTree:
    return PrefixTree(ChunkPool(1, num_chunks, C, 1, 2, torch.float32, torch.device("cpu")), True)


def walk(tree, leaf, start, end):
    """The reference: (node id, pos_start, length, chunks, offset, pinned) per node before `end`,
    and the flat slots of positions [start, end), from the nodes' own fields."""
    segs, slots = [], []
    for node in tree.path(leaf):
        if node.pos_start >= end:
            break
        length = min(len(node.tokens), end - node.pos_start)
        segs.append((node.id, node.pos_start, length, tuple(node.chunks), node.offset, node.pins > 0))
        lo = max(start, node.pos_start)
        slots += [node.slot(p - node.pos_start, C) for p in range(lo, node.pos_start + length)]
    return segs, slots


def check(tree, leaf):
    for end in range(1, leaf.end + 1):
        for start in range(end):
            segs = tree.segments(leaf, end)
            want_segs, want_slots = walk(tree, leaf, start, end)
            assert [tuple(s) for s in segs] == want_segs, (start, end)
            assert [x for s in segs for x in s.slots(start, C)] == want_slots, (start, end)
    assert [tree.slot(leaf, p) for p in range(leaf.pos_start, leaf.end)] == \
        [leaf.slot(j, C) for j in range(len(leaf.tokens))]


def test_one_fresh_path_over_several_chunks():
    tree = make_tree()
    leaf, _ = tree.insert(list(range(10)), 9)
    assert [tuple(s) for s in tree.segments(leaf, 10)] == [(leaf.id, 0, 10, (0, 1, 2), 0, False)]
    assert tree.segments(leaf, 6)[0].slots(3, C) == [3, 4, 5]
    check(tree, leaf)


def test_split_inside_a_chunk_and_tail_children():
    tree = make_tree()
    a, _ = tree.insert([1, 2, 3, 4, 5, 6, 7], 6)
    tree.mark_computed(a, a.end)
    b, _ = tree.insert([1, 2, 3, 4, 5, 9, 9, 9, 9, 9], 9)  # splits a after 5 tokens, inside chunk 1
    c, _ = tree.insert([1, 2, 3, 4, 5, 6, 8], 6)  # splits a again, after 6
    assert a.offset and a.parent.parent.tail_child is a.parent  # a continues inside a shared chunk
    for leaf in (a, b, c):
        assert len(tree.path(leaf)) >= 2
        check(tree, leaf)
    tree.check_integrity()


def test_extended_leaf_and_a_child_of_a_shared_node():
    tree = make_tree()
    a, _ = tree.insert(list(range(6)), 5)
    tree.mark_computed(a, a.end)
    b, _ = tree.insert(list(range(6)) + [40, 41], 7)
    a = tree.extend(a, [50, 51, 52, 53, 54])  # a is held by one sequence: grows in place
    b = tree.extend(b, [60])
    for leaf in (a, b):
        check(tree, leaf)


def test_pinned_nodes_are_flagged():
    tree = make_tree()
    sys_leaf, _ = tree.insert(list(range(7)), 7)
    tree.mark_computed(sys_leaf, sys_leaf.end)
    tree.pin(sys_leaf)
    leaf, matched = tree.insert(list(range(7)) + [30, 31, 32], 9)
    assert matched == 7
    segs = tree.segments(leaf, leaf.end)
    assert [s.pinned for s in segs] == [True, False] and segs[1].offset == 3
    check(tree, leaf)
