"""The prefix tree over the chunk pool: exact chunk ids, splits without copies, LRU eviction,
pins, and a property test of random add / step / abort / finish / pin / unpin streams."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.kvcache.chunk_pool import ChunkPool, OutOfChunks
from prefixserve.kvcache.prefix_tree import DEFAULT, PENDING, PUBLIC, Partition, PrefixTree


def make_tree(num_chunks=16, chunk_size=4, caching=True) -> PrefixTree:
    pool = ChunkPool(1, num_chunks, chunk_size, 1, 2, torch.float32, torch.device("cpu"))
    return PrefixTree(pool, caching)


def computed(tree, leaf):
    tree.mark_computed(leaf, leaf.end)


def test_insert_allocates_lowest_chunk_ids_in_order():
    tree = make_tree()
    leaf, matched = tree.insert(list(range(10)), match_limit=9)
    assert matched == 0 and leaf.chunks == [0, 1, 2] and leaf.offset == 0
    assert [leaf.slot(j, 4) for j in (0, 3, 4, 9)] == [0, 3, 4, 9]
    tree.check_integrity()


def test_split_inside_a_chunk_shares_it_with_the_tail_child():
    tree = make_tree()
    a, _ = tree.insert([1, 2, 3, 4, 5, 6, 7], 6)  # chunks 0, 1
    computed(tree, a)
    b, matched = tree.insert([1, 2, 3, 4, 5, 9, 9], 6)
    assert matched == 5
    up = a.parent
    assert up.tokens == [1, 2, 3, 4, 5] and up.chunks == [0, 1] and up.ref == 2
    # a continues inside chunk 1 at slot 1 (no copy); b starts a fresh chunk
    assert a.tokens == [6, 7] and a.offset == 1 and a.chunks == [1] and up.tail_child is a
    assert b.tokens == [9, 9] and b.offset == 0 and b.chunks == [2]
    assert a.slot(0, 4) == 5  # the very slot where token 6 was written before the split
    tree.check_integrity()


def test_match_is_capped_so_the_last_prompt_token_is_computed_by_each_sequence():
    tree = make_tree()
    a, _ = tree.insert([5, 6, 7, 8], 3)
    computed(tree, a)
    b, matched = tree.insert([5, 6, 7, 8], 3)
    assert matched == 3 and b is not a and b.tokens == [8] and b.parent is a.parent
    assert not b.listed  # a's continuation already starts with token 8
    tree.check_integrity()


def test_release_keeps_computed_tokens_cached_and_trims_the_rest():
    tree = make_tree()
    a, _ = tree.insert(list(range(10)), 9)
    tree.mark_computed(a, 6)
    tree.release(a)
    assert a.tokens == list(range(6)) and a.chunks == [0, 1] and a.ref == 0
    assert tree.chunk_counts() == {"in_use": 0, "cached": 2, "free": 14}
    b, matched = tree.insert(list(range(8)), 7)
    assert matched == 6 and b.parent is a
    tree.check_integrity()


def test_caching_off_frees_everything_on_release():
    tree = make_tree(caching=False)
    a, _ = tree.insert(list(range(10)), 9)
    computed(tree, a)
    b, matched = tree.insert(list(range(10)), 9)
    assert matched == 0 and set(a.chunks).isdisjoint(b.chunks)
    tree.release(a)
    tree.release(b)
    assert tree.chunk_counts() == {"in_use": 0, "cached": 0, "free": 16}
    tree.check_integrity()


def test_eviction_is_least_recently_used_leaf_first():
    tree = make_tree(num_chunks=6, chunk_size=4)
    leaves = []
    for first in (10, 20, 30):
        leaf, _ = tree.insert([first] * 8, 7)  # 2 chunks each: ids 0-1, 2-3, 4-5
        computed(tree, leaf)
        leaves.append(leaf)
    for leaf in (leaves[1], leaves[0], leaves[2]):  # released in this order: 20 is oldest
        tree.release(leaf)
    d, _ = tree.insert([40] * 4, 3)
    assert d.chunks == [3]  # the 20-prefix was evicted; the stack hands back its last chunk
    assert {n.tokens[0] for n in tree.iter_nodes()} == {10, 30, 40}
    tree.check_integrity()


def test_out_of_chunks_holds_nothing():
    tree = make_tree(num_chunks=2, chunk_size=4)
    a, _ = tree.insert([1] * 8, 7)
    with pytest.raises(OutOfChunks):
        tree.insert([2] * 4, 3)
    tree.release(a)
    tree.check_integrity()
    assert tree.chunk_counts()["in_use"] == 0


def test_pinned_prefix_survives_eviction_until_unpinned():
    tree = make_tree(num_chunks=4, chunk_size=4)
    p, _ = tree.insert([7] * 8, 8)
    computed(tree, p)
    tree.pin(p)
    tree.release(p)
    with pytest.raises(OutOfChunks):
        tree.insert([1] * 12, 11)
    tree.unpin(p)
    leaf, _ = tree.insert([1] * 12, 11)
    assert leaf.chunks == [2, 3, 1]  # the free ones, then one of the evicted prefix's
    assert [n.tokens[0] for n in tree.iter_nodes()] == [1]
    tree.check_integrity()


def test_extend_appends_in_place_or_forks_a_child():
    tree = make_tree()
    a, _ = tree.insert([1, 2, 3], 2)
    computed(tree, a)
    assert tree.extend(a, [4, 5]) is a and a.chunks == [0, 1]
    b, _ = tree.insert([1, 2, 3, 4, 5, 6], 5)  # shares a's five tokens, a becomes internal
    c = tree.extend(a, [9])
    assert c.parent is a and c is not a and c.ref == 1
    tree.check_integrity()


# ---- property test against a simple model: each running sequence is its token list -------------

PARTITIONS = (DEFAULT, Partition("a"), Partition("a", "salt"), PUBLIC)
ops = st.lists(st.tuples(st.sampled_from(["add", "step", "finish", "abort", "pin", "unpin"]),
                         st.integers(0, 10 ** 6)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, chunk_size=st.sampled_from([1, 3, 4]), caching=st.booleans())
def test_random_streams_keep_the_contract(ops, chunk_size, caching):
    import random
    tree = make_tree(num_chunks=24, chunk_size=chunk_size, caching=caching)
    running: dict[int, tuple[object, list[int]]] = {}  # id -> (leaf, tokens)
    pinned: list[object] = []
    for i, (op, r) in enumerate(ops):
        rng = random.Random(r)
        if op == "add" or (op == "pin" and caching):
            prompt = [rng.choice([1, 2]) for _ in range(rng.randint(1, 9))]
            part = rng.choice(PARTITIONS)
            try:
                leaf, _ = tree.insert(prompt, len(prompt) if op == "pin" else len(prompt) - 1, part)
            except OutOfChunks:
                continue
            if op == "pin":
                computed(tree, leaf)
                tree.pin(leaf)
                tree.release(leaf)
                pinned.append(leaf)
            else:
                running[i] = (leaf, prompt)
        elif op == "step" and running:
            key = rng.choice(sorted(running))
            leaf, toks = running[key]
            computed(tree, leaf)
            try:
                leaf = tree.extend(leaf, [rng.choice([1, 2])])
                running[key] = (leaf, toks + [leaf.tokens[-1]])
            except OutOfChunks:
                tree.release(leaf)
                del running[key]
        elif op in ("finish", "abort") and running:
            key = rng.choice(sorted(running))
            leaf, _ = running.pop(key)
            if op == "finish":
                computed(tree, leaf)
            tree.release(leaf)
        elif op == "unpin" and pinned:
            tree.unpin(pinned.pop(rng.randrange(len(pinned))))
        tree.check_integrity()
        for leaf, toks in running.values():  # the model: each path spells its tokens, in its partition
            assert [t for n in tree.path(leaf) for t in n.tokens] == toks
            assert {n.partition for n in tree.path(leaf)} <= {leaf.partition, PUBLIC}
    for leaf, _ in running.values():
        tree.release(leaf)
    for p in pinned:
        tree.unpin(p)
    tree.check_integrity()
    assert tree.chunk_counts()["in_use"] == 0


def test_version_counts_topology_changes_not_in_place_growth():
    """The decode fast paths (scheduler order, advanced plans) rely on: extending a private
    leaf in place, even into a new chunk, keeps the version; a new node or a split bumps it."""
    tree = make_tree()
    a, _ = tree.insert([1, 2, 3, 4, 5], 4)
    computed(tree, a)
    v = tree.version
    assert tree.extend(a, [6, 7, 8, 9]) is a and len(a.chunks) == 3 and tree.version == v
    tree.insert([1, 2, 7], 2)  # splits a after [1, 2] and adds a child
    assert tree.version > v
    tree.check_integrity()


def test_frontier_shortcut_agrees_with_the_path_walk():
    tree = make_tree()
    a, _ = tree.insert(list(range(10)), 9)
    tree.mark_computed(a, 6)
    b, matched = tree.insert(list(range(6)) + [50, 51], 7)  # splits a at 6: b's parent computed
    assert matched == 6 and tree.frontier(b) == (6, b) and tree.frontier(a) == (6, a)
    tree.mark_computed(b, 7)
    assert tree.frontier(b) == (7, b) and b.num_computed == 1
    tree.check_integrity()


def test_pending_tokens_match_nothing_until_resolved():
    """Overlapped scheduling puts a sampled token in the tree before its value is known."""
    tree = make_tree()
    prompt, _ = tree.insert([1, 2, 3, 4, 5], 4)
    assert tree.insert([1, 2, 3, 4, 5], 5)[0] is prompt  # a second sample holds the same leaf
    computed(tree, prompt)
    a = tree.extend(prompt, [PENDING])  # a fork whose first token is pending: not listed
    assert a is not prompt and not a.listed and (DEFAULT, PENDING) not in prompt.index
    tree.check_integrity()
    tree.resolve(a, 5, 9)
    assert a.listed and prompt.index[DEFAULT, 9] is a and a.tokens == [9]
    a = tree.extend(a, [PENDING])  # in place: the first token is real, the listing stands
    assert a.tokens == [9, PENDING]
    b, matched = tree.insert([1, 2, 3, 4, 5, 9, 7, 8], 7)  # matches up to the pending token
    assert matched == 6 and a.tokens == [PENDING] and not a.listed and a.parent.tokens == [9]
    tree.check_integrity()
    tree.resolve(a, 6, 7)  # the same token as b's first: b keeps the listing
    assert not a.listed and b.parent is a.parent and a.parent.index == {(DEFAULT, 7): b}
    tree.check_integrity()


# ---- partitions (tenants, cache salts) -----------------------------------------------------------

A, B, A_SALTED = Partition("a"), Partition("b"), Partition("a", "s1")


def test_partitions_never_match_each_others_nodes():
    tree = make_tree()
    a, _ = tree.insert([1, 2, 3, 4, 5, 6], 6, A)  # chunks 0, 1
    computed(tree, a)
    tree.release(a)
    b, matched = tree.insert([1, 2, 3, 4, 5, 6], 6, B)
    assert matched == 0 and b.chunks == [2, 3] and b.partition == B
    salted, matched = tree.insert([1, 2, 3, 4, 5, 6], 6, A_SALTED)
    assert matched == 0 and salted.chunks == [4, 5]
    again, matched = tree.insert([1, 2, 3, 4, 5, 6, 7], 6, A)
    assert matched == 6 and again.parent is a and a.tokens == [1, 2, 3, 4, 5, 6]
    assert set(tree.root.index) == {(A, 1), (B, 1), (A_SALTED, 1)}
    tree.check_integrity()


def test_a_public_prefix_is_read_by_every_partition_and_continued_privately():
    tree = make_tree()
    pub, _ = tree.insert([7, 7, 7, 7, 7, 7], 6, PUBLIC)  # chunks 0, 1 (slots 0-5)
    computed(tree, pub)
    tree.pin(pub)
    tree.release(pub)
    a, matched = tree.insert([7, 7, 7, 7, 7, 7, 1, 2], 7, A)
    assert matched == 6 and a.parent is pub and a.partition == A
    # no tail child across partitions: A starts a fresh chunk, never writes in chunk 1
    assert a.offset == 0 and a.chunks == [2] and pub.tail_child is None
    computed(tree, a)
    b, matched = tree.insert([7, 7, 7, 7, 7, 7, 1, 2], 7, B)
    assert matched == 6 and b.parent is pub and b.chunks == [3]  # not A's continuation
    part, matched = tree.insert([7, 7, 7, 9], 3, B)  # splits the public node for B
    assert matched == 3 and part.parent.partition == PUBLIC and part.partition == B
    tree.check_integrity()


def test_the_public_partition_reads_no_private_node():
    tree = make_tree()
    a, _ = tree.insert([1, 2, 3, 4], 4, A)
    computed(tree, a)
    pub, matched = tree.insert([1, 2, 3, 4], 4, PUBLIC)
    assert matched == 0 and pub.chunks == [1]
    computed(tree, pub)
    tree.pin(pub)
    tree.release(pub)
    tree.release(a)
    a2, matched = tree.insert([1, 2, 3, 4, 5], 4, A)  # both match 4 tokens: the public one wins
    assert matched == 4 and a2.parent is pub
    assert tree.pinned_chunks() == 1
    tree.check_integrity()
