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
go on two streams; they share an SM only where its registers (per sub-partition) and shared
memory hold programs of both, so measured on an H200 they overlapped only at the first one's
tail -- until the Gluon wide kernel left room for the narrow shape `choose_configs` fits beside
it (kernels-notes.md, issue 25 part six).

Load balance (split-K, as FlashDecoding / FlashInfer's scheduler do): the cost of a program
is its number of key tiles (block_n keys). A launch's grid holds `programs_per_sm` programs
per SM (what stays resident: 2 for Triton's 128-row wide tiles, 1 Gluon CTA), each taking
every P-th work item, longest first. Items are cut into splits of at most a cap of tiles; the
caps tried are none, a balanced share of 1-4 waves of the grid, and the longest item cut into
as many splits as let the unsplit items' units fill 1-4 waves (for equal items: whole waves,
which the balanced share's rounding can overrun: b256 x 16K shared keys, 64 items on 132
CTAs, is 2 splits in one wave, where the share's 3 took two waves), and the cap whose busiest
program has the fewest tiles wins (ties: fewer splits). A one-level shared prefix at b1024 is
256 equal work items on 264 Triton programs or two waves of 132 Gluon CTAs: splitting cannot
end it sooner, and it stays whole (its 3 splits had cost 1-3.5% on an H200, in partials
written and merged). A split costs its rows' fp32 partials (written, then read by the merge
launch), so an item is never cut into splits shorter than 8x that cost (nor than 4 tiles).
Unless that leaves a class with fewer programs than SMs: then each program is a serial chain
of tile loads on an idle GPU, and items are cut to about one program per SM (splits of at
least 2 tiles), where that ends the launch sooner on its grid. (The whole-wave caps took
4-11% off the Gluon launch's b256 steps over 8K and 16K shared keys on an H200, 4-6% off
Triton's over 16K: issue 25 part nineteen.)

Beside the narrow launch (`_wide_sms`). The Gluon kernel's 128-row CTA (one an SM) leaves room
for 2 narrow programs, a free SM holds 8; where the tails' bytes outlast the products on
every SM, the wide units are balanced over fewer SMs, so that the narrow programs on the
others stream at full width while the products run (an estimate with rates fitted on an
H200; a CUDA graph's fixed grid then has only that many CTAs take units). On an H200 this
took 2-14% off the Hydragen grid's steps whose tails outlast the products (512-key tails
under 2K-16K shared keys, 128-key tails under 2K: issue 25 part twenty).

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
least _BESIDE_KEYS x a tail's keys, the walk runs beside them instead (`_walk_sms`,
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

_PARTIAL_BYTES = 4  # fp32 partials
MIN_BLOCK = 16  # tl.dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape of one attend launch (constexprs and launch options)."""

    block_m: int  # M rows of a program: (query rows x G heads), padded
    block_n: int  # keys per tile (virtual slots: each entry padded to next_pow2(C))
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4  # grid-size target of the split heuristic
    hopper: bool = True  # the Gluon kernel where it applies (`hopper.applies`: sm_90 wide launches)
    maxnreg: int = 0  # registers a thread at most (0: the compiler's choice)
    dynamic: bool = False  # programs take units from a device counter, not a fixed stride
    walk: bool = False  # a narrow launch of G 1, no position mask: the Gluon row walk (`hopper_rows`)
    after_wide: bool = False  # a narrow launch: runs after the wide one on its stream, not beside it
    # (unless the plan gives the wide units SMs of their own, `_walk_sms`: then merge_beside instead)
    merge_beside: bool = False  # a narrow launch beside the wide one (PDL) whose units merge once it ends


NARROW_ROWS = 16  # items with q_len * G <= this run in the narrow launch (decode tails)
NARROW_REGS_BESIDE_GLUON = 128  # a narrow thread's registers beside the Gluon CTA (`hopper.MAXNREG`)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def choose_configs(max_wide_rows: int, head_dim: int, itemsize: int, gluon: bool = False,
                   fp8: bool = False, walk: bool = False) -> tuple[KernelConfig, KernelConfig]:
    """(narrow, wide) launch shapes, from sweeps on an H200 (benchmarks/kernels-notes.md).

    narrow: one query row x G heads (decode tails) in a 16-row tile; the step is a stream of
    K/V tiles, so the leanest program wins: 2 warps, 2 stages (3-5% faster than 4 warps).
    N: 64 keys x D 128 (or 128 x 64) is a 16 KB K tile in 16-bit types; fp32 (tests) halves it.
    wide: shared items, many rows x G heads, in tiles of up to 128 rows, the same keys per
    tile. 128 rows x 4 warps (two wgmma row blocks per warpgroup) read each K/V tile for
    twice the rows of a 64-row tile: on the H200 the Hydragen-grid rows took 2-14% less time
    (b1024 S16K p128: 967 -> 829 us), and a bare 128-row loop ran 481 TFLOP/s where 64 rows
    ran 389 (8 warps: 330). 2 stages at 128 rows (0-2% faster than 3), 3 at 64 (0-4% faster
    than 2; 64 keys took 10-28% less time than 32, v6). Fewer rows than a tile: the next
    power of two (Table 3's 32 rows), as a tile's padding rows cost full products. A 128-row
    program's registers leave room for 2 per SM: its grid targets those 2.
    gluon: the step's wide launch runs the Gluon kernel (`hopper.applies`: a decode step
    whose wide units store no new key), one CTA an SM, which its splits target (at 128 rows
    too: targeting Triton's 2 an SM, b256 x 8K / 16K shared keys took 4 / 8 splits where 2 end
    as soon; with 2 the steps were 4-11% shorter on an H200, issue 25 part nineteen). At 128
    rows it leaves each SM sub-partition room for one warp of NARROW_REGS_BESIDE_GLUON
    registers (`hopper.MAXNREG`); the narrow launch then fits beside it, so that the tails
    stream while the products run: that many registers a thread, half the keys a tile (2-warp
    programs, 2 an SM beside the CTA), units taken as programs free up (`dynamic`: programs
    that wait for room find the rest), 8 an SM once the products end. On an H200 it took
    2.5-7% off every Hydragen-grid row (kernels-notes.md, issue 25 part six). Fewer rows (one
    row warpgroup): the narrow launch keeps its own shape (the shape beside the 128-row CTA
    made Table 3's rows with tails 13-24% slower). On an H200: Table 3's all-shared rows
    2-20% faster, the rows with tails within +-1.5% (issue 25 part eight).
    fp8: an fp8 cache's narrow tiles are half the bytes, so a program's one tile in flight
    (2 stages) hides less of the latency: 5 stages put two in flight (the walk's index loads
    take the first stages), at half the keys a tile. On an H200: Table 3's fp8 rows with
    tails 2-8% faster, the all-shared ones within 1.2% (64-key tiles at 5 stages: 9-13% faster
    without sharing, up to 17% slower elsewhere; 16-bit rows: no change either way).
    walk: the narrow units may run the Gluon row walk (`hopper_rows.supports`: G 1, a step
    with no position mask), which an fp8 cache's take: one-warp CTAs, 8 an SM, K tiles of 4 KB
    (32 keys), 2 stages, items from a counter (with a fixed stride, the CTAs that wait for room
    beside the products held their share). On an H200 (issue 25 part nine): paged decode
    0.83-0.89x, the engine's 1,024 x 16K step 0.966x. Beside a wide launch of <= 64 rows it
    runs after it instead (`after_wide`: beside Triton's tiles, which hold the SMs' registers,
    Table 3's rows with tails took 4-15% longer than with the Triton narrow kernel, after them
    1-22% less: issue 25 part fourteen; beside the Gluon CTA over fp8, with room for 2-6 walk
    CTAs an SM, 12-33% longer than after it: part fifteen; after it, its units merge their rows:
    `fused`; started early by PDL instead, 10-37% longer: part sixteen -- unless the plan
    gives the wide units SMs of their own, `_walk_sms`: part twenty-three). Over a 16-bit
    cache (16-key tiles, the same 4 KB) a candidate only beside the Gluon wide units of <= 64
    rows, taken only where `_walk_sms` gives them SMs of their own (`TritonKernels.plan_extra`
    falls back to the Triton kernel elsewhere): there Table 3's 16-bit rows whose shared keys
    are 3x a tail's took 1-11% less time (part twenty-four); after the products 1-5% more
    (part seventeen), and on paged decode within 0.6%, the engine's 1,024 x 16K step 1-4%
    slower (part nine).
    fp8 wide tiles of <= 64 rows (Triton's, off sm_90: there the Gluon kernel widens them):
    5 stages, so that the pipeliner double-buffers the K/V tiles (below 5 it gives them one
    buffer: their addresses come from loads); on an H200 Table 3's fp8 rows took 2-15% less
    time than at 3 (issue 25 part fourteen).
    """
    block_n = 64 if head_dim > 64 else 128
    if itemsize >= 4:
        block_n //= 2
    wide_m = min(128, max(32, next_pow2(max_wide_rows)))
    narrow = KernelConfig(NARROW_ROWS, block_n, num_warps=2)
    if walk and (fp8 or gluon and 0 < max_wide_rows and wide_m < 128):  # 16-bit: only to run beside
        tile_keys = 4096 // (head_dim * (1 if fp8 else itemsize))  # 4 KB K tiles
        narrow = KernelConfig(NARROW_ROWS, tile_keys, num_warps=1, programs_per_sm=8,
                              maxnreg=NARROW_REGS_BESIDE_GLUON, dynamic=True, walk=True,
                              after_wide=0 < max_wide_rows and wide_m < 128)
    elif fp8:
        narrow = KernelConfig(NARROW_ROWS, block_n // 2, num_warps=2, num_stages=5)
    elif gluon and wide_m == 128:
        narrow = KernelConfig(NARROW_ROWS, block_n // 2, num_warps=2, programs_per_sm=8,
                              maxnreg=NARROW_REGS_BESIDE_GLUON, dynamic=True)
    return (narrow, KernelConfig(wide_m, block_n, num_stages=2 if wide_m == 128 else 5 if fp8 else 3,
                                 programs_per_sm=1 if gluon else 2 if wide_m == 128 else 4))


@dataclasses.dataclass(frozen=True)
class WorkList:
    narrow: np.ndarray  # [Un, 6] int64: q_start, q_len, e0, e1, out_row, store (longest first)
    wide: np.ndarray  # [Uw, 6] the same, items with more than NARROW_ROWS rows x G
    num_partials: int  # S: rows the kernels write (scratch rows, or output rows if direct)
    merge_indptr: np.ndarray | None  # [num_rows + 1]: final row -> merge_parts range
    merge_parts: np.ndarray | None  # [S']: scratch rows in row order; None: no merge
    direct: bool  # no merge: units write final rows (out_row indexes the output)
    causal: tuple[bool, bool]  # (narrow, wide): some row precedes one of its unit's keys
    stores: bool  # units write every row's new key (store != -1, see above); no store launch
    wide_sms: int  # the SMs the wide units are balanced over (fewer than all: `_wide_sms`, `_walk_sms`)
    fused: np.ndarray | None = None  # [Un, 3]: each narrow unit's (final row, others start,
    # count), where the narrow units merge (see above; narrow then ends in the padding rows' units)
    others: np.ndarray | None = None  # [M]: the scratch rows a narrow unit merges with its own


def _csr(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _splits(q_len: np.ndarray, num_entries: np.ndarray, cfg: KernelConfig, group: int, num_kv_heads: int,
            chunk_pad: int, itemsize: int, num_sms: int) -> tuple[np.ndarray, np.ndarray]:
    """Entries per split and number of splits of every item (see the module docstring)."""
    rows = max(1, cfg.block_m // group)
    blocks = -(-q_len // rows)
    tiles = -(-num_entries * chunk_pad // cfg.block_n)
    total = int((blocks * tiles).sum()) * num_kv_heads
    programs = cfg.programs_per_sm * num_sms
    # one split's partials (its used rows x G heads x D fp32, written + read) in K/V tiles
    overhead = np.minimum(q_len, rows) * group * 2 * _PARTIAL_BYTES / (2 * cfg.block_n * itemsize)
    floor = np.ceil(8 * overhead).astype(np.int64)
    # split caps (tiles per split): none, a balanced share of k waves of the grid, or the
    # longest item's tiles over the splits that let the unsplit units fill k waves; keep the
    # one that ends the launch first (ties: fewer work items, so fewer partials)
    best: tuple[tuple[int, int], np.ndarray] | None = None  # (makespan, units), splits
    tried: set[bytes] = set()
    longest, unsplit = int(tiles.max(initial=1)), int(blocks.sum()) * num_kv_heads
    caps = ([max(4, -(-total // (k * programs))) for k in (1, 2, 3, 4)]
            + [max(4, -(-longest // max(1, k * programs // max(1, unsplit)))) for k in (1, 2, 3, 4)])
    for cap in [longest] + caps:
        splits = -(-tiles // np.maximum(cap, floor))
        if splits.tobytes() in tried:  # caps often agree (short tails: all unsplit)
            continue
        tried.add(splits.tobytes())
        key = (_makespan(-(-tiles // splits), blocks * splits * num_kv_heads, programs),
               int((blocks * splits).sum()))
        if best is None or key < best[0]:
            best = (key, splits)
    assert best is not None  # the first cap is always tried
    (makespan, units), num_splits = best
    if units * num_kv_heads < num_sms:
        # too few programs to fill the SMs: the step is latency-bound (a serial chain of tile
        # loads per program), not bound by the partials' bytes; split to about one per SM,
        # unless that takes more waves of the grid (128 units on 132 CTAs: 192)
        sm_splits = -(-tiles // np.full_like(tiles, max(2, -(-total // num_sms))))
        if _makespan(-(-tiles // sm_splits), blocks * sm_splits * num_kv_heads, programs) < makespan:
            num_splits = sm_splits
    tiles_per_split = -(-tiles // np.maximum(num_splits, 1))
    per_entry = max(1, cfg.block_n // chunk_pad)  # entries per tile when a tile spans chunks
    entries = np.maximum(1, -(-tiles_per_split * cfg.block_n // chunk_pad))
    entries = -(-entries // per_entry) * per_entry
    return entries, -(-num_entries // entries)


# The wide Gluon launch's SMs beside a narrow launch. Its 128-row CTA (one an SM) leaves room
# for 2 narrow programs, a free SM holds 8. Rates fitted on an H200 (issue 25 part twenty: 8
# rows x 5 grids, the pick best on all 8), in narrow tiles (4,096 keys' elements of K and V at
# 16 bits, 16 KB: `choose_configs`' narrow tile at D 64 and 128) per wide tile time (128 rows
# x 4,096 keys' elements: one 64-key tile at D 128):
_FREE_SM = 3.0  # the narrow programs of a free SM
_BESIDE_SM = 0.6  # those beside a wide CTA
_ALL_SM = 1.97  # the GPU's bandwidth, per SM
_MIN_GAIN = 0.05  # fewer SMs only where the estimate ends 5% sooner (its 3% gains measured -4..+1%)
_NOISE = 0.02  # estimates this close are equal (b256 x 2K shared keys: 48 SMs estimated 1.6% sooner
# than 64, measured 2% later)


# The row walk beside the Gluon wide units of <= 64 rows (`_walk_sms`), measured on an H200
# (issue 25 parts twenty-three, over fp8, and twenty-four, over 16-bit caches). A walk CTA that
# has walked its tail waits for the wide launch's end to merge its row, holding its room: every
# one must be resident at once, or the rest walk their tails after the products, at a lone
# CTA's latency.
_WALKS_AN_SM = 13  # walk CTAs a free SM holds (shared memory: a 16 KB ring and 1 KB each)
_BESIDE_KEYS = 2  # beside where a wide item walks this many times a tail's keys: at 3x, 4-14% off
# Table 3's fp8 steps and 1-11% off its 16-bit ones; at 1x, +3% to -5% and +1.8% to -2.8%


def _wide_sms(q_len: np.ndarray, num_entries: np.ndarray, cfg: KernelConfig, group: int, num_kv_heads: int,
              chunk_pad: int, itemsize: int, num_sms: int, narrow_tiles: float) -> int:
    """The SMs to balance the wide units over where they run beside `narrow_tiles` narrow
    tiles (all KV heads'): all, unless the tails outlast the products there; then, of the
    grids that whole waves of 1-4 splits of every row block fill (down to a quarter of the
    SMs), the largest whose estimated end (`_beside_end`) is within _NOISE of the soonest, so
    that the rest stream the tails at full width (on an H200, b256 x 8K shared keys with
    512-key tails: 64 SMs, 11% off the step)."""
    blocks = -(-q_len // max(1, cfg.block_m // group))
    tiles = -(-num_entries * chunk_pad // cfg.block_n)
    unsplit = int(blocks.sum()) * num_kv_heads

    def end(sms: int) -> float:
        _, splits = _splits(q_len, num_entries, cfg, group, num_kv_heads, chunk_pad, itemsize, sms)
        copies = blocks * splits * num_kv_heads
        programs = max(1, min(sms, int(copies.sum())))  # (items without entries: no units)
        return _beside_end(_makespan(-(-tiles // np.maximum(splits, 1)), copies, programs), programs, narrow_tiles,
                           num_sms)

    candidates = {-(-unsplit * s // w) for s in range(1, 5) for w in range(1, 5)}
    ends = {sms: end(sms) for sms in candidates | {num_sms} if max(1, num_sms // 4) <= sms <= num_sms}
    best = min(ends.values())
    # the most SMs within the estimate's noise of the best (where the tails bound the step,
    # fewer SMs end it no sooner), if that ends it sooner than all
    sms = max(sms for sms, t in ends.items() if t <= (1 + _NOISE) * best)
    return sms if ends[sms] <= (1 - _MIN_GAIN) * ends[num_sms] else num_sms


def _walk_sms(wide_blocks: int, wide_keys: float, narrow_keys: float, num_rows: int, num_kv_heads: int,
              num_sms: int) -> int:
    """The SMs of the Gluon wide units of <= 64 rows where the row walk runs beside them
    (`merge_beside`), or num_sms where it does not (`after_wide`; over a 16-bit cache the plan
    then takes the Triton narrow kernel, `TritonKernels.plan_extra`): beside, each of the
    `wide_blocks` row blocks x KV heads on an SM of its own, unsplit, where a wide item walks
    _BESIDE_KEYS x the keys of a tail or more (`wide_keys`, `narrow_keys`: the means) and the
    other SMs hold a walk CTA for every final row x KV head at once (the merging walk has one
    for each: its tail's unit, or a graph's padding row's). Tails of their new keys alone
    (`narrow_keys` 1: a step after a shared prompt) are the wide units' to take, split over
    every SM (`_absorb_keys`): not these."""
    items = wide_blocks * num_kv_heads
    if (items <= num_sms // 2 and 1 < narrow_keys and wide_keys >= _BESIDE_KEYS * narrow_keys
            and num_rows * num_kv_heads <= (num_sms - items) * _WALKS_AN_SM):
        return items
    return num_sms


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


def _beside_end(makespan: int, programs: int, narrow_tiles: float, num_sms: int) -> float:
    """When a wide launch of `makespan` tiles on `programs` SMs and `narrow_tiles` beside it
    end, in wide tile times (rates above): the narrow programs stream at their rates while the
    wide CTAs run, at the GPU's bandwidth after."""
    full = _ALL_SM * num_sms
    during = min(full, (num_sms - programs) * _FREE_SM + programs * _BESIDE_SM)
    return max(makespan + max(0.0, narrow_tiles - during * makespan) / full, narrow_tiles / full)


def _makespan(tiles: np.ndarray, copies: np.ndarray, programs: int) -> int:
    """Tiles of the busiest program when `copies[i]` work items of `tiles[i]` tiles each are
    taken longest first, program p taking items p, p + programs, ... (the attend kernel's
    persistent stride; the Gluon wide kernel strides over the items head-major, which this
    models exactly where the units have equal lengths, as a shared item's row blocks do)."""
    work = np.sort(np.repeat(tiles, copies))[::-1]
    work = np.pad(work, (0, -len(work) % programs))
    return int(work.reshape(-1, programs).sum(0).max(initial=0))


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
        wide_sms = _wide_sms(q_len[is_wide], num_entries[is_wide], wide_cfg, group, num_kv_heads, pad,
                             itemsize, num_sms, int(keys) * num_kv_heads / narrow_cfg.block_n)
    narrow_cls = ~is_wide
    entries[narrow_cls], num_splits[narrow_cls] = _splits(q_len[narrow_cls], num_entries[narrow_cls], narrow_cfg,
                                                          group, num_kv_heads, pad, itemsize, num_sms)
    # the row walk after Gluon units of <= 64 rows: beside them instead where that pays
    if (narrow_cfg.after_wide and wide_cfg.programs_per_sm == 1 and is_wide.any() and narrow_cls.any()
            and (q_len[narrow_cls] == 1).all() and (num_splits[narrow_cls] == 1).all()):
        keys = _item_keys(num_entries * pad, kv_indptr, positions)
        blocks = -(-q_len[is_wide] // max(1, wide_cfg.block_m // group))
        wide_sms = _walk_sms(int(blocks.sum()), float((blocks * keys[is_wide]).sum() / blocks.sum()),
                             float(keys[narrow_cls].mean()), num_rows, num_kv_heads, num_sms)
    entries[is_wide], num_splits[is_wide] = _splits(q_len[is_wide], num_entries[is_wide], wide_cfg, group,
                                                    num_kv_heads, pad, itemsize, wide_sms)
    # scratch rows: the splits' own partial rows (also a no-merge schedule's, when forced)
    scratch = bool((num_splits > 1).any()) or (force_merge and row_indptr is None)
    base = _csr(num_splits * q_len)[:-1] if scratch else out_start
    narrow, wide = (_units(q_start, q_len, kv_indptr, entries, num_splits, base,
                           max(1, cfg.block_m // group), cls) for cls, cfg in classes)
    causal = (positions is None or needs_causal(narrow, *positions),
              positions is None or needs_causal(wide, *positions))
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
