"""The wide attend launch on Hopper (sm_90), in Gluon: TMA loads, wgmma, warp specialization.

The same function as `attend._attend_kernel` over the wide units of a decode step (twin:
`ops.reference.attend_items`), for the shape that dominates shared-prefix decoding: units of up
to 128 rows (R query rows x G heads) against a long run of 16-bit K/V chunks; and over a
prompt's row blocks (prefill), masked by position in the tiles across their diagonal
(`hopper_products._softmax`; `worklist.trim_causal` leaves the tiles after it out). Triton 3.6
cannot express this structure on Hopper (issue 5); Gluon can. One persistent CTA per SM, three
partitions (two where no unit holds more than 64 rows) over the same sequence of work items
p, p + P, ... of the U units x Hkv heads, head-major (item w: unit w % U, KV head w // U), so
that the units of a head (the same K/V tiles) run in the same wave and a tile comes from DRAM
about once, not once per few CTAs (Llama-2-7B dims, 1,024 x 16K: the launch 6% faster, the
end-to-end step 2%; with 8 KV heads, within +-2%: kernels-notes.md, issue 25 part seven):

    load      1 warp    TMA: each K and V tile [BLOCK_N, D] of the unit's entries into a
                        STAGES-deep ring (k_ready / v_ready: one mbarrier each per stage)
    rows 0-63  4 warps  (the default partition) and
    rows 64-127 4 warps one warpgroup each (in launches of units of > 64 rows): Q tile
                        [64, D] in shared memory, S = Q K^T (wgmma, async), mask, online
                        softmax in base 2, O += P V (P from registers), then release the
                        stage (empty: an arrival per row warpgroup);
                        software-pipelined as FlashAttention-3 within a warpgroup: the
                        scores and softmax of tile j + 1 run while tile j's P V is on the
                        tensor cores

Two row warpgroups share every K/V tile but never wait for each other: while one runs its
softmax the other's products keep the tensor cores busy (FlashAttention-3's ping-pong, left to
the warp schedulers: issuing in strict turns, through mbarriers or named barriers, measured no
faster: issue 25 parts two and twenty-six). A second warpgroup whose rows are all padding (a
unit of <= 64 rows in a launch of larger ones) only waits for its stages and releases them. A
launch whose units all hold <= 64 rows (Table 3's 32: the same shared keys under few sequences)
runs one row warpgroup: on an H200 its all-shared rows took 2-20% less time than the Triton
kernel's 32-row tiles (issue 25 part eight). The CTA leaves room beside it (`MAXNREG`): the
narrow launch's programs (the decode tails) run on the same SMs while the products do, rather
than after them.
Measurements and what was tried: benchmarks/kernels-notes.md, issue 25 parts two to eight.

The row warpgroups' part -- the Q tile, the walk over a unit's tiles with its masks, the rows'
own new keys, the output rows -- is `hopper_products`.

An fp8 cache (e4m3, `reference`'s kv_scale) in units of <= 64 rows: the load warp fills a
ring of e4m3 tiles (STAGES_FP8, half the bytes), a fourth partition (`_widen_partition`, one
warpgroup) widens each into the products' fp16 ring, exactly, and the row warpgroup runs as
over a 16-bit cache with the head's K scale in the score scale and its V scale on the output
(powers of two: exact; bf16 queries as fp16 x 2^-8, as `store.fp8_query`); its own new keys
are quantized as the store launch quantizes them (`_quantize`). Wgmma's fp8 products would
take P and Q in e4m3: not exact. Units of 128 rows over fp8 stay the Triton kernel's.

Taken only where it applies (`applies`), on the Triton it is tested on
(`launch.hopper_module`): CUDA compute capability 9.x, fp16 / bf16 queries over a cache of
their dtype or fp8, D 64 or 128 (at 256 the pipelined loop spills), C a power of two >=
BLOCK_N, a position mask (a prompt's rows) only over a 16-bit cache, no sliding window,
G <= 16 where units store new keys (a wide unit then stores its rows' own: worklist's
`_absorb_keys`; at G > 16 a decode tail's, in its last entry, which the Triton kernel takes),
wide units of at most 128 rows (64 over fp8).

Elsewhere `launch` runs the Triton kernel. Gluon does not run in Triton's interpreter: this
kernel is tested on the GPU against the twin (tests/attention/test_hopper.py).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..reference import FP8
from .configs import NARROW_REGS_BESIDE_GLUON, NARROW_ROWS
from .hopper_products import (
    _IO_LAYOUT,
    _K_SCALE,
    _V_SCALE,
    _own_join,
    _own_keys,
    _own_loads,
    _row_positions,
    _skip,
    _stage_q,
    _walk,
    _write_rows,
)

BLOCK_M = 128  # rows of a unit at most: two warpgroups of 64
BLOCK_N = 64  # keys per K/V tile (128-key tiles of two chunks: `hopper_pairs`, where the products
# bound the step; with this pipeline they need 240 registers a row thread, the tails' room beside)
STAGES = 3  # K/V ring depth, 3 x 32 KiB + Q 32 KiB at D 128 (4: 0-6% slower, 2: 20-30%)
# x 384 threads: the CTA's registers. Each of the SM's four sub-partitions holds 16K registers
# (512 a thread of each of its warps) and 3 of this CTA's warps; what they leave takes one warp
# of the narrow launch that `configs.choose_configs` shapes to fit beside it, so that the
# decode tails stream while the products run (at 168, the whole file, they ran after them).
# 128: the row warpgroups get 176 (24 bytes of spills; 240 at 168, none). With one row
# warpgroup (256 threads, 2 warps a sub-partition) it gets 232, and a sub-partition has room
# for one warp of the narrow launch's own shape (255 registers).
MAXNREG = (512 - NARROW_REGS_BESIDE_GLUON) // 3 // 8 * 8
# fp8: 3 warpgroups (rows 240 registers a thread, widen 96, load 24), 3 warps x 120 of a
# sub-partition's 512 a warp-thread. The row walk of an fp8 step's tails runs after this CTA
# or on SMs without one (`grids.walk_sms`), not beside it on its SM, so the room left is
# not shaped for it.
STAGES_FP8 = gl.constexpr(4)  # the e4m3 load ring: 4 x 16 KiB at D 128
WIDEN_REGS = gl.constexpr(96)
MAXNREG_FP8 = (240 + WIDEN_REGS.value + 24) // 3


def applies(q: torch.Tensor, k_cache: torch.Tensor, block_m: int, causal: bool,
            window: int | None, stores: bool) -> bool:
    """Whether `launch` can run this wide launch (see the module docstring). Never a narrow
    one (tiles of <= NARROW_ROWS rows): its units of 1-16 rows would pad a 64-row wgmma tile
    (on an H200, 1,024 x 64-key tails took 988 us so, 518 in the row walk: kernels-notes.md,
    issue 25 part nine). Stores only where G <= NARROW_ROWS: then a wide unit that stores
    holds its rows' keys (store -2 - t), not a decode tail's last entry's."""
    most = 64 if k_cache.dtype == FP8 else BLOCK_M
    return (supports(q.device, q.dtype, k_cache.dtype, q.shape[-1], k_cache.shape[1])
            and NARROW_ROWS < block_m <= most and not (causal and k_cache.dtype == FP8) and window is None
            and (not stores or q.shape[1] // k_cache.shape[2] <= NARROW_ROWS))


def supports(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
             chunk: int) -> bool:
    """The part of `applies` that a model's shape decides (the rest is the launch's)."""
    if torch.device(device).type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return (dtype in (torch.float16, torch.bfloat16) and kv_dtype in (dtype, FP8) and head_dim in (64, 128)
            and chunk >= 64 and chunk & (chunk - 1) == 0)


@gluon.jit
def _items(unit_count, HKV: gl.constexpr):
    """(U, first, end, step) of this program's work items w = (unit w % U, KV head w // U):
    unit_count = [U, P'], P = min(P', grid) programs take units, spread evenly over the grid
    (program p iff p * P mod grid < P, as its (p * P // grid)-th), the r-th taking r, r + P,
    ... below U * HKV. A CUDA graph's grid is one CTA an SM; a plan's P may leave SMs to the
    narrow launch beside it (`grids.wide_sms`)."""
    num_units = gl.load(unit_count)
    grid = gl.num_programs(0)
    step = gl.load(unit_count + 1)
    if step > grid:  # (a Triton grid's count: more programs than CTAs)
        step = grid
    end = num_units * HKV
    if (gl.program_id(0) * step) % grid >= step:
        end = 0
    return num_units, gl.program_id(0) * step // grid, end, step


@gluon.jit
def _load_partition(units, unit_count, kv_chunk, k_desc, v_desc, k_bufs, v_bufs, k_ready,
                    v_ready, empty, chunk_size, HKV: gl.constexpr, HEAD_DIM: gl.constexpr,
                    BLOCK_N: gl.constexpr, TPE: gl.constexpr):
    """Producer: the K and V tiles of every work item of this program, in walk order."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    num_units, first, end, step = _items(unit_count, HKV)
    it = 0  # tiles issued so far (all work items): stage it % stages, lap it // stages
    for w in range(first, end, step):
        u = w % num_units
        col = (w // num_units) * HEAD_DIM
        e0 = gl.load(units + u * 6 + 2)
        e1 = gl.load(units + u * 6 + 3)
        for j in range(0, (e1 - e0) * TPE):
            s = it % stages
            row = gl.load(kv_chunk + e0 + j // TPE) * chunk_size + (j % TPE) * BLOCK_N
            mbarrier.wait(empty.index(s), ((it // stages) & 1) ^ 1)  # lap 0 passes
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(s), k_bufs.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(s), v_bufs.index(s))
            it += 1


@gluon.jit
def _widen_partition(units, unit_count, k8_bufs, v8_bufs, k8_ready, v8_ready, empty8, k_bufs,
                     v_bufs, k_ready, v_ready, empty, HKV: gl.constexpr, TPE: gl.constexpr):
    """An fp8 cache's tiles, in walk order: each K and V tile of the load ring (e4m3, TMA's)
    widened into the products' ring (fp16: exact, one instruction a pair), K before V so that
    the scores start while V widens."""
    ring8: gl.constexpr = k8_bufs.type.shape[0]
    ring: gl.constexpr = k_bufs.type.shape[0]
    num_units, first, end, step = _items(unit_count, HKV)
    it = 0  # tiles widened so far: load-ring stage it % ring8, products-ring stage it % ring
    for w in range(first, end, step):
        u = w % num_units
        for _ in range(0, (gl.load(units + u * 6 + 3) - gl.load(units + u * 6 + 2)) * TPE):
            a = it % ring8
            s = it % ring
            mbarrier.wait(empty.index(s), ((it // ring) & 1) ^ 1)  # lap 0 passes
            mbarrier.wait(k8_ready.index(a), (it // ring8) & 1)
            _widen(k8_bufs.index(a), k_bufs.index(s), k_ready.index(s))
            mbarrier.wait(v8_ready.index(a), (it // ring8) & 1)
            _widen(v8_bufs.index(a), v_bufs.index(s), v_ready.index(s))
            mbarrier.arrive(empty8.index(a), count=1)  # (`_widen` ended in a barrier)
            it += 1


@gluon.jit
def _widen(src, dst, ready):
    """dst = src (e4m3 [BLOCK_N, D] -> fp16), then `ready` (one arrival, the partition's
    writes fenced for the tensor cores' reads)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # 16-byte loads
    dst.store(src.load(layout).to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _rows_partition(q, units, unit_count, kv_lo, kv_hi, o, lse, new_kv, q_smem, k_bufs, v_bufs,
                    k_ready, v_ready, empty, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_lt, scale_log2, q_pos, kv_pos, WG: gl.constexpr, HKV: gl.constexpr,
                    G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                    TPE: gl.constexpr, WRITE_LSE: gl.constexpr, STORE: gl.constexpr,
                    HOLD: gl.constexpr, FP8: gl.constexpr, CAUSAL: gl.constexpr):
    """Consumer: rows [64 WG, 64 WG + 64) of every work item's tile, one warpgroup. Row m of
    a unit's tile is (query row q_start + m // G, head h * G + m % G). STORE: a unit whose
    store is -2 - t also attends to its rows' own new keys (new_kv: their pointers and
    strides): loaded before its Q tile, written and scored once it is staged, joined after the
    walk (`_own_keys`, `_own_join`: their round trips and writes off the walk's chain), if
    HOLD (one row warpgroup: its registers hold their values over the walk; at two, 176
    registers a thread spilled 656 bytes so); else all after the walk. FP8: the tiles are an
    fp8 cache's, widened (`_widen_partition`): the head's K scale joins the score scale, its V
    scale the output (new_kv[9]: kv_scale [4, Hkv]; powers of two, exact). CAUSAL: a prompt's
    rows, masked by position (q_pos of the rows, kv_pos of the entries) in the tiles that
    cross their diagonal (`_softmax`)."""
    num_units, first, end, step = _items(unit_count, HKV)
    it = 0  # tiles consumed so far, as the producer counts them
    for w in range(first, end, step):
        u = w % num_units
        h = w // num_units
        q_start = gl.load(units + u * 6)
        q_len = gl.load(units + u * 6 + 1)
        e0 = gl.load(units + u * 6 + 2)
        num_tiles = (gl.load(units + u * 6 + 3) - e0) * TPE
        m = WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _IO_LAYOUT))
        if WG * 64 < q_len * G:
            sl2 = scale_log2
            v_scale = 1.0
            if FP8:
                sl2 = scale_log2 * gl.load(new_kv[9] + _K_SCALE * HKV + h)
                v_scale = gl.load(new_kv[9] + _V_SCALE * HKV + h)
            if STORE:  # the rows' own new keys, if the unit holds them (see above)
                t = gl.load(units + u * 6 + 5)
                if HOLD:
                    kt, vt, dst = _own_loads(new_kv, t <= -2, q_len, -2 - t, h, WG, HKV, G, HEAD_DIM,
                                             FP8)
            q_rows = (q + (q_start + m // G).to(gl.int64)[:, None] * stride_qt
                      + (h * G + m % G)[:, None] * stride_qh)
            _stage_q(q_rows, m // G < q_len, q_smem, HEAD_DIM)
            causal = (kv_pos, q_start, q_start)  # (no position mask: unused)
            if CAUSAL:
                qp, q_min = _row_positions(q_pos, q_start, q_len, WG, G, BLOCK_N)
                causal = (kv_pos, qp, q_min)
            if STORE:
                if HOLD:
                    s_own = _own_keys(q_smem, kt, vt, dst, new_kv, t <= -2, q_len, sl2, WG, G,
                                      HEAD_DIM, BLOCK_N)
            acc, m_i, l_i = _walk(q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, kv_lo, kv_hi,
                                  e0, num_tiles, it, sl2, causal, q_smem.dtype, HEAD_DIM, BLOCK_N, TPE,
                                  not HOLD, CAUSAL)
            if STORE:
                if not HOLD:
                    kt, vt, dst = _own_loads(new_kv, t <= -2, q_len, -2 - t, h, WG, HKV, G, HEAD_DIM,
                                             FP8)
                    s_own = _own_keys(q_smem, kt, vt, dst, new_kv, t <= -2, q_len, sl2, WG, G,
                                      HEAD_DIM, BLOCK_N)
                if t <= -2:
                    acc, m_i, l_i = _own_join(acc, m_i, l_i, s_own, vt, HEAD_DIM)
            _write_rows(o, lse, acc, m_i, l_i, v_scale, gl.load(units + u * 6 + 4), q_len, h,
                        stride_ot, stride_oh, stride_lt, WG, G, HEAD_DIM, WRITE_LSE)
        else:  # every row is padding: only keep the ring turning
            _skip(k_ready, v_ready, empty, it, num_tiles)
        it += num_tiles


@gluon.jit
def _wide_kernel(q, units, unit_count, kv_chunk, kv_lo, kv_hi, k_desc, v_desc, o, lse,
                 k_new, v_new, slots, k_cache, v_cache, kv_scale, stride_kt, stride_kh, stride_vt,
                 stride_vh, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, scale_log2,
                 chunk_size, q_pos, kv_pos, HKV: gl.constexpr, G: gl.constexpr, HEAD_DIM: gl.constexpr,
                 BLOCK_N: gl.constexpr, TPE: gl.constexpr, STAGES: gl.constexpr,
                 WRITE_LSE: gl.constexpr, ROWS_REGS: gl.constexpr, ROW_GROUPS: gl.constexpr,
                 TRIGGER: gl.constexpr, STORE: gl.constexpr, DTYPE: gl.constexpr,
                 RING_LAYOUT: gl.constexpr, FP8: gl.constexpr, CAUSAL: gl.constexpr):
    # DTYPE, RING_LAYOUT: the products' operands (q's dtype; fp16 over an fp8 cache)
    if TRIGGER:  # a merging narrow launch may start beside this one (`launch.launch_worklist`)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], DTYPE)
    q_smem = gl.allocate_shared_memory(DTYPE, [ROW_GROUPS, 64, HEAD_DIM], q_layout)
    k_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_DIM], RING_LAYOUT)
    v_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_DIM], RING_LAYOUT)
    k_ready, v_ready, empty = _barriers(STAGES, ROW_GROUPS)  # empty: an arrival per row warpgroup
    new_kv = (k_new, v_new, slots, k_cache, v_cache, stride_kt, stride_kh, stride_vt, stride_vh,
              kv_scale)
    # (each warp_specialize gets its partitions' arguments inline: a tuple held in a variable
    # turns its constexprs into tensors)
    if FP8:  # one row warpgroup; the load warp fills an e4m3 ring that a warpgroup widens
        k8_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES_FP8, BLOCK_N, HEAD_DIM], k_desc.layout)
        v8_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES_FP8, BLOCK_N, HEAD_DIM], v_desc.layout)
        k8_ready, v8_ready, empty8 = _barriers(STAGES_FP8, 1)
        gl.warp_specialize([
            (_rows_partition, (q, units, unit_count, kv_lo, kv_hi, o, lse, new_kv, q_smem.index(0), k_bufs,
                               v_bufs, k_ready, v_ready, empty, stride_qt, stride_qh, stride_ot,
                               stride_oh, stride_lt, scale_log2, q_pos, kv_pos, 0, HKV, G, HEAD_DIM, BLOCK_N,
                               TPE, WRITE_LSE, STORE, ROW_GROUPS == 1, FP8, CAUSAL)),
            (_widen_partition, (units, unit_count, k8_bufs, v8_bufs, k8_ready, v8_ready, empty8,
                                k_bufs, v_bufs, k_ready, v_ready, empty, HKV, TPE)),
            (_load_partition, (units, unit_count, kv_chunk, k_desc, v_desc, k8_bufs, v8_bufs,
                               k8_ready, v8_ready, empty8, chunk_size, HKV, HEAD_DIM, BLOCK_N, TPE)),
        ], [4, 1], [WIDEN_REGS, 24])
    elif ROW_GROUPS == 1:  # units of <= 64 rows: one row warpgroup and the load warp
        gl.warp_specialize([
            (_rows_partition, (q, units, unit_count, kv_lo, kv_hi, o, lse, new_kv, q_smem.index(0), k_bufs,
                               v_bufs, k_ready, v_ready, empty, stride_qt, stride_qh, stride_ot,
                               stride_oh, stride_lt, scale_log2, q_pos, kv_pos, 0, HKV, G, HEAD_DIM, BLOCK_N,
                               TPE, WRITE_LSE, STORE, ROW_GROUPS == 1, FP8, CAUSAL)),
            (_load_partition, (units, unit_count, kv_chunk, k_desc, v_desc, k_bufs, v_bufs,
                               k_ready, v_ready, empty, chunk_size, HKV, HEAD_DIM, BLOCK_N, TPE)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_rows_partition, (q, units, unit_count, kv_lo, kv_hi, o, lse, new_kv, q_smem.index(0), k_bufs,
                               v_bufs, k_ready, v_ready, empty, stride_qt, stride_qh, stride_ot,
                               stride_oh, stride_lt, scale_log2, q_pos, kv_pos, 0, HKV, G, HEAD_DIM, BLOCK_N,
                               TPE, WRITE_LSE, STORE, ROW_GROUPS == 1, FP8, CAUSAL)),
            (_rows_partition, (q, units, unit_count, kv_lo, kv_hi, o, lse, new_kv, q_smem.index(1), k_bufs,
                               v_bufs, k_ready, v_ready, empty, stride_qt, stride_qh, stride_ot,
                               stride_oh, stride_lt, scale_log2, q_pos, kv_pos, 1, HKV, G, HEAD_DIM, BLOCK_N,
                               TPE, WRITE_LSE, STORE, ROW_GROUPS == 1, FP8, CAUSAL)),
            (_load_partition, (units, unit_count, kv_chunk, k_desc, v_desc, k_bufs, v_bufs, k_ready,
                               v_ready, empty, chunk_size, HKV, HEAD_DIM, BLOCK_N, TPE)),
        ], [4, 1], [ROWS_REGS, 24])


@gluon.jit
def _barriers(stages: gl.constexpr, releases: gl.constexpr):
    """A ring's (k_ready, v_ready, empty) mbarriers [stages, 1]: one arrival readies a stage
    (with TMA's bytes, where TMA fills it), `releases` free it."""
    k_ready = gl.allocate_shared_memory(gl.int64, [stages, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [stages, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [stages, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(stages):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=releases)
    return k_ready, v_ready, empty


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, units: torch.Tensor,
           count: torch.Tensor, kv_chunk: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor,
           scale: float, o: torch.Tensor, lse: torch.Tensor | None, programs: int,
           block_m: int = BLOCK_M, maxnreg: int = 0, trigger: bool = False,
           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           kv_scale: torch.Tensor | None = None,
           positions: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """`launch.launch_units` for a launch that `applies`: the first count[0] units on a
    persistent grid of `programs` CTAs, count[1] of which take units (`_items`), at most one
    per SM (its shared memory and `maxnreg` registers a thread -- 0: MAXNREG, MAXNREG_FP8 over
    an fp8 cache -- leave room for narrow programs only, not a second CTA). trigger: the
    launch after this one may start beside it (programmatic dependent launch). new_kv: (k, v
    [T, Hkv, D], slots [T] int64) where units hold their rows' new keys (store -2 - t).
    kv_scale: an fp8 cache's [4, Hkv]. positions: (q_pos, kv_pos) where the units need the
    position mask (a prompt's rows)."""
    n_chunks, chunk_size, hkv, d = k_cache.shape
    g = q.shape[1] // hkv
    fp8 = k_cache.dtype == FP8
    assert fp8 == (kv_scale is not None) and (block_m <= 64 or not fp8)
    dtype = gl.float16 if q.dtype == torch.float16 or fp8 else gl.bfloat16
    ring = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], dtype)
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gl.float8e4nv) if fp8 else ring
    k_desc, v_desc = (TensorDescriptor(c, [n_chunks * chunk_size, hkv * d], [hkv * d, 1],
                                       [BLOCK_N, d], layout) for c in (k_cache, v_cache))
    if fp8 and q.dtype == torch.bfloat16:  # `_stage_q` takes the queries x 2^-8
        scale *= 256.0
    maxnreg = maxnreg or (MAXNREG_FP8 if fp8 else MAXNREG)
    k_new, v_new, slots = new_kv or (q, q, units)  # no store: any pointers
    q_pos, kv_pos = positions or (units, units)  # no position mask: any pointers
    _wide_kernel[(programs,)](
        q, units, count, kv_chunk, kv_lo, kv_hi, k_desc, v_desc, o, o if lse is None else lse,
        k_new, v_new, slots, k_cache, v_cache, q if kv_scale is None else kv_scale,
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), 0 if lse is None else lse.stride(0),
        scale * 1.4426950408889634, chunk_size, q_pos, kv_pos, HKV=hkv, G=g, HEAD_DIM=d, BLOCK_N=BLOCK_N,
        TPE=chunk_size // BLOCK_N, STAGES=STAGES, WRITE_LSE=lse is not None,
        ROWS_REGS=rows_regs(maxnreg), ROW_GROUPS=1 if block_m <= 64 else 2, TRIGGER=trigger,
        STORE=new_kv is not None, DTYPE=dtype, RING_LAYOUT=ring, FP8=fp8, CAUSAL=positions is not None,
        num_warps=4, maxnreg=maxnreg)


def rows_regs(maxnreg: int) -> int:
    """Registers of the second row warpgroup's thread when the CTA (384 threads) holds
    `maxnreg` a thread: what the 1-warp load partition's warpgroup (24 a thread) leaves, in
    steps of 8. (With one row warpgroup Triton gives the default partition what the load
    partition leaves: 232 at 128.)"""
    return min(240, (maxnreg * 384 - 24 * 128) // 256 // 8 * 8)
