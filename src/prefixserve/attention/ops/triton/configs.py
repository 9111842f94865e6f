"""Launch shapes of the attend kernels (`KernelConfig`) and the (narrow, wide) pair a step's plan
takes (`choose_configs`), from sweeps on an H200 (benchmarks/kernels-notes.md). Host side, no
triton.
"""

from __future__ import annotations

import dataclasses


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
    # (unless the plan gives the wide units SMs of their own, `grids.walk_sms`: then merge_beside instead)
    merge_beside: bool = False  # a narrow launch beside the wide one (PDL) whose units merge once it ends
    pairs: bool = False  # a wide launch: Gluon's 128-key tiles of two chunks (`hopper_pairs`, `wide_pairs`)
    tails: bool = False  # a narrow launch of G > 1, no position mask: the Gluon swapped walk (`hopper_tails`)


NARROW_ROWS = 16  # items with q_len * G <= this run in the narrow launch (decode tails)
NARROW_REGS_BESIDE_GLUON = 128  # a narrow thread's registers beside the Gluon CTA (`hopper.MAXNREG`)


PAIRS_OVER_TAILS = 32  # `wide_pairs` where a wide item's entries are this many x a tail's, or more
WALK_OVER_TAILS = 64  # the swapped walk beside one wave of wide units whose items walk fewer entries than this x a tail's


def wide_pairs(wide: KernelConfig, chunk_size: int, fp8: bool, stores: bool, every_sm: bool,
               shared: float, own: float) -> bool:
    """Whether a plan's Gluon wide launch (`wide.hopper`, 128-row units) takes 128-key tiles of
    two chunks (`hopper_pairs`: 64-slot chunks of a 16-bit cache, no unit storing a new key)
    where the shared products bound the step: its units hold every SM (`every_sm`:
    `grids.wide_sms` left none to the tails) and a wide item walks PAIRS_OVER_TAILS x the
    entries of a tail (`shared`, `own`: the means; `own` 0: no tails). On an H200 those steps
    of the Hydragen grid (128-key tails under 8K and 16K shared keys) took 2-7% less time; where
    the tails are longer (2K shared keys, or 512-key tails), 0-5% more, the tails beside the
    CTA streaming slower: there `hopper`'s 64-key tiles (kernels-notes.md, issue 25 part
    twenty-seven)."""
    return (wide.hopper and wide.block_m == 128 and chunk_size == 64 and not fp8 and not stores and every_sm
            and shared >= PAIRS_OVER_TAILS * own)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def choose_configs(max_wide_rows: int, head_dim: int, itemsize: int, gluon: bool = False,
                   fp8: bool = False, walk: bool = False, tails: bool = False) -> tuple[KernelConfig, KernelConfig]:
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
    gluon: the step's wide launch runs the Gluon kernel (`hopper.applies`: wide units that
    store no new key, a decode step's or over a 16-bit cache a prompt's), one CTA an SM, which
    its splits target (at 128 rows too: targeting Triton's 2 an SM, b256 x 8K / 16K shared
    keys took 4 / 8 splits where 2 end as soon; with 2 the steps were 4-11% shorter on an
    H200, issue 25 part nineteen). At 128
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
    gives the wide units SMs of their own, `grids.walk_sms`: part twenty-three). Over a 16-bit
    cache (16-key tiles, the same 4 KB) a candidate only beside the Gluon wide units of <= 64
    rows, taken only where `grids.walk_sms` gives them SMs of their own (`TritonKernels.plan_extra`
    falls back to the Triton kernel elsewhere): there Table 3's 16-bit rows whose shared keys
    are 3x a tail's took 1-11% less time (part twenty-four); after the products 1-5% more
    (part seventeen), and on paged decode within 0.6%, the engine's 1,024 x 16K step 1-4%
    slower (part nine).
    tails: the narrow units may run the Gluon swapped walk (`hopper_tails.supports`: G 2-16,
    a 16-bit cache, D 128, a step with no position mask) beside 128-row Gluon units: one-
    warpgroup CTAs, 64-key tiles, 2 stages (74 KB: one beside the wide CTA, 3 on a free SM),
    items from a counter. Taken where the wide units leave a quarter of the SMs or more to the
    tails (`TritonKernels.plan_extra`; the SMs from `grids.wide_sms`, its tiles counted as two
    of the model's 16 KB ones): there the Hydragen grid's steps took 1-7% less time on an H200
    (b1024 x 2K shared keys with 128-key tails: 2% more; issue 25 part twenty-eight); and where
    they fill one wave of every SM while a wide item walks fewer than WALK_OVER_TAILS x a tail's
    entries: b256 rows 1-9% less time, two waves (b1024) or 85x up to 6% more (part twenty-nine).
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
    elif gluon and wide_m == 128 and tails:
        narrow = KernelConfig(NARROW_ROWS, 64, num_warps=4, programs_per_sm=3, maxnreg=NARROW_REGS_BESIDE_GLUON,
                              dynamic=True, tails=True)
    elif gluon and wide_m == 128:
        narrow = KernelConfig(NARROW_ROWS, block_n // 2, num_warps=2, programs_per_sm=8,
                              maxnreg=NARROW_REGS_BESIDE_GLUON, dynamic=True)
    return (narrow, KernelConfig(wide_m, block_n, num_stages=2 if wide_m == 128 else 5 if fp8 else 3,
                                 programs_per_sm=1 if gluon else 2 if wide_m == 128 else 4))
