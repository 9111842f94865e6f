"""Work of the cell kernel (deterministic mode): the host half, numpy only.

A cell schedule's item is query rows x the keys of one cell (attention/cells.py). On the GPU
its keys are walked in tiles of BLOCK_N *positions* -- tile t holds positions
[t * BLOCK_N, (t + 1) * BLOCK_N), wherever they are stored -- so that a (row, cell) partial is
the same sequence of tile updates in every schedule. A tile's keys may sit in several chunks
(a node that ends inside it, a child that starts a new chunk), so each tile gets its keys'
flat slots, lane by lane:

    tile_slots [Tt, BLOCK_N] int32   flat slot of position tile_pos[t] + lane, -1 where absent
    tile_pos   [Tt] int32            the tile's first position (a multiple of BLOCK_N)
    units      [U, 5] int32          q_start, q_len, t0, t1, out_row: a block of one item's rows
                                     x the item's tiles [t0, t1), writing partial rows from out_row

Every unit runs in one launch shape (`CellKernels`): a tile's products are the same whatever
its shape (`prefixserve bench gemm`), but a row's sum of P across a tile (`tl.sum`) is added in
an order that follows the tile's register layout, so its shape. Cells are never split across
units, and every row's partials are merged, in cell order, by the merge launch
(`merge_indptr` / `merge_parts`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .worklist import KernelConfig, _csr, needs_causal


@dataclasses.dataclass(frozen=True)
class CellWork:
    tile_slots: np.ndarray  # [Tt, BLOCK_N]
    tile_pos: np.ndarray  # [Tt]
    units: np.ndarray  # [U, 5] (longest first)
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


def build_cell_work(a: dict[str, np.ndarray | None], cfg: KernelConfig, group: int,
                    chunk_size: int, num_out_rows: int) -> CellWork:
    """The cell kernel's work for a plan's host arrays `a` (plan.index_arrays)."""
    def req(name: str) -> np.ndarray:
        x = a[name]
        assert x is not None, name
        return x

    q_start, q_len, out_start = req("item_q_start"), req("item_q_len"), req("item_out_start")
    indptr, kv_pos, q_pos = req("item_kv_indptr"), req("kv_pos"), req("q_pos")
    tile_slots, tile_pos, item_tiles = tile_keys(indptr, req("kv_chunk"), req("kv_lo"), req("kv_hi"),
                                                 kv_pos, chunk_size, cfg.block_n)
    items = np.stack([q_start, q_len, indptr[:-1], indptr[1:]], axis=1)  # the shape needs_causal reads
    causal = needs_causal(items, q_pos, kv_pos, req("kv_lo"), req("kv_hi"))
    units = _units(q_start, q_len, item_tiles[:-1], item_tiles[1:], out_start, max(1, cfg.block_m // group))
    ptr, parts = a["row_indptr"], a["row_parts"]
    if ptr is None or parts is None:  # one partial per row, at the row's own index
        ptr = np.minimum(np.arange(len(q_pos) + 1), num_out_rows)
        parts = np.arange(num_out_rows)
    return CellWork(tile_slots, tile_pos, units, causal, ptr, parts)


def _units(q_start: np.ndarray, q_len: np.ndarray, t0: np.ndarray, t1: np.ndarray, out: np.ndarray,
           rows: int) -> np.ndarray:
    """Each item's rows in blocks of `rows`, x all its tiles; longest (most tiles) first."""
    blocks = -(-q_len // rows)
    item = np.repeat(np.arange(len(q_len)), blocks)
    b = np.arange(int(blocks.sum())) - np.repeat(_csr(blocks)[:-1], blocks)
    first = b * rows
    units = np.stack([q_start[item] + first, np.minimum(rows, q_len[item] - first), t0[item], t1[item],
                      out[item] + first], axis=1).astype(np.int64).reshape(-1, 5)
    return units[np.argsort(-(units[:, 3] - units[:, 2]), kind="stable")]
