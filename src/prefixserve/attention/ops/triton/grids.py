"""Grids of the attend launches (host side, numpy only): how many splits each item is cut into,
and over how many SMs the wide units are balanced where tails run beside them.

Splits (split-K, as FlashDecoding / FlashInfer's scheduler do): the cost of a program
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

Beside the narrow launch (`wide_sms`). The Gluon kernel's 128-row CTA (one an SM) leaves room
for 2 narrow programs, a free SM holds 8; where the tails' bytes outlast the products on
every SM, the wide units are balanced over fewer SMs, so that the narrow programs on the
others stream at full width while the products run (an estimate with rates fitted on an
H200; a CUDA graph's fixed grid then has only that many CTAs take units). On an H200 this
took 2-14% off the Hydragen grid's steps whose tails outlast the products (512-key tails
under 2K-16K shared keys, 128-key tails under 2K: issue 25 part twenty).

The row walk beside the Gluon units of <= 64 rows (`walk_sms`): worklist's `merge_beside`.
"""

from __future__ import annotations

import numpy as np

from .configs import KernelConfig

_PARTIAL_BYTES = 4  # fp32 partials


def split_items(q_len: np.ndarray, num_entries: np.ndarray, cfg: KernelConfig, group: int, num_kv_heads: int,
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


# The row walk beside the Gluon wide units of <= 64 rows (`walk_sms`), measured on an H200
# (issue 25 parts twenty-three, over fp8, and twenty-four, over 16-bit caches). A walk CTA that
# has walked its tail waits for the wide launch's end to merge its row, holding its room: every
# one must be resident at once, or the rest walk their tails after the products, at a lone
# CTA's latency.
_WALKS_AN_SM = 13  # walk CTAs a free SM holds (shared memory: a 16 KB ring and 1 KB each)
_BESIDE_KEYS = 2  # beside where a wide item walks this many times a tail's keys: at 3x, 4-14% off
# Table 3's fp8 steps and 1-11% off its 16-bit ones; at 1x, +3% to -5% and +1.8% to -2.8%


def wide_sms(q_len: np.ndarray, num_entries: np.ndarray, cfg: KernelConfig, group: int, num_kv_heads: int,
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
        _, splits = split_items(q_len, num_entries, cfg, group, num_kv_heads, chunk_pad, itemsize, sms)
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


def walk_sms(wide_blocks: int, wide_keys: float, narrow_keys: float, num_rows: int, num_kv_heads: int,
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
