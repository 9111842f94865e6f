"""Random prefix trees laid out in a chunk pool, and the dense float64 attention oracle.

The layout follows base.py's docstring: a node starts at slot 0 of a fresh chunk, or (a
"continuation") at its parent's end offset inside the parent's last, partly filled chunk.
Chunk ids are drawn in random order from a pool whose unused slots hold NaN, so any read of
a slot that no key occupies poisons the result. Each node keeps its own K/V, from which the
oracle gathers every sequence's keys without going through the pool.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import torch

from prefixserve.attention.base import AttentionBatch, AttentionShape, Segment, SeqQueries

Draw = Callable[[int, int], int]  # draw(lo, hi): an int in [lo, hi]


@dataclasses.dataclass
class Node:
    id: int
    depth: int
    pos_start: int
    length: int
    offset: int
    chunks: list[int]
    k: torch.Tensor  # [length, Hkv, D]
    v: torch.Tensor
    parent: Node | None = None
    children: list[Node] = dataclasses.field(default_factory=list)
    continued: bool = False  # a child starts inside this node's last chunk

    def slots(self, size: int) -> list[int]:
        return [self.chunks[(self.offset + j) // size] * size + (self.offset + j) % size
                for j in range(self.length)]

    def path(self) -> list[Node]:
        return ([] if self.parent is None else self.parent.path()) + [self]


@dataclasses.dataclass
class Case:
    shape: AttentionShape
    batch: AttentionBatch
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]: the new tokens' K/V, to be written by run()
    v: torch.Tensor
    k_cache: torch.Tensor  # [N, C, Hkv, D], new-token slots NaN
    v_cache: torch.Tensor
    seq_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per sequence: its keys/values, in order


class TreeBuilder:
    def __init__(self, draw: Draw, size: int, hkv: int, d: int, dtype: torch.dtype,
                 gen: torch.Generator, max_tokens: int = 1500):
        self.draw, self.size, self.hkv, self.d = draw, size, hkv, d
        self.dtype, self.gen = dtype, gen
        self.budget = max_tokens
        self.nodes: list[Node] = []
        num_chunks = 2 * max_tokens // size + 64  # spare chunks stay NaN
        self.free = list(range(num_chunks))
        random.Random(draw(0, 2**16)).shuffle(self.free)
        shape = (num_chunks, size, hkv, d)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)

    def _length(self) -> int:
        kind = self.draw(0, 3)  # 1 token, short, medium, long (1-300), within the budget
        top = (1, 12, 80, 300)[kind]
        return max(1, min(self.draw(1, top), self.budget))

    def add(self, parent: Node | None, depth: int) -> Node:
        length = self._length()
        self.budget -= length
        pos = 0 if parent is None else parent.pos_start + parent.length
        end = 0 if parent is None else (parent.offset + parent.length) % self.size
        if parent is not None and end and not parent.continued and self.draw(0, 1):
            parent.continued, offset, chunks = True, end, [parent.chunks[-1]]
        else:
            offset, chunks = 0, []
        while len(chunks) * self.size < offset + length:
            chunks.append(self.free.pop())
        kv = [torch.randn(length, self.hkv, self.d, generator=self.gen).to(self.dtype)
              for _ in range(2)]
        node = Node(len(self.nodes), depth, pos, length, offset, chunks, *kv, parent=parent)
        slots = torch.tensor(node.slots(self.size))
        self.k_cache.view(-1, self.hkv, self.d)[slots] = node.k
        self.v_cache.view(-1, self.hkv, self.d)[slots] = node.v
        self.nodes.append(node)
        if parent is not None:
            parent.children.append(node)
        return node

    def grow(self, max_depth: int, max_nodes: int) -> None:
        """Depth-first (node ids are preorder): 1-2 roots, 0-8 children per node."""
        def visit(node: Node) -> None:
            for _ in range(self.draw(0, 8) if node.depth + 1 < max_depth else 0):
                if self.budget <= 0 or len(self.nodes) >= max_nodes:
                    return
                visit(self.add(node, node.depth + 1))
        for _ in range(self.draw(1, 2)):
            if self.budget > 0:
                visit(self.add(None, 0))


def seq_segments(path: list[Node], kv_len: int, size: int) -> tuple[Segment, ...]:
    """The segments of the first kv_len keys of `path` (the last may be a node's prefix,
    holding only the chunks it reaches)."""
    segs, left = [], kv_len
    for n in path:
        take = min(n.length, left)
        if take > 0:
            used = -(-(n.offset + take) // size)
            segs.append(Segment(n.id, n.pos_start, take, tuple(n.chunks[:used]), n.offset))
        left -= take
    return tuple(segs)


def make_case(draw: Draw, gen: torch.Generator, size: int, group: int, dtype: torch.dtype,
              prefill: bool, max_nodes: int = 14) -> Case:
    """A random tree; one sequence per leaf plus a few ending inside a node; random q."""
    hkv, d = draw(1, 2), 8 * draw(1, 2)
    tree = TreeBuilder(draw, size, hkv, d, dtype, gen)
    tree.grow(draw(1, 4), max_nodes)
    paths = [(n.path(), n.pos_start + n.length) for n in tree.nodes if not n.children]
    for _ in range(draw(0, 3)):  # sequences holding a prefix of a node (maybe interior)
        n = tree.nodes[draw(0, len(tree.nodes) - 1)]
        paths.append((n.path(), n.pos_start + draw(1, n.length)))
    paths.sort(key=lambda p: ([n.id for n in p[0]], p[1]))  # depth-first order
    q_lens = [draw(1, min(kv_len, 24)) if prefill else 1 for _, kv_len in paths]
    order = list(range(len(paths)))
    if draw(0, 3) == 0:  # query rows in an order other than the batch's
        random.Random(draw(0, 2**16)).shuffle(order)
    q_starts, row = [0] * len(paths), 0
    for i in order:
        q_starts[i], row = row, row + q_lens[i]
    seqs, seq_kv, new = [], [], [None] * row
    for (path, kv_len), qs, n in zip(paths, q_starts, q_lens, strict=True):
        segs = seq_segments(path, kv_len, size)
        slots = [s for node in path for s in node.slots(size)][:kv_len]
        k = torch.cat([node.k for node in path])[:kv_len]
        v = torch.cat([node.v for node in path])[:kv_len]
        seqs.append(SeqQueries(qs, n, kv_len - n, segs))
        seq_kv.append((k, v))
        for t in range(n):
            new[qs + t] = (slots[kv_len - n + t], k[kv_len - n + t], v[kv_len - n + t])
    slots = torch.tensor([s for s, _, _ in new], dtype=torch.int64)
    tree.k_cache.view(-1, hkv, d)[slots] = float("nan")  # run() must write them
    tree.v_cache.view(-1, hkv, d)[slots] = float("nan")
    hq = hkv * group
    scale = draw(1, 4) / math.sqrt(d)  # sharper softmax than 1/sqrt(d) sometimes
    shape = AttentionShape(hq, hkv, d, scale, dtype, torch.device("cpu"))
    q = torch.randn(row, hq, d, generator=gen).to(dtype)
    pinned = frozenset([0]) if draw(0, 2) == 0 else frozenset()  # node 0: the first root
    return Case(shape, AttentionBatch(tuple(seqs), size, slots, pinned), q,
                torch.stack([k for _, k, _ in new]), torch.stack([v for _, _, v in new]),
                tree.k_cache, tree.v_cache, seq_kv)


def dense_attention(case: Case, window: int | None = None) -> torch.Tensor:
    """float64 causal attention of every sequence over its gathered keys: [T, Hq, D]; with a
    sliding window W, a query at position p sees keys at (p - W, p]."""
    out = torch.full(case.q.shape, float("nan"), dtype=torch.float64)
    g = case.shape.num_heads // case.shape.num_kv_heads
    for s, (k, v) in zip(case.batch.seqs, case.seq_kv, strict=True):
        k, v = (x.double().repeat_interleave(g, dim=1) for x in (k, v))  # [L, Hq, D]
        q = case.q[s.q_start:s.q_start + s.q_len].double()
        scores = torch.einsum("nhd,lhd->hnl", q, k) * case.shape.scale
        visible = torch.arange(s.kv_len)[None, :] <= (s.q_pos + torch.arange(s.q_len))[:, None]
        if window is not None:
            visible &= torch.arange(s.kv_len)[None, :] > (s.q_pos + torch.arange(s.q_len))[:, None] - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[s.q_start:s.q_start + s.q_len] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out
