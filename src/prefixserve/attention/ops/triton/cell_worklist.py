"""Work of the cell kernel (deterministic mode): the host half, numpy only.

A cell schedule's item is query rows x the keys of one cell (attention/cells.py). On the GPU
its keys are walked in tiles of BLOCK_N *positions* -- tile t holds positions
[t * BLOCK_N, (t + 1) * BLOCK_N), wherever they are stored -- so that a (row, cell) partial is
the same chain of tile updates (online softmax: m, l, acc) in every schedule. A tile's keys may
sit in several chunks (a node that ends inside it, a child that starts a new chunk), so each
tile gets its keys' flat slots, lane by lane:

    tile_slots [Tt, BLOCK_N] int32   flat slot of position tile_pos[t] + lane, -1 where absent
    tile_pos   [Tt] int32            the tile's first position (a multiple of BLOCK_N)
    segs       [S, 4] int32          t0, t1, out_row, flags: one cell's tiles [t0, t1) for a
                                     unit's rows, partial rows from out_row (row j: out_row + j)
    units      [U, 4] int32          q_start, q_len, s0, s1: a block of rows x segments [s0, s1)

Shared tiles of split cells. A shared prefix that ends inside a cell leaves that cell to each
sequence (its keys differ past the prefix). Its leading tiles, though, are often the same
slots for many items of the cell: those tiles' updates are computed once for all their rows
(a *prefix* segment, flag STORE: the raw m, l, acc go to the rows' partial slots), and each
item continues from that state (flag LOAD) with its own tiles. Same updates in the same order
on the same fp32 state, so the same bits; the prefix units run in a launch before the others.

Launch classes. Prefix units and wide units (rows x G > NARROW_ROWS) run in 64-row tiles; the
rest (decode tails) in 16-row tiles, one unit per row chaining its cells' segments. A tile's
products are the same whatever its shape, and so is a row's sum of P across a tile as long as
each warp holds whole 16-row slices (`cells.cell_configs`; measured on an H100). Every row's
partials are merged, in cell order, by the merge launch (`merge_indptr` / `merge_parts`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .configs import NARROW_ROWS
from .worklist import _csr, needs_causal

LOAD, STORE = 1, 2  # segment flags: start from the stored state; store the state, not the partial


@dataclasses.dataclass(frozen=True)
class CellWork:
    tile_slots: np.ndarray  # [Tt, BLOCK_N]
    tile_pos: np.ndarray  # [Tt]
    segs: np.ndarray  # [S, 4]
    units: tuple[np.ndarray, np.ndarray, np.ndarray]  # [U, 4] each: prefix, wide, narrow (longest first)
    causal: bool  # some row precedes a key of its unit's cell (a decode step: never)
    merge_indptr: np.ndarray  # [R + 1]: final row -> partial rows (cell order)
    merge_parts: np.ndarray  # [M]


def tile_keys(item_kv_indptr: np.ndarray, kv_chunk: np.ndarray, kv_lo: np.ndarray, kv_hi: np.ndarray,
              kv_pos: np.ndarray, chunk_size: int, block_n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every item's keys as position tiles -> (tile_slots, tile_pos, item_tiles [I+1] CSR).
    Entries hold consecutive positions in consecutive slots of one chunk, in position order
    within their item."""
    n_items = len(item_kv_indptr) - 1
    count = kv_hi - kv_lo  # [E] keys per entry
    item_of_entry = np.repeat(np.arange(n_items), np.diff(item_kv_indptr))
    key_entry = np.repeat(np.arange(len(count)), count)  # [K]: key -> entry
    within = np.arange(int(count.sum())) - np.repeat(_csr(count)[:-1], count)
    pos = kv_pos[key_entry] + within  # [K]
    slot = (kv_chunk[key_entry] * chunk_size + kv_lo[key_entry] + within)
    tile = pos // block_n
    item = item_of_entry[key_entry]
    # a new tile wherever the (item, tile) pair changes (keys are in item, then position, order)
    start = np.ones(len(pos), dtype=bool)
    start[1:] = (item[1:] != item[:-1]) | (tile[1:] != tile[:-1])
    tile_id = np.cumsum(start) - 1  # [K]
    tile_slots = np.full((int(start.sum()), block_n), -1, dtype=np.int64)
    tile_slots[tile_id, pos % block_n] = slot
    tile_pos = tile[start] * block_n
    item_tiles = _csr(np.bincount(item[start], minlength=n_items))
    return tile_slots, tile_pos, item_tiles


def newest_tiles(tile_slots: np.ndarray, slots: np.ndarray, q_pos: np.ndarray, causal: bool) -> np.ndarray | None:
    """[R]: the tile holding each row's newest key (slot `slots[r]` at position q_pos[r]), where
    the next decode step puts its next key unless that opens a tile; None if some row has none
    (a prefill step: then no decode step advances this plan)."""
    if causal or len(slots) == 0 or len(tile_slots) == 0:
        return None
    flat = tile_slots.reshape(-1)
    where = np.full(int(max(flat.max(), slots.max())) + 1, -1, np.int64)
    held = np.flatnonzero(flat >= 0)
    where[flat[held]] = held  # a row's newest key is its own: in one tile only
    at = where[slots]
    block_n = tile_slots.shape[1]
    if (at < 0).any() or (at % block_n != q_pos % block_n).any():
        return None
    tiles: np.ndarray = at // block_n
    return tiles


def shared_tiles(tile_slots: np.ndarray, tile_pos: np.ndarray, t0: np.ndarray,
                 t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items' leading tiles shared with others -> (common [I], group [I]). A group: the items
    whose first tiles are equal (positions and the slot in every lane; so they read one cell);
    `common`: how many leading tiles every item of the group has equal, 0 (and group -1) for an
    item alone."""
    common = np.zeros(len(t0), np.int64)
    groups = np.full(len(t0), -1, np.int64)
    has = np.flatnonzero(t1 > t0)
    if len(has) < 2:
        return common, groups
    first = np.concatenate([tile_pos[t0[has], None], tile_slots[t0[has]]], axis=1)
    _, inverse, size = np.unique(first, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    for g in np.flatnonzero(size > 1):
        members = has[inverse == g]
        length, n = int((t1[members] - t0[members]).min()), 1
        while n < length:
            a, b = t0[members] + n, t0[members[0]] + n
            if not ((tile_slots[a] == tile_slots[b]).all() and (tile_pos[a] == tile_pos[b]).all()):
                break
            n += 1
        common[members], groups[members] = n, g
    return common, groups


def build_cell_work(a: dict[str, np.ndarray | None], wide_rows: int, group: int,
                    chunk_size: int, block_n: int, num_out_rows: int) -> CellWork:
    """The cell kernel's work for a plan's host arrays `a` (plan.index_arrays); wide_rows: the
    wide tile's M (query rows x G)."""
    def req(name: str) -> np.ndarray:
        x = a[name]
        assert x is not None, name
        return x

    q_start, q_len, out_start = req("item_q_start"), req("item_q_len"), req("item_out_start")
    indptr, kv_pos, q_pos = req("item_kv_indptr"), req("kv_pos"), req("q_pos")
    tile_slots, tile_pos, item_tiles = tile_keys(indptr, req("kv_chunk"), req("kv_lo"), req("kv_hi"),
                                                 kv_pos, chunk_size, block_n)
    items = np.stack([q_start, q_len, indptr[:-1], indptr[1:]], axis=1)  # the shape needs_causal reads
    causal = needs_causal(items, q_pos, kv_pos, req("kv_lo"), req("kv_hi"))
    t0, t1 = item_tiles[:-1], item_tiles[1:]
    rows = max(1, wide_rows // group)
    common, groups = shared_tiles(tile_slots, tile_pos, t0, t1)
    prefix = _prefix_segments(q_start, q_len, out_start, t0, common, groups, rows)  # zeroes lone items' common
    start = t0 + common
    flags = np.where(common > 0, LOAD, 0)
    narrow = q_len * group <= NARROW_ROWS
    wide = _row_blocks(q_start, q_len, out_start, start, t1, flags, np.flatnonzero(~narrow), rows)
    chained = _chains(q_start, q_len, out_start, start, t1, flags, np.flatnonzero(narrow))
    segs, units = _assemble([prefix, wide, chained])
    ptr, parts = a["row_indptr"], a["row_parts"]
    if ptr is None or parts is None:  # one partial per row, at the row's own index
        ptr = np.minimum(np.arange(len(q_pos) + 1), num_out_rows)
        parts = np.arange(num_out_rows)
    return CellWork(tile_slots, tile_pos, segs, units, causal, ptr, parts)


Work = tuple[np.ndarray, np.ndarray, np.ndarray]  # (units' q_start, q_len [U]), segs [S, 4], seg_indptr [U + 1]


def _row_blocks(q_start: np.ndarray, q_len: np.ndarray, out: np.ndarray, t0: np.ndarray, t1: np.ndarray,
                flags: np.ndarray, sel: np.ndarray, rows: int) -> Work:
    """Items `sel` in blocks of `rows` query rows, a unit of one segment each."""
    blocks = -(-q_len[sel] // rows)
    item = np.repeat(sel, blocks)
    first = (np.arange(int(blocks.sum())) - np.repeat(_csr(blocks)[:-1], blocks)) * rows
    units = np.stack([q_start[item] + first, np.minimum(rows, q_len[item] - first)], axis=1)
    segs = np.stack([t0[item], t1[item], out[item] + first, flags[item]], axis=1)
    return units, segs, np.arange(len(item) + 1)


def _prefix_segments(q_start: np.ndarray, q_len: np.ndarray, out: np.ndarray, t0: np.ndarray,
                     common: np.ndarray, groups: np.ndarray, rows: int) -> Work:
    """Units computing each group's shared tiles for runs of its items whose query rows and
    partial rows both follow on (a unit's row j writes partial row out + j); an item in no run
    of two or more gets common = 0 (in place)."""
    parts: list[Work] = []
    for g in np.unique(groups[groups >= 0]):
        members = np.flatnonzero(groups == g)
        members = members[np.argsort(q_start[members], kind="stable")]
        ends_q, ends_o = q_start[members] + q_len[members], out[members] + q_len[members]
        brk = np.ones(len(members), bool)
        brk[1:] = (q_start[members[1:]] != ends_q[:-1]) | (out[members[1:]] != ends_o[:-1])
        run = np.cumsum(brk) - 1
        size = np.bincount(run)
        common[members[size[run] < 2]] = 0
        heads = members[brk][size >= 2]
        if len(heads) == 0:
            continue
        run_rows = np.bincount(run, weights=q_len[members]).astype(np.int64)[size >= 2]
        span = np.zeros(len(q_len), np.int64)
        span[heads] = run_rows
        parts.append(_row_blocks(q_start, span, out, t0, t0 + common, np.full(len(t0), STORE), heads, rows))
    if not parts:
        return np.zeros((0, 2), np.int64), np.zeros((0, 4), np.int64), np.zeros(1, np.int64)
    return _concat(parts)


def _chains(q_start: np.ndarray, q_len: np.ndarray, out: np.ndarray, t0: np.ndarray, t1: np.ndarray,
            flags: np.ndarray, sel: np.ndarray) -> Work:
    """Narrow items: one unit per row block (an item's q_start), its cells' segments in item
    (= cell) order."""
    sel = sel[np.lexsort((sel, q_start[sel]))]
    new = np.ones(len(sel), bool)
    new[1:] = q_start[sel[1:]] != q_start[sel[:-1]]
    heads = sel[new]
    units = np.stack([q_start[heads], q_len[heads]], axis=1)
    segs = np.stack([t0[sel], t1[sel], out[sel], flags[sel]], axis=1)
    return units, segs, np.append(np.flatnonzero(new), len(sel))


def _concat(parts: list[Work]) -> Work:
    offsets = np.cumsum([0] + [len(s) for _, s, _ in parts])
    indptr = np.concatenate([[0]] + [p[2][1:] + o for p, o in zip(parts, offsets, strict=False)])
    return np.concatenate([u for u, _, _ in parts]), np.concatenate([s for _, s, _ in parts]), indptr


def _assemble(classes: list[Work]) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One segment array for all classes; per class units [U, 4] (q_start, q_len, s0, s1),
    most tiles first."""
    units, segs, indptr = _concat(classes)
    u = np.concatenate([units.reshape(-1, 2), indptr[:-1, None], indptr[1:, None]], axis=1).astype(np.int64)
    tiles = np.concatenate([[0], np.cumsum(segs[:, 1] - segs[:, 0])])
    cost = tiles[u[:, 3]] - tiles[u[:, 2]]
    bounds = np.cumsum([0] + [len(c[0]) for c in classes])
    out = [u[a:b][np.argsort(-cost[a:b], kind="stable")] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return segs.reshape(-1, 4).astype(np.int64), (out[0], out[1], out[2])
