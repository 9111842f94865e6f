"""Eviction at scale: thousands of cached nodes, the incremental LRU heap against a brute-force
reference that scans every node for each chunk it needs (the rule the heap must keep).

Both trees run the same seeded stream (insert with shared prefixes so that splits happen,
compute, decode, release, pin, unpin) and must stay identical node for node, chunk id for chunk
id; `check_integrity` (which checks the heap against a scan) runs after every operation (every
tenth in the 3,000-prompt test, where a full check of a thousand nodes costs more than the rest)."""

from __future__ import annotations

import random

import pytest
import torch

from prefixserve.bench.eviction import ScanTree  # the reference: a scan of every node per chunk
from prefixserve.kvcache.chunk_pool import ChunkPool, OutOfChunks
from prefixserve.kvcache.prefix_tree import Partition, PrefixTree


def make(cls, num_chunks: int, chunk_size: int) -> PrefixTree:
    return cls(ChunkPool(1, num_chunks, chunk_size, 1, 1, torch.float32, torch.device("cpu")))


def snapshot(tree: PrefixTree) -> tuple:
    nodes = [(n.id, n.parent.id, n.last_use, n.ref, n.pins, n.num_computed, n.offset, n.listed,
              tuple(n.tokens), n.chunk_tuple()) for n in tree.iter_nodes()]
    return nodes, tree.pool.free_ids()


class Stream:
    """One seeded operation stream applied to several trees at once (leaves named by node id,
    the same in every tree while they agree)."""

    def __init__(self, trees: list[PrefixTree], seed: int, families: int, partitions: int):
        self.trees, self.rng = trees, random.Random(seed)
        self.families = [[self.rng.randrange(1, 50) for _ in range(self.rng.randint(1, 7))] for _ in range(families)]
        self.partitions = [Partition(f"t{i}") for i in range(partitions)]
        self.running: list[int] = []  # held leaves (node ids), one per holder
        self.pinned: list[int] = []  # pinned leaves, one per pin
        self.serial = 0  # makes every prompt distinct
        self.max_nodes = 0

    def apply(self, op) -> list:
        """`op(tree)` on every tree; each must give the same answer (or the same exception)."""
        out = []
        for tree in self.trees:
            try:
                out.append(op(tree))
            except OutOfChunks:
                out.append(OutOfChunks)
        assert all(o == out[0] for o in out), out
        return out[0]

    def add(self) -> None:
        self.serial += 1
        prompt = self.rng.choice(self.families) + [1000 + self.serial] + [self.rng.randrange(1, 50)
                                                                         for _ in range(self.rng.randint(0, 5))]
        part, upto = self.rng.choice(self.partitions), self.rng.choice([None, None, self.rng.randrange(len(prompt))])

        def op(tree):
            leaf, matched = tree.insert(prompt, len(prompt) - 1, part)
            tree.mark_computed(leaf, leaf.end if upto is None else upto)
            return leaf.id, matched
        got = self.apply(op)
        if got is not OutOfChunks:
            self.running.append(got[0])

    def step(self) -> None:
        i = self.rng.randrange(len(self.running))
        token = self.rng.randrange(1, 50)

        def op(tree):
            leaf = tree.nodes[self.running[i]]
            tree.mark_computed(leaf, leaf.end)
            return tree.extend(leaf, [token]).id
        got = self.apply(op)
        if got is OutOfChunks:
            self.release(i)
        else:
            self.running[i] = got

    def release(self, i: int) -> None:
        leaf_id = self.running.pop(i)
        self.apply(lambda tree: tree.release(tree.nodes[leaf_id]))

    def pin(self) -> None:
        leaf_id = self.rng.choice(self.running)

        def op(tree):
            leaf = tree.nodes[leaf_id]
            tree.mark_computed(leaf, leaf.end)
            tree.pin(leaf)
        self.apply(op)
        self.pinned.append(leaf_id)

    def unpin(self) -> None:
        leaf_id = self.pinned.pop(self.rng.randrange(len(self.pinned)))
        self.apply(lambda tree: tree.unpin(tree.nodes[leaf_id]))

    def run(self, ops: int, weights: dict[str, int], max_running: int) -> None:
        names, w = list(weights), list(weights.values())
        for _ in range(ops):
            op = self.rng.choices(names, w)[0]
            if op == "add" or not self.running:
                self.add()
            elif op == "release" or len(self.running) > max_running:
                self.release(self.rng.randrange(len(self.running)))
            elif op == "step":
                self.step()
            elif op == "pin" and len(self.pinned) < 8:
                self.pin()
            elif op == "unpin" and self.pinned:
                self.unpin()
            self.check()

    def check(self, integrity: bool = True) -> None:
        tree, *others = self.trees
        if integrity:
            tree.check_integrity()
        self.max_nodes = max(self.max_nodes, len(tree.nodes))
        for other in others:
            assert snapshot(other) == snapshot(tree)


def test_three_thousand_prompts_through_a_full_pool_evict_as_the_scan_does():
    """3,000 distinct prompts, each released once it is computed: the pool fills with about a
    thousand cached leaves, then every insert evicts the least recently used ones."""
    s = Stream([make(PrefixTree, 1400, 4), make(ScanTree, 1400, 4)], seed=0, families=40, partitions=2)
    for i in range(3000):
        s.add()
        s.release(len(s.running) - 1)
        s.check(integrity=i % 10 == 9)
    assert s.max_nodes >= 1000 and s.trees[1].evicted >= 1000, (s.max_nodes, s.trees[1].evicted)


@pytest.mark.parametrize("seed,chunk_size,num_chunks", [(1, 1, 300), (2, 3, 400), (3, 4, 400)])
def test_random_insert_release_pin_unpin_split_streams_match_the_scan(seed, chunk_size, num_chunks):
    s = Stream([make(PrefixTree, num_chunks, chunk_size), make(ScanTree, num_chunks, chunk_size)], seed,
               families=12, partitions=3)
    s.run(1500, {"add": 5, "release": 3, "step": 4, "pin": 1, "unpin": 1}, max_running=40)
    assert s.max_nodes >= 80 and s.trees[1].evicted >= 100, (s.max_nodes, s.trees[1].evicted)
