"""Work units of the attend kernel: the host half of the Triton path (numpy only, no triton).

The kernel runs one program per (unit, KV head). A unit is a block of one item's query rows
against a contiguous split of that item's kv entries:

    item i:  q rows [q_start, q_start + q_len)              x entries [kv_indptr[i], kv_indptr[i+1])
    unit:    q rows [q_start + b*R, + min(R, q_len - b*R))  x entries [e0, e1)  (one split)
             R = block_m // G rows: R rows x the G query heads of one KV head are the M side of
             the products, so a shared item's queries from many sequences share every K/V tile.

Items come in two classes, each its own launch with its own tile shape: narrow items
(q_len * G <= NARROW_ROWS: the decode tails, a stream of K/V tiles against a few rows) and
wide ones (shared items: many sequences' rows, where the products dominate). The two launches
run beside each other (`launch.launch_worklist`: by PDL beside a Gluon wide launch, else on two
streams); they share an SM only where its registers (per sub-partition) and shared memory hold
programs of both, so measured on an H200 they overlapped only at the first one's tail -- until
the Gluon wide kernel left room for the narrow shape `choose_configs` fits beside it
(kernels-notes.md, issue 25 part six).

Load balance (split-K, as FlashDecoding / FlashInfer's scheduler do) and the SMs each launch
takes: `grids`.

Prefill's upper triangle. A block of a prompt's rows reads the item's entries up to its last
row's position; the entries after that (about half of a long prompt's tiles) would only be
masked whole, so `trim_causal` leaves them out of the unit.

New keys (decode). In a step where every row reads only keys at or before its own position,
each row's newest key (the one this step's store writes) is read by one unit alone: the last
split of the row's own tail item. That unit takes the key from the step's k/v (not from the
cache) and writes it into its slot, so the step needs no store launch (`stores`). Column
`store` says which row: t >= 0, the key is the last slot of the unit's last entry; -2 - t,
that entry held the key alone and is left out of the unit (its tile would add nothing); -1,
the unit stores none. Otherwise (prefill: a row's new key is read by later rows' units; or a
row recomputes a cached token that others read) the executor stores first, and every `store`
is -1. Where every row's new key sits alone in its chunk under keys that wide units read (a
step after a shared prompt, Table 3's all-shared rows), the narrow units would be one-key
units: instead one split of each wide row block takes its rows' keys (`_absorb_keys`: store
-2 - t, t its first row, each row r its own key r), and the step has no narrow launch (on an
H200 the all-shared rows' attend then ends with the wide launch and a merge).

Partial rows and the merge. Every split writes its own fp32 partial rows (o, lse); the final
merge combines them with the schedule's own merge in one pass:

    item row (i, k) -> partial row  p = out_start[i] + k        (ops.reference's numbering)
    partial row p   -> scratch rows base[i] + j * q_len[i] + k   (split j of item i)
    final row r     -> scratch rows of its partials             (merge_indptr / merge_parts)

With a single split everywhere the scratch rows are the partial rows themselves (base = out_start,
no copy of the schedule's merge is made), and with neither splits nor a schedule merge the
kernel writes the output directly (`direct`).

The merge in the narrow units (`fused`). Where every final row has exactly one narrow
partial, of a one-row unit (decode: the row's own tail, holding its new key), that unit
merges the row: it keeps its own partial in registers, waits for the wide launch to end
(programmatic dependent launch on the GPU: the narrow launch starts beside the wide one, and
`griddepcontrol.wait` orders the reads), and reads the row's other partials (`others`, in the
merge's order) -- no merge launch, no second stream. Rows with no partial (a CUDA graph's
padding) get a unit with no keys, which writes their zeros. Not where the narrow launch takes
units from a counter beside the products (beside the 128-row ones: a unit waiting for their
end would hold its program's room while units are left to walk, and the tails would stop
streaming under them); where it runs after them (`after_wide`: the row walk after units of <=
64 rows) it waits for nothing, and stream order orders the reads. Where those units walk at
least `grids._BESIDE_KEYS` x a tail's keys, the walk runs beside them instead (`grids.walk_sms`,
`merge_beside`): each wide item on an SM of its own, unsplit, the walk's CTAs on the others,
all resident at once, each waiting for the wide launch's end only to merge (on an H200, Table
3's rows with 3x as many shared keys as own took 4-14% less time over fp8, 1-11% over a
16-bit cache, whose walk runs only there: issue 25 parts twenty-three and twenty-four).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from . import grids
from .configs import NARROW_ROWS, KernelConfig, next_pow2


@dataclasses.dataclass(frozen=True)
class WorkList:
    narrow: np.ndarray  # [Un, 6] int64: q_start, q_len, e0, e1, out_row, store (longest first)
    wide: np.ndarray  # [Uw, 6] the same, items with more than NARROW_ROWS rows x G
    num_partials: int  # S: rows the kernels write (scratch rows, or output rows if direct)
    merge_indptr: np.ndarray | None  # [num_rows + 1]: final row -> merge_parts range
    merge_parts: np.ndarray | None  # [S']: scratch rows in row order; None: no merge
    direct: bool  # no merge: units write final rows (out_row indexes the output)
    causal: tuple[bool, bool]  # (narrow, wide): some row precedes one of its unit's keys (as cut, before `trim_causal`)
    stores: bool  # units write every row's new key (store != -1, see above); no store launch
    wide_sms: int  # the SMs the wide units are balanced over (fewer than all: `grids.wide_sms`, `grids.walk_sms`)
    fused: np.ndarray | None = None  # [Un, 3]: each narrow unit's (final row, others start,
    # count), where the narrow units merge (see above; narrow then ends in the padding rows' units)
    others: np.ndarray | None = None  # [M]: the scratch rows a narrow unit merges with its own


def _csr(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _item_keys(slots: np.ndarray, kv_indptr: np.ndarray,
               positions: Sequence[npt.ArrayLike] | None) -> np.ndarray:
    """Each item's keys: its entries' valid keys where `positions` (q_pos, kv_pos, kv_lo, kv_hi)
    give them (a decode tail's last chunk holds a few, often only the new key, which its unit
    takes from the step's k, v), else `slots` (its entries' padded slots)."""
    if positions is None:
        return slots
    valid = _csr(np.asarray(positions[3], np.int64) - np.asarray(positions[2], np.int64))
    keys: np.ndarray = valid[kv_indptr[1:]] - valid[kv_indptr[:-1]]
    return keys


def build_worklist(q_start: npt.ArrayLike, q_len: npt.ArrayLike, out_start: npt.ArrayLike,
                   kv_indptr: npt.ArrayLike, num_rows: int, row_indptr: npt.ArrayLike | None,
                   row_parts: npt.ArrayLike | None, configs: tuple[KernelConfig, KernelConfig], *,
                   group: int, num_kv_heads: int, chunk_size: int, itemsize: int, num_sms: int,
                   positions: Sequence[npt.ArrayLike] | None = None,
                   kv_chunk: npt.ArrayLike | None = None, force_merge: bool = False) -> WorkList:
    """Units and merge CSR of a plan (arrays as in `plan.index_arrays`).

    configs: (narrow, wide); an item is wide if q_len * G > NARROW_ROWS. Each class is split
    and balanced for its own launch. row_indptr/row_parts: the schedule's merge (final row ->
    partial rows), or None when every partial row is a final row (final rows are then
    out_start[i] + k, num_rows of them). positions: (q_pos, kv_pos, kv_lo, kv_hi), to find
    the launches that need no position mask; with kv_chunk also, in decode, the units that
    write the new keys (None: a store launch). force_merge: never
    `direct` (a CUDA graph always runs the merge: rows whose only partial is their own merge
    one partial, and rows without one are written as zeros).
    """
    q_start, q_len, out_start, kv_indptr = (np.asarray(a, dtype=np.int64) for a in
                                            (q_start, q_len, out_start, kv_indptr))
    num_entries = kv_indptr[1:] - kv_indptr[:-1]
    is_wide = q_len * group > NARROW_ROWS
    classes = ((~is_wide, configs[0]), (is_wide, configs[1]))
    entries = np.zeros_like(q_len)
    num_splits = np.zeros_like(q_len)
    pad = next_pow2(chunk_size)
    wide_sms = num_sms
    narrow_cfg, wide_cfg = configs
    # the Gluon wide launch of 128 rows (one CTA an SM) with the narrow one beside it
    if (narrow_cfg.dynamic and not narrow_cfg.after_wide and wide_cfg.block_m == 128 and wide_cfg.programs_per_sm == 1
            and is_wide.any() and not is_wide.all()):
        keys = _item_keys(num_entries * pad, kv_indptr, positions)[~is_wide].sum()
        tile_keys = narrow_cfg.block_n // 2 if narrow_cfg.tails else narrow_cfg.block_n  # (the model's 16 KB tiles)
        wide_sms = grids.wide_sms(q_len[is_wide], num_entries[is_wide], wide_cfg, group, num_kv_heads, pad,
                             itemsize, num_sms, int(keys) * num_kv_heads / tile_keys)
    narrow_cls = ~is_wide
    entries[narrow_cls], num_splits[narrow_cls] = grids.split_items(q_len[narrow_cls], num_entries[narrow_cls], narrow_cfg,
                                                          group, num_kv_heads, pad, itemsize, num_sms)
    # the row walk after Gluon units of <= 64 rows: beside them instead where that pays
    if (narrow_cfg.after_wide and wide_cfg.programs_per_sm == 1 and is_wide.any() and narrow_cls.any()
            and (q_len[narrow_cls] == 1).all() and (num_splits[narrow_cls] == 1).all()):
        keys = _item_keys(num_entries * pad, kv_indptr, positions)
        blocks = -(-q_len[is_wide] // max(1, wide_cfg.block_m // group))
        wide_sms = grids.walk_sms(int(blocks.sum()), float((blocks * keys[is_wide]).sum() / blocks.sum()),
                             float(keys[narrow_cls].mean()), num_rows, num_kv_heads, num_sms)
    entries[is_wide], num_splits[is_wide] = grids.split_items(q_len[is_wide], num_entries[is_wide], wide_cfg, group,
                                                    num_kv_heads, pad, itemsize, wide_sms)
    # scratch rows: the splits' own partial rows (also a no-merge schedule's, when forced)
    scratch = bool((num_splits > 1).any()) or (force_merge and row_indptr is None)
    base = _csr(num_splits * q_len)[:-1] if scratch else out_start
    narrow, wide = (_units(q_start, q_len, kv_indptr, entries, num_splits, base,
                           max(1, cfg.block_m // group), cls) for cls, cfg in classes)
    causal = (positions is None or needs_causal(narrow, *positions),
              positions is None or needs_causal(wide, *positions))
    if positions is not None:  # prefill: no tile of a row block's upper triangle
        narrow, wide = (trim_causal(u, *positions) if c else u for u, c in zip((narrow, wide), causal, strict=True))
    stores = (kv_chunk is not None and positions is not None and not any(causal)
              and mark_stores([narrow, wide], q_start, q_len, kv_chunk, *positions))
    if not scratch and row_indptr is None:
        return WorkList(narrow, wide, num_rows, None, None, direct=True, causal=causal,
                        stores=stores, wide_sms=wide_sms)
    if scratch:
        num_partials = int((num_splits * q_len).sum())
        indptr, parts = _merge_csr(q_len, out_start, num_splits, base, num_rows, row_indptr, row_parts)
    else:
        num_partials = int(q_len.sum())
        indptr, parts = np.asarray(row_indptr, np.int64), np.asarray(row_parts, np.int64)
    gone = _absorb_keys(narrow, wide) if stores else None
    if gone is not None:  # the wide units take the new keys: no narrow launch
        keep = ~np.isin(parts, gone)
        row_of = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
        indptr, parts = _csr(np.bincount(row_of[keep], minlength=len(indptr) - 1)), parts[keep]
        narrow = narrow[:0]
    beside = configs[0].dynamic and not configs[0].after_wide and not configs[0].merge_beside
    fused = None if beside else _fused_merge(narrow, indptr, parts, num_partials)
    if fused is None:
        return WorkList(narrow, wide, num_partials, indptr, parts, direct=False, causal=causal,
                        stores=stores, wide_sms=wide_sms)
    return WorkList(fused[0], wide, num_partials, indptr, parts, direct=False, causal=causal,
                    stores=stores, wide_sms=wide_sms, fused=fused[1], others=fused[2])


def _absorb_keys(narrow: np.ndarray, wide: np.ndarray) -> np.ndarray | None:
    """Where every narrow unit is a row's new key alone (one row, no entries: `mark_stores`
    left the key's entry out) and the wide units' row blocks hold every such row, each row
    once: one split of each such block (its shortest) takes its rows' new keys (store =
    -2 - its first row, see the module docstring) -- a step with its new keys in chunks of
    their own (every key before them shared) then needs no narrow launch. The wide units stay
    longest first (`_shorten` moves entries between them). Returns the narrow units' partial
    rows (no longer written), or None (no change)."""
    alone = (narrow[:, 1] == 1) & (narrow[:, 2] == narrow[:, 3]) & (narrow[:, 5] <= -2)
    if len(narrow) == 0 or len(wide) == 0 or not alone.all():
        return None
    free = np.zeros(int(max(narrow[:, 0].max(), (wide[:, 0] + wide[:, 1]).max())) + 1, bool)
    free[narrow[:, 0]] = True  # rows whose key no unit has taken yet
    chosen = []
    # the blocks of fewest rows first (a deeper level's), a block's shortest split first
    for i in np.lexsort((wide[:, 3] - wide[:, 2], wide[:, 1])).tolist():
        rows = slice(int(wide[i, 0]), int(wide[i, 0] + wide[i, 1]))
        if free[rows].all():
            free[rows] = False
            chosen.append(i)
    if free.any():
        return None
    for i in chosen:
        _shorten(wide, i)
    wide[chosen, 5] = -2 - wide[chosen, 0]
    wide[:] = wide[np.argsort(wide[:, 2] - wide[:, 3], kind="stable")]  # longest first again
    return narrow[:, 4]


OWN_KEYS_ENTRIES = 2  # what taking its rows' keys adds to a unit, in entries of its walk


def _shorten(wide: np.ndarray, i: int) -> None:
    """Unit i will take its rows' keys: where its block's splits are a chain of entry ranges
    (one item's), move its first OWN_KEYS_ENTRIES entries to the other splits, so that the
    splits end together (on an H200 the keys took a 32-row unit ~2.8 us, about two 64-key
    tiles of its walk: issue 25 part eleven). In place; the splits' partial rows stay."""
    mates = np.nonzero((wide[:, 0] == wide[i, 0]) & (wide[:, 1] == wide[i, 1]))[0]
    mates = mates[np.argsort(wide[mates, 2], kind="stable")]
    if len(mates) < 2 or (wide[mates[1:], 2] != wide[mates[:-1], 3]).any():
        return
    first, n = int(wide[mates[0], 2]), int(wide[mates[-1], 3] - wide[mates[0], 2])
    own = max(1, n // len(mates) - OWN_KEYS_ENTRIES)
    rest = np.full(len(mates) - 1, (n - own) // (len(mates) - 1))
    rest[:(n - own) % (len(mates) - 1)] += 1
    sizes = np.r_[own, rest]
    order = np.r_[i, mates[mates != i]]  # unit i first, the others in their entries' order
    ends = first + np.cumsum(sizes)
    wide[order, 2], wide[order, 3] = ends - sizes, ends


def _fused_merge(narrow: np.ndarray, indptr: np.ndarray, parts: np.ndarray,
                 num_partials: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(narrow units + a unit with no keys for each row without partials, [Un, 3] (final row,
    others start, count) per unit, others [M]) where every final row with partials has exactly
    one narrow partial, of a one-row unit (see the module docstring); else None."""
    if len(narrow) == 0 or (narrow[:, 1] != 1).any():
        return None
    num_rows = len(indptr) - 1
    counts = np.diff(indptr)
    row_of = np.repeat(np.arange(num_rows), counts)  # [M]: the final row of each merge position
    final_of = np.full(num_partials, -1, np.int64)
    final_of[parts] = row_of
    final = final_of[narrow[:, 4]]  # each narrow unit's final row (its one partial row's)
    if (np.bincount(final, minlength=num_rows)[counts > 0] != 1).any():
        return None  # a row with no narrow partial or with two
    own = np.full(num_rows, -1, np.int64)
    own[final] = narrow[:, 4]
    keep = parts != own[row_of]
    kept = np.bincount(row_of[keep], minlength=num_rows)
    empty = np.nonzero(counts == 0)[0]  # a graph's padding rows: their zeros (the unit reads
    # query row 0, any row: final rows need not be query rows; it writes no partial)
    ones, zeros = np.ones_like(empty), np.zeros_like(empty)
    pad = np.stack([zeros, ones, zeros, zeros, zeros, -ones], 1)
    rows = np.r_[final, empty]
    return (np.concatenate([narrow, pad]), np.stack([rows, _csr(kept)[rows], kept[rows]], 1),
            parts[keep])


def _range_reduce(ufunc: np.ufunc, values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """ufunc over values[starts[i]:ends[i]] for every i (non-empty ranges, any order)."""
    bounds = np.stack([starts, ends], 1).reshape(-1)
    out: np.ndarray = ufunc.reduceat(np.append(values, values[:1]), bounds)[::2]
    return out


def trim_causal(units: np.ndarray, q_pos: npt.ArrayLike, kv_pos: npt.ArrayLike,
                kv_lo: npt.ArrayLike, kv_hi: npt.ArrayLike) -> np.ndarray:
    """`units` with each one's trailing entries whose every key follows all of its rows left
    out (a prefill row block's upper triangle: about half a long prompt's tiles). Under the
    position mask such a tile's scores are all -inf, so it leaves a row's (m, l, acc) as they
    were (p = 0, alpha = 1): the outputs are the same values without it. A unit may be left
    with no entries (a split past its rows: it writes them (0, -inf), which the merge
    weighs 0). Decode units lose nothing (every key precedes its row). Longest first again.
    Entries hold ascending positions within an item (`plan`), so the unseen ones are a
    suffix; should one not be, only the suffix goes."""
    if len(units) == 0:
        return units
    q_pos, kv_pos, kv_lo, kv_hi = (np.asarray(x, np.int64) for x in (q_pos, kv_pos, kv_lo, kv_hi))
    row_max = _range_reduce(np.maximum, q_pos, units[:, 0], units[:, 0] + units[:, 1])
    n = units[:, 3] - units[:, 2]
    some = n > 0  # (`_range_reduce` wants non-empty ranges)
    key_max = np.full(len(units), -1, np.int64)
    key_max[some] = _range_reduce(np.maximum, kv_pos + kv_hi - kv_lo - 1, units[some, 2], units[some, 3])
    cut = np.nonzero(key_max > row_max)[0]  # units with a key after their last row
    if len(cut) == 0:
        return units
    units = units.copy()
    n = n[cut]
    e = np.repeat(units[cut, 2], n) + np.arange(int(n.sum())) - np.repeat(_csr(n)[:-1], n)
    seen = kv_pos[e] <= np.repeat(row_max[cut], n)  # the entry's first key: seen by the last row
    last = np.maximum.reduceat(np.where(seen, e + 1, 0), _csr(n)[:-1])
    units[cut, 3] = np.maximum(last, units[cut, 2])
    out: np.ndarray = units[np.argsort(units[:, 2] - units[:, 3], kind="stable")]
    return out


def needs_causal(units: np.ndarray, q_pos: npt.ArrayLike, kv_pos: npt.ArrayLike,
                 kv_lo: npt.ArrayLike, kv_hi: npt.ArrayLike) -> bool:
    """Whether some unit's row precedes one of its keys (prefill); in decode every key of a
    row's units precedes it and the kernel skips the position mask."""
    if len(units) == 0:
        return False
    kv_pos, kv_lo, kv_hi = (np.asarray(x, np.int64) for x in (kv_pos, kv_lo, kv_hi))
    key_max = _range_reduce(np.maximum, kv_pos + kv_hi - kv_lo - 1, units[:, 2], units[:, 3])
    row_min = _range_reduce(np.minimum, np.asarray(q_pos, np.int64), units[:, 0],
                            units[:, 0] + units[:, 1])
    return bool((key_max > row_min).any())


def items_need_causal(q_start: npt.ArrayLike, q_len: npt.ArrayLike, kv_indptr: npt.ArrayLike,
                      select: npt.ArrayLike, q_pos: npt.ArrayLike, kv_pos: npt.ArrayLike,
                      kv_lo: npt.ArrayLike, kv_hi: npt.ArrayLike) -> bool:
    """`needs_causal` of the launch that will hold the selected items' units, before they are
    cut: a unit pairs a block of its item's rows with a split of its entries, so some unit
    needs the mask iff its item does."""
    kv_indptr = np.asarray(kv_indptr, np.int64)
    items = np.stack([np.asarray(q_start, np.int64), np.asarray(q_len, np.int64), kv_indptr[:-1],
                      kv_indptr[1:]], 1)[np.asarray(select, bool)]
    items = items[(items[:, 1] > 0) & (items[:, 3] > items[:, 2])]  # (nothing to mask)
    return needs_causal(items, q_pos, kv_pos, kv_lo, kv_hi)


def mark_stores(units: list[np.ndarray], q_start: np.ndarray, q_len: np.ndarray,
                kv_chunk: npt.ArrayLike, q_pos: npt.ArrayLike, kv_pos: npt.ArrayLike,
                kv_lo: npt.ArrayLike, kv_hi: npt.ArrayLike) -> bool:
    """Decode (no unit needs a position mask): set column `store` of the unit whose last
    entry ends at its one row's own position -- the unit that reads that row's new key --
    when every row of an item has exactly one such unit and no other entry holds one of
    those keys (a row recomputing a cached token shares its slot with rows that read it: the
    write must precede their reads, which a store launch orders). -> whether it did (if
    not, no change)."""
    kv_chunk, q_pos, kv_pos, kv_lo, kv_hi = (np.asarray(x, np.int64) for x in
                                             (kv_chunk, q_pos, kv_pos, kv_lo, kv_hi))
    own = []
    for u in units:
        last = u[:, 3] - 1
        end = kv_pos[last] + kv_hi[last] - kv_lo[last] - 1  # position of the unit's last key
        own.append((u[:, 1] == 1) & (end == q_pos[u[:, 0]]))
    rows = np.concatenate([u[o, 0] for u, o in zip(units, own, strict=True)])
    covered = np.zeros(len(q_pos), bool)
    covered[np.repeat(q_start, q_len) + np.arange(int(q_len.sum()))
            - np.repeat(_csr(q_len)[:-1], q_len)] = True
    if not np.array_equal(np.sort(rows), np.nonzero(covered)[0]):  # a row with none, or two
        return False
    # the new keys (chunk, offset), by chunk; every (entry, new key in its chunk) pair, over
    # the entries of chunks that hold a new key (a lookup: the plan's other entries, a
    # shared prefix listed once per row by Paged, cost no search)
    key_entry = np.concatenate([u[o, 3] - 1 for u, o in zip(units, own, strict=True)])
    key_entry = key_entry[np.argsort(kv_chunk[key_entry], kind="stable")]
    key_chunk, key_off = kv_chunk[key_entry], kv_hi[key_entry] - 1
    holds = np.zeros(int(kv_chunk.max(initial=0)) + 1, bool)
    holds[key_chunk] = True
    cand = np.nonzero(holds[kv_chunk])[0]
    first = np.searchsorted(key_chunk, kv_chunk[cand], "left")
    n = np.searchsorted(key_chunk, kv_chunk[cand], "right") - first
    entry = np.repeat(cand, n)
    key = np.repeat(first, n) + np.arange(int(n.sum())) - np.repeat(_csr(n)[:-1], n)
    reads = (kv_lo[entry] <= key_off[key]) & (key_off[key] < kv_hi[entry])
    if (reads & (entry != key_entry[key])).any():
        return False
    for u, o in zip(units, own, strict=True):
        last = u[o, 3] - 1
        alone = kv_hi[last] - kv_lo[last] == 1  # the entry holds the new key only: leave it out
        u[o, 5] = np.where(alone, -2 - u[o, 0], u[o, 0])
        u[o, 3] -= alone
    return True


def _units(q_start: np.ndarray, q_len: np.ndarray, kv_indptr: np.ndarray, entries: np.ndarray,
           num_splits: np.ndarray, base: np.ndarray, rows: int, select: np.ndarray) -> np.ndarray:
    """[U, 6] units of the selected items, longest first (ties: item, split, row block)."""
    blocks = np.where(select, -(-q_len // rows), 0)
    per_item = num_splits * blocks
    item = np.repeat(np.arange(len(q_len)), per_item)
    local = np.arange(per_item.sum()) - np.repeat(_csr(per_item)[:-1], per_item)
    split, block = local // blocks[item], local % blocks[item]
    e0 = kv_indptr[item] + split * entries[item]
    e1 = np.minimum(e0 + entries[item], kv_indptr[item + 1])
    r0 = block * rows
    units = np.stack([q_start[item] + r0, np.minimum(rows, q_len[item] - r0), e0, e1,
                      base[item] + split * q_len[item] + r0, np.full_like(e0, -1)],
                     axis=1).astype(np.int64)
    return units[np.argsort(-(units[:, 3] - units[:, 2]), kind="stable")]


def _merge_csr(q_len: np.ndarray, out_start: np.ndarray, num_splits: np.ndarray, base: np.ndarray,
               num_rows: int, row_indptr: npt.ArrayLike | None,
               row_parts: npt.ArrayLike | None) -> tuple[np.ndarray, np.ndarray]:
    """Final row -> scratch rows, composing the splits with the schedule's merge."""
    scratch_item = np.repeat(np.arange(len(q_len)), num_splits * q_len)
    local = np.arange(scratch_item.size) - base[scratch_item]
    partial = out_start[scratch_item] + local % q_len[scratch_item]  # [S]: its partial row
    if row_indptr is None:
        final = partial
    else:
        row_indptr = np.asarray(row_indptr, np.int64)
        row_of_partial = np.empty(int(row_indptr[-1]), dtype=np.int64)
        row_of_partial[np.asarray(row_parts, np.int64)] = np.repeat(
            np.arange(num_rows), np.diff(row_indptr))
        final = row_of_partial[partial]
    return (_csr(np.bincount(final, minlength=num_rows)),
            np.argsort(final, kind="stable").astype(np.int64))
