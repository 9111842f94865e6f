"""The prefix tree over the chunk pool: every running sequence is a root-to-leaf path.

Nodes hold token ids and the chunks that store their K/V. A node's token j sits at slot
`offset + j` of its chunk list (see attention/base.py for the picture). A new node starts at
slot 0 of a fresh chunk, except one child per node, its *tail child*, which continues inside
the parent's partly filled last chunk (offset > 0). So splitting a node at any token needs no
copy, and the waste is at most one partial chunk per node.

Ownership. Each allocated chunk is owned by exactly one node: a node owns `chunks[1:]` when it
is a tail child (its first chunk is the parent's last) and all its chunks otherwise.

References. `ref` counts the holders (running sequences) whose path passes through the node;
`pins` counts pinned prefixes ending at or below it. A node with ref == 0 and pins == 0 is
*cached*: with prefix caching on it stays, truncated to its computed tokens, until evicted
least-recently-used when a chunk is needed; with caching off it is freed at once.

Eviction. The victim is always the cached *leaf* (no ref, no pins, no children) with the
smallest (last_use, id): `last_use` is the clock of the last ref change on the node's path.
A heap of (last_use, id) holds every evictable leaf, pushed when it becomes one; entries are
never removed in place, but checked on pop (the node may be gone, referenced, pinned or have a
child since; its key cannot change while it stays evictable). Only two events make a leaf
evictable: `_cleanup` keeping a trimmed leaf (release, unpin) and an eviction leaving its parent
childless. So an allocation costs O(victims x log heap), not a scan of every node per chunk.

Matching is automatic and at token granularity. Tokens are matched whether computed or not
(in-batch sharing: a request admitted beside another with the same prefix waits for it rather
than computing the prefix again); the scheduler derives what is computed from `num_computed`.

Partitions (tenancy). Every node belongs to one `Partition` (tenant, cache salt). A sequence
matches, splits and shares only nodes of its own partition and nodes of the `PUBLIC` one (made
by public pins: the operator's choice to share). So below the root and below a public node,
children are indexed by (partition, first token); a node's children are all of its partition
unless it is public. A child never continues inside a chunk of another partition (no tail child
across partitions): two partitions share storage, prefill and decode reads only through public
nodes. What remains shared across partitions is the pool itself: LRU eviction is global.

Pending tokens. A token sampled on the device but not yet read by the host (overlapped
scheduling) is held as `PENDING` (only ever a path's last token) and set by `resolve` once
read. PENDING matches no real token, and a node that starts with it is not listed in its
parent's index until resolved.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

from .chunk_pool import ChunkPool, OutOfChunks

PENDING = -1  # a token whose value is still on the device (never a real token id)


class Partition(NamedTuple):
    """Who may share a prefix: sequences of one partition, and anyone through PUBLIC nodes."""

    tenant: str | None  # None only for PUBLIC
    salt: str = ""


PUBLIC = Partition(None)
DEFAULT = Partition("")  # the single tenant of a server without tenants, and of `LLM`


class Node:
    __slots__ = ("id", "parent", "children", "index", "tokens", "offset", "_chunks", "_chunk_tuple",
                 "pos_start", "num_computed", "ref", "pins", "last_use", "tail_child", "listed", "partition")

    def __init__(self, node_id: int, parent: Node | None, tokens: list[int], offset: int,
                 chunks: list[int], pos_start: int, partition: Partition = PUBLIC):
        self.id, self.parent, self.tokens, self.partition = node_id, parent, tokens, partition
        self.offset, self.chunks, self.pos_start = offset, chunks, pos_start
        self.children: list[Node] = []
        self.index: dict[tuple[Partition, int], Node] = {}  # (partition, first token) -> listed child
        self.num_computed = self.ref = self.pins = self.last_use = 0
        self.tail_child: Node | None = None
        self.listed = True

    @property
    def up(self) -> Node:
        """The parent of a node in the tree: every node but the (virtual) root has one."""
        assert self.parent is not None, "the root has no parent"
        return self.parent

    @property
    def chunks(self) -> list[int]:
        return self._chunks

    @chunks.setter
    def chunks(self, value: list[int]) -> None:
        self._chunks = value
        self._chunk_tuple: tuple[int, ...] = ()

    def chunk_tuple(self) -> tuple[int, ...]:
        """`chunks` as a tuple, rebuilt only when they changed (they only grow in place): the
        attention batch of every step names them, once per sequence below this node."""
        if len(self._chunk_tuple) != len(self._chunks):
            self._chunk_tuple = tuple(self._chunks)
        return self._chunk_tuple

    @property
    def key(self) -> tuple[Partition, int]:
        """This node's key in its parent's index."""
        return self.partition, self.tokens[0]

    @property
    def end(self) -> int:
        return self.pos_start + len(self.tokens)

    @property
    def owned_chunks(self) -> list[int]:
        return self.chunks[1:] if self.offset else self.chunks

    def slot(self, j: int, chunk_size: int) -> int:
        """Flat cache slot of token j of this node."""
        s = self.offset + j
        return self.chunks[s // chunk_size] * chunk_size + s % chunk_size

    def __repr__(self) -> str:
        return f"Node({self.id}, pos={self.pos_start}, len={len(self.tokens)}, ref={self.ref})"


class PathSegment(NamedTuple):
    """The first `length` tokens of one node of a path, as attention reads them (attention/base.py's
    `Segment` plus `pinned`): token j of the node sits at slot `offset + j` of `chunks`."""

    node_id: int
    pos_start: int
    length: int
    chunks: tuple[int, ...]
    offset: int
    pinned: bool  # the node is on a pinned path

    def slots(self, start: int, chunk_size: int) -> list[int]:
        """Flat cache slots of the segment's tokens at positions >= `start`, in position order."""
        C, chunks = chunk_size, self.chunks
        first = self.offset + max(0, start - self.pos_start)
        return [chunks[s // C] * C + s % C for s in range(first, self.offset + self.length)]


def _num_chunks(offset: int, length: int, chunk_size: int) -> int:
    return -(-(offset + length) // chunk_size)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class PrefixTree:
    def __init__(self, pool: ChunkPool, enable_caching: bool = True):
        self.pool, self.caching = pool, enable_caching
        self.C = pool.chunk_size
        self.root = Node(0, None, [], 0, [], 0)
        self.nodes: dict[int, Node] = {}
        self._holders: Counter[Node] = Counter()
        self._lru: list[tuple[int, int]] = []  # a heap of (last_use, id): every evictable leaf, and stale entries
        self._next_id, self._clock = 1, 0
        self.version = 0  # bumped when a node is added, split, trimmed or removed (not extended)

    # ---- paths ---------------------------------------------------------------------------
    def path(self, leaf: Node) -> list[Node]:
        """Root-first nodes from a root child down to `leaf` (the virtual root excluded)."""
        out = []
        while leaf is not self.root:
            out.append(leaf)
            leaf = leaf.up
        return out[::-1]

    def segments(self, leaf: Node, end: int) -> list[PathSegment]:
        """What attention reads of the path to `leaf` up to position `end` (exclusive): one
        segment per node that starts before `end`, root first, the last one cut at `end`."""
        out = []
        for node in self.path(leaf):
            if node.pos_start >= end:
                break
            out.append(PathSegment(node.id, node.pos_start, min(len(node.tokens), end - node.pos_start),
                                   node.chunk_tuple(), node.offset, node.pins > 0))
        return out

    def slot(self, leaf: Node, pos: int) -> int:
        """Flat cache slot of the token at path position `pos`, which lies in `leaf`."""
        return leaf.slot(pos - leaf.pos_start, self.C)

    def frontier(self, leaf: Node) -> tuple[int, Node | None]:
        """(number of leading path tokens computed, the first node not fully computed).
        O(1) once the leaf has computed tokens: its ancestors are then complete (invariant)."""
        if leaf.num_computed:
            done = leaf.num_computed == len(leaf.tokens)
            return (leaf.end, None) if done else (leaf.pos_start + leaf.num_computed, leaf)
        for node in self.path(leaf):
            if node.num_computed < len(node.tokens):
                return node.pos_start + node.num_computed, node
        return leaf.end, None

    def mark_computed(self, leaf: Node, upto: int) -> None:
        """Path tokens at positions < upto now have their K/V written. Tokens are computed in
        path order, so a node with computed tokens has complete ancestors: the walk up from the
        leaf stops at the first node that already had what it gets."""
        node = leaf
        while node is not self.root:
            if node.pos_start < upto:
                new = min(len(node.tokens), upto - node.pos_start)
                if node.num_computed >= new:
                    break
                node.num_computed = new
            node = node.up

    # ---- admission and growth ----------------------------------------------------------------
    def insert(self, tokens: list[int], match_limit: int,
               partition: Partition = DEFAULT) -> tuple[Node, int]:
        """Hold a path spelling `tokens` in `partition`, reusing at most `match_limit` leading
        tokens already in the tree (in that partition or public). Returns (leaf, number of tokens
        matched). Raises OutOfChunks, holding nothing."""
        node, matched = (self._match(tokens[:match_limit], partition, split=True) if self.caching
                         else (self.root, 0))
        self._acquire(node)
        if matched == len(tokens):
            return node, matched
        try:
            leaf = self._add_child(node, tokens[matched:], partition)
        except OutOfChunks:
            self.release(node)
            raise
        self._move_holder(node, leaf)
        return leaf, matched

    def hold(self, leaf: Node) -> Node:
        """One more holder of the (held) path to `leaf`: a sample that forks from a sibling's
        prompt. -> leaf."""
        self._acquire(leaf)
        return leaf

    def extend(self, leaf: Node, tokens: list[int]) -> Node:
        """Append tokens to a held path; returns its (possibly new) leaf. Raises OutOfChunks."""
        if leaf is self.root or leaf.children or leaf.ref > 1 or leaf.pins:
            child = self._add_child(leaf, tokens, leaf.partition)
            self._move_holder(leaf, child)
            return child
        need = _num_chunks(leaf.offset, len(leaf.tokens) + len(tokens), self.C) - len(leaf.chunks)
        if need:
            leaf.chunks.extend(self._alloc_many(need))
        leaf.tokens.extend(tokens)
        return leaf

    def resolve(self, leaf: Node, pos: int, token: int) -> None:
        """The PENDING token at path position `pos` (in `leaf`, the path's last) is `token`."""
        j = pos - leaf.pos_start
        assert leaf.tokens[j] == PENDING, (leaf, pos)
        leaf.tokens[j] = token
        if j == 0 and leaf.key not in leaf.up.index:
            leaf.up.index[leaf.key] = leaf
            leaf.listed = True

    def release(self, leaf: Node) -> None:
        """A holder of `leaf` is gone (finished, aborted, preempted)."""
        self._holders[leaf] -= 1
        if not self._holders[leaf]:
            del self._holders[leaf]
        self._add_ref(leaf, -1)
        self._cleanup(leaf)

    # ---- pinning ---------------------------------------------------------------------------
    def pin(self, leaf: Node) -> None:
        """Keep the path to `leaf` (held, fully computed) until `unpin(leaf)`. The leaf object
        stays the pin's end: a split keeps the lower part's identity."""
        for node in self.path(leaf):
            node.pins += 1

    def unpin(self, leaf: Node) -> None:
        assert leaf.pins > 0, leaf
        for n in self.path(leaf):
            n.pins -= 1
        self._cleanup(leaf)

    def pinned_chunks(self) -> int:
        """Chunks owned by pinned nodes: memory no sequence can get back by eviction."""
        return sum(len(n.owned_chunks) for n in self.nodes.values() if n.pins)

    # ---- internals ---------------------------------------------------------------------------
    def _match(self, tokens: list[int], partition: Partition, split: bool) -> tuple[Node, int]:
        node, i = self.root, 0
        while i < len(tokens):
            child, k = self._best_child(node, tokens[i:], partition)
            if child is None:
                break
            if k < len(child.tokens):
                if split:
                    node, i = self._split(child, k), i + k
                break
            node, i = child, i + k
        return node, i

    def _best_child(self, node: Node, tokens: list[int], partition: Partition) -> tuple[Node | None, int]:
        """The child of `node` that `partition` may read and that matches the most of `tokens`
        (its own or a public one; a tie goes to the public one), and how many it matches."""
        best, best_k = None, 0
        for part in (partition, PUBLIC) if partition != PUBLIC else (PUBLIC,):
            child = node.index.get((part, tokens[0]))
            k = _common_prefix(child.tokens, tokens) if child is not None else 0
            if k and k >= best_k:
                best, best_k = child, k
        return best, best_k

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after its k-th token; the new upper node is returned, `node` keeps the rest
        (so the leaf pointers that holders keep stay valid)."""
        parent, C, cut = node.up, self.C, node.offset + k
        up = self._new_node(parent, node.tokens[:k], node.offset, node.chunks[:(cut - 1) // C + 1],
                            node.pos_start, node.partition, listed=node.listed, register=False)
        up.num_computed, up.ref, up.pins, up.last_use = min(k, node.num_computed), node.ref, node.pins, node.last_use
        parent.children[parent.children.index(node)] = up
        if node.listed:
            parent.index[node.key] = up
        if parent.tail_child is node:
            parent.tail_child = up
        node.tokens, node.chunks, node.offset = node.tokens[k:], node.chunks[cut // C:], cut % C
        node.pos_start += k
        node.num_computed = max(0, node.num_computed - k)
        node.parent, node.listed = up, node.tokens[0] != PENDING
        up.children, up.index = [node], {node.key: node} if node.listed else {}
        up.tail_child = node if node.offset else None
        return up

    def _add_child(self, parent: Node, tokens: list[int], partition: Partition) -> Node:
        assert parent.partition in (partition, PUBLIC), (parent, partition)
        end_slot = parent.offset + len(parent.tokens)
        tail = (parent is not self.root and parent.tail_child is None and end_slot % self.C != 0
                and parent.partition == partition)
        offset = end_slot % self.C if tail else 0
        chunks = [parent.chunks[-1]] if tail else []
        chunks += self._alloc_many(_num_chunks(offset, len(tokens), self.C) - len(chunks))
        listed = tokens[0] != PENDING and (partition, tokens[0]) not in parent.index
        node = self._new_node(parent, list(tokens), offset, chunks, parent.end, partition,
                              listed=listed, register=True)
        if tail:
            parent.tail_child = node
        return node

    def _new_node(self, parent: Node, tokens: list[int], offset: int, chunks: list[int], pos_start: int,
                  partition: Partition, listed: bool, register: bool) -> Node:
        node = Node(self._next_id, parent, tokens, offset, chunks, pos_start, partition)
        self._next_id += 1
        self.version += 1
        self.nodes[node.id] = node
        node.listed = listed
        if register:
            parent.children.append(node)
            if listed:
                parent.index[node.key] = node
        return node

    def _alloc_many(self, n: int) -> list[int]:
        """n chunks: the free ones first, then what one `evict` frees. Raises OutOfChunks with
        the free stack as it was (the evictions stay)."""
        got = [self.pool.allocate() for _ in range(min(n, self.pool.num_free))]
        if len(got) < n and self.evict(n - len(got)) < n - len(got):
            for c in reversed(got):  # restores the free stack exactly
                self.pool.free(c)
            raise OutOfChunks
        return got + [self.pool.allocate() for _ in range(n - len(got))]

    def evict(self, n: int) -> int:
        """Evict cached leaves, least recently used first, until they freed n chunks or none is
        left; returns the chunks freed. A parent left childless is a candidate in its turn. The
        chunks go back to the pool last victim first, so it hands out the first victim's first."""
        victims, freed = [], 0
        while freed < n and (node := self._pop_lru()) is not None:
            self._unlink(node)
            victims.append(node)
            freed += len(node.owned_chunks)
            self._queue_if_evictable(node.up)
        for node in reversed(victims):
            for c in node.owned_chunks:
                self.pool.free(c)
        return freed

    @staticmethod
    def _evictable(node: Node) -> bool:
        return not (node.ref or node.pins or node.children)

    def _queue_if_evictable(self, node: Node) -> None:
        """Push `node` on the LRU heap if it is an evictable leaf; rebuild the heap by a scan
        once stale entries outnumber the nodes (amortised O(1) per push)."""
        if node is self.root or not self._evictable(node):
            return
        heapq.heappush(self._lru, (node.last_use, node.id))
        if len(self._lru) > 2 * len(self.nodes) + 64:
            self._lru = [(n.last_use, n.id) for n in self.nodes.values() if self._evictable(n)]
            heapq.heapify(self._lru)

    def _pop_lru(self) -> Node | None:
        """The least recently used evictable leaf, off the heap; stale entries are dropped."""
        while self._lru:
            last_use, node_id = heapq.heappop(self._lru)
            node = self.nodes.get(node_id)
            if node is not None and node.last_use == last_use and self._evictable(node):
                return node
        return None

    def _remove(self, node: Node) -> None:
        for c in node.owned_chunks:
            self.pool.free(c)
        self._unlink(node)

    def _unlink(self, node: Node) -> None:
        """Take `node` out of the tree, leaving its chunks to the caller."""
        self.version += 1
        parent = node.up
        parent.children.remove(node)
        if node.listed:
            del parent.index[node.key]
        if parent.tail_child is node:
            parent.tail_child = None
        del self.nodes[node.id]

    def _truncate(self, node: Node, n: int) -> None:
        self.version += 1
        keep = _num_chunks(node.offset, n, self.C)
        for c in node.chunks[keep:]:
            self.pool.free(c)
        node.tokens, node.chunks = node.tokens[:n], node.chunks[:keep]

    def _cleanup(self, node: Node) -> None:
        """Free or trim the unreferenced, unpinned, childless nodes from `node` upwards."""
        while node is not self.root:
            parent = node.up
            if node.ref or node.pins or node.children:
                break
            if self.caching and node.listed and node.num_computed:
                self._truncate(node, node.num_computed)
                self._queue_if_evictable(node)
                break
            self._remove(node)
            node = parent

    def _acquire(self, leaf: Node) -> None:
        self._holders[leaf] += 1
        self._add_ref(leaf, +1)

    def _move_holder(self, old: Node, new: Node) -> None:
        """The holder of `old` now holds `new`, a child of `old`."""
        self._holders[old] -= 1
        if not self._holders[old]:
            del self._holders[old]
        self._holders[new] += 1
        new.ref += 1
        new.last_use = self._clock

    def _add_ref(self, leaf: Node, delta: int) -> None:
        self._clock += 1
        for node in self.path(leaf):
            node.ref += delta
            node.last_use = self._clock

    # ---- accounting ----------------------------------------------------------------------------
    def iter_nodes(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def chunk_counts(self) -> dict[str, int]:
        """Chunks by state: in use (referenced or pinned), cached, free."""
        used = cached = 0
        for n in self.nodes.values():  # one pass, no list slicing: benchmarks call this every step
            owned = len(n.chunks) - (n.offset > 0)
            if n.ref or n.pins:
                used += owned
            else:
                cached += owned
        return {"in_use": used, "cached": cached, "free": self.pool.num_free}

    def check_integrity(self) -> None:
        """The contract: free + cached + in use == total; each chunk on one node or free; every
        refcount equals the holders below it; layout, tail and index invariants hold."""
        owners = Counter(c for n in self.nodes.values() for c in n.owned_chunks)
        free = Counter(self.pool.free_ids())
        assert all(v == 1 for v in owners.values()), "a chunk is owned by two nodes"
        assert all(v == 1 for v in free.values()), "a chunk is twice on the free list"
        assert not (set(owners) & set(free)), "a chunk is both free and owned"
        assert len(owners) + len(free) == self.pool.num_chunks, "chunks leaked"
        below: Counter[int] = Counter()
        for leaf, count in self._holders.items():
            assert count > 0
            for node in self.path(leaf):
                below[node.id] += count
        for node in self.nodes.values():
            self._check_node(node, below[node.id])
        self._check_lru()

    def _check_lru(self) -> None:
        """The heap holds every evictable leaf (found by a scan) under its current key, in heap
        order: so its first live entry is the scan's least recently used leaf."""
        leaves = {(n.last_use, n.id) for n in self.nodes.values() if self._evictable(n)}
        missing = leaves - set(self._lru)
        assert not missing, f"evictable leaves missing from the LRU heap: {sorted(missing)[:5]}"
        h = self._lru
        assert all(h[(i - 1) // 2] <= h[i] for i in range(1, len(h))), "the LRU heap is out of order"

    def _check_node(self, node: Node, holders: int) -> None:
        assert node.ref == holders, f"{node} ref {node.ref} != holders {holders}"
        assert self.nodes.get(node.id) is node and node.parent is not None
        assert node.tokens and 0 <= node.num_computed <= len(node.tokens)
        assert len(node.chunks) == _num_chunks(node.offset, len(node.tokens), self.C)
        assert node.pos_start == node.parent.end
        parent = node.parent
        assert not node.num_computed or parent is self.root or parent.num_computed == len(parent.tokens), \
            f"{node} has computed tokens below the incomplete {parent}"
        assert node in node.parent.children
        if node.offset:
            assert node.parent.tail_child is node and node.parent.chunks[-1] == node.chunks[0]
        if node.listed:
            assert node.parent.index[node.key] is node
        assert parent.partition in (node.partition, PUBLIC), f"{node} crosses from {parent.partition}"
        assert not node.offset or parent.partition == node.partition, f"{node} writes in another partition's chunk"
        if not (node.ref or node.pins):
            assert self.caching, "caching off, yet an unreferenced node survives"
            assert node.num_computed == len(node.tokens) or node.children
        for child in node.children:
            assert child.parent is node
