"""The Gluon wide launch over 128-key tiles of two 64-slot chunks, for steps the products bound.

The same function as `hopper`'s kernel (twin: `ops.reference.attend_items`) for its 128-row
units over a 16-bit cache of 64-slot chunks, where no unit stores a new key. The plan takes it
where the shared products bound the step (`configs.wide_pairs`: the wide units hold every SM
and walk 32x a tail's entries). A tile is two chunks (two TMA copies each for K and V into the halves of a stage, each
half's slots masked by its own entry's bounds, the second masked whole where a unit has an odd
number of entries), and the K and V rings are released apart, as FlashAttention-3's two
pipelines: a K stage as soon as its scores' wgmma retired, so that the next K tile loads while
the current tile's softmax and P V run; a V stage once its P V did:

    load       1 warp   TMA: each tile's two K halves into a K ring of 2 stages (k_ready /
                        k_empty), its two V halves into a V ring of 2 (v_ready / v_empty)
    rows 0-63   4 warps and rows 64-127, 4 warps: each tile's S = Q K^T [64, 128] (wgmma),
                        release K, mask, online softmax (base 2), O += P V (P from registers),
                        release V -- in turn: at `hopper.MAXNREG` (176 registers a row thread)
                        FlashAttention-3's pipeline within a warpgroup spills 712 bytes; the
                        two warpgroups still cover each other's softmax

Why (cuDNN's attention and this kernel under Nsight Compute, kernels-notes.md, issue 25 part
twenty-seven): cuDNN's kernel has `hopper`'s structure over 128-key tiles and keeps its tensor
pipe busy 77% of cycles to `hopper`'s 59% on the same products. Here, on an H200: the launch
alone 3-5% faster than `hopper`'s 64-key tiles (27% fewer instructions), the steps of the
Hydragen grid's rows whose wide units hold every SM 2-7% shorter -- and on the rows where the
tails outlast the products 2-5% longer (the tails beside it stream slower: two narrow programs
fit beside either CTA, which alone stream 0.7 of the tails' whole grid's rate, and the
products' compute -- their wgmma most, not their traffic -- slows those two further; this
kernel's products are the denser; kernels-notes.md, issue 25 parts thirty-two, thirty-six and
thirty-seven), so there `hopper`'s own tiles run. With FlashAttention-3's pipeline at 240
registers a row thread it is 6-9% faster alone, but leaves the tails no room beside it (steps
up to 10% longer).

Outputs are not `hopper`'s bit for bit: the running max moves once per 128 keys, not per 64,
so P rounds to 16 bits differently (within 7e-5 of max |o| in the partials).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..reference import FP8
from .hopper import MAXNREG, _items, rows_regs
from .hopper_products import (
    _IO_LAYOUT,
    _issue_scores,
    _mma_layout,
    _online,
    _stage_q,
    _write_rows,
    _zero_outside,
)

CHUNK = gl.constexpr(64)  # slots of a chunk; a tile is two
BLOCK_N = gl.constexpr(128)
STAGES = gl.constexpr(2)  # each ring: 2 x 32 KiB of K, of V (+ Q 32 KiB: 160 KiB at D 128)


def applies(k_cache: torch.Tensor, block_m: int, new_kv: object, kv_scale: object) -> bool:
    """This kernel's own conditions, beyond `hopper.applies` (which `launch.launch_units` checks
    first): 64-slot chunks of a 16-bit cache, units of more than 64 rows, none storing a key."""
    return (k_cache.shape[1] == CHUNK.value and k_cache.dtype != FP8 and block_m > 64 and new_kv is None
            and kv_scale is None)


@gluon.jit
def _load_partition(units, unit_count, kv_chunk, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready,
                    k_empty, v_empty, HKV: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Producer: each work item's tiles (entries e, e + 1 of its [e0, e1)), in walk order."""
    num_units, first, end, step = _items(unit_count, HKV)
    it = 0  # tiles issued so far (all work items): stage it % STAGES of each ring
    for w in range(first, end, step):
        u = w % num_units
        col = (w // num_units) * HEAD_DIM
        e0 = gl.load(units + u * 6 + 2)
        e1 = gl.load(units + u * 6 + 3)
        for e in range(e0, e1, 2):
            r0 = gl.load(kv_chunk + e) * CHUNK
            r1 = gl.load(kv_chunk + e + 1, mask=e + 1 < e1, other=0) * CHUNK
            if e + 1 >= e1:  # an odd last entry: any chunk's bytes, masked whole
                r1 = r0
            _load_tile(k_desc, r0, r1, col, k_bufs, k_ready, k_empty, it)
            _load_tile(v_desc, r0, r1, col, v_bufs, v_ready, v_empty, it)
            it += 1


@gluon.jit
def _load_tile(desc, r0, r1, col, bufs, ready, empty, it):
    """TMA of a tile's two chunk halves (cache rows r0, r1, columns col) into stage
    it % STAGES of a ring, once it is free."""
    stages: gl.constexpr = bufs.type.shape[0]
    s = it % stages
    mbarrier.wait(empty.index(s), ((it // stages) & 1) ^ 1)  # lap 0 passes
    mbarrier.expect(ready.index(s), 2 * desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [r0, col], ready.index(s), bufs.index(s).slice(0, CHUNK))
    tma.async_copy_global_to_shared(desc, [r1, col], ready.index(s), bufs.index(s).slice(CHUNK, CHUNK))


@gluon.jit
def _bounds(kv_lo, kv_hi, e, e1):
    """Key slots of the tile of entries e, e + 1 < e1, in its own slots: [lo0, hi0) in its
    first half, [lo1, hi1) in its second (empty: 64, 64 where e + 1 is past the unit)."""
    lo1 = gl.load(kv_lo + e + 1, mask=e + 1 < e1, other=0)
    hi1 = gl.load(kv_hi + e + 1, mask=e + 1 < e1, other=0)
    return gl.load(kv_lo + e), gl.load(kv_hi + e), lo1 + CHUNK, hi1 + CHUNK


@gluon.jit
def _release(empty, it):
    """Every warp of the warpgroup is done with stage it % STAGES of a ring: free it."""
    stages: gl.constexpr = empty.type.shape[0]
    gl.thread_barrier()
    mbarrier.arrive(empty.index(it % stages), count=1)


@gluon.jit
def _softmax(sc, n, lo0, hi0, lo1, hi1, m_i, l_i, scale_log2, p_layout: gl.constexpr,
             dtype: gl.constexpr):
    """`hopper_products._softmax` over a tile of two chunk halves: slots n outside [lo0, hi0)
    and [lo1, hi1) score -inf (a select only in a tile that has such slots)."""
    if (lo0 > 0) | (hi0 < CHUNK) | (lo1 > CHUNK) | (hi1 < BLOCK_N):
        keep = ((n >= lo0) & (n < hi0)) | ((n >= lo1) & (n < hi1))
        sc = gl.where(keep[None, :], sc, float("-inf"))
    return _online(sc, m_i, l_i, scale_log2, p_layout, dtype)


@gluon.jit
def _ready_v(v_bufs, v_ready, it, n_v, lo0, hi0, lo1, hi1):
    """Tile `it`'s V stage once loaded, its rows outside the keys' slots set to 0 in the halves
    that have such rows (0 x a stale inf would be NaN; both warpgroups may write the zeros)."""
    stages: gl.constexpr = v_bufs.type.shape[0]
    v_buf = v_bufs.index(it % stages)
    mbarrier.wait(v_ready.index(it % stages), (it // stages) & 1)
    if (lo0 > 0) | (hi0 < CHUNK):
        _zero_outside(v_buf.slice(0, CHUNK), n_v, lo0, hi0)
    if (lo1 > CHUNK) | (hi1 < BLOCK_N):
        _zero_outside(v_buf.slice(CHUNK, CHUNK), n_v + CHUNK, lo1, hi1)
    return v_buf


@gluon.jit
def _walk(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, kv_lo, kv_hi, e0, e1, it,
          scale_log2, HEAD_DIM: gl.constexpr):
    """The unit's tiles it, it + 1, ... (entries [e0, e1) in pairs) into (acc [64, D]
    unnormalized, m_i, l_i [64]: running max and sum, base 2), releasing each stage once read."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n_v = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, _IO_LAYOUT))
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    for e in range(e0, e1, 2):
        lo0, hi0, lo1, hi1 = _bounds(kv_lo, kv_hi, e, e1)
        tok = _issue_scores(q_smem, k_bufs, k_ready, it, BLOCK_N, s_layout)
        sc, _, _ = warpgroup_mma_wait(0, deps=[tok, q_smem, k_bufs.index(it % stages)])
        _release(k_empty, it)
        p, alpha, m_i, l_i = _softmax(sc, n, lo0, hi0, lo1, hi1, m_i, l_i, scale_log2, p_layout,
                                      q_smem.dtype)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        v_buf = _ready_v(v_bufs, v_ready, it, n_v, lo0, hi0, lo1, hi1)
        tok = warpgroup_mma(p, v_buf, acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=[tok, v_buf, p])
        _release(v_empty, it)
        it += 1
    return acc, m_i, l_i


@gluon.jit
def _rows_partition(q, units, unit_count, kv_lo, kv_hi, o, lse, q_smem, k_bufs, v_bufs, k_ready,
                    v_ready, k_empty, v_empty, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_lt, scale_log2, WG: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr,
                    HEAD_DIM: gl.constexpr, WRITE_LSE: gl.constexpr):
    """Consumer: rows [64 WG, 64 WG + 64) of every work item's tiles, one warpgroup (row m of
    a unit's tile: query row q_start + m // G, head h * G + m % G); a warpgroup whose rows are
    all padding only turns the rings."""
    num_units, first, end, step = _items(unit_count, HKV)
    it = 0  # tiles consumed so far, as the producer counts them
    for w in range(first, end, step):
        u = w % num_units
        h = w // num_units
        q_start = gl.load(units + u * 6)
        q_len = gl.load(units + u * 6 + 1)
        e0 = gl.load(units + u * 6 + 2)
        e1 = gl.load(units + u * 6 + 3)
        m = WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _IO_LAYOUT))
        if WG * 64 < q_len * G:
            q_rows = (q + (q_start + m // G).to(gl.int64)[:, None] * stride_qt
                      + (h * G + m % G)[:, None] * stride_qh)
            _stage_q(q_rows, m // G < q_len, q_smem, HEAD_DIM)
            acc, m_i, l_i = _walk(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, kv_lo,
                                  kv_hi, e0, e1, it, scale_log2, HEAD_DIM)
            _write_rows(o, lse, acc, m_i, l_i, 1.0, gl.load(units + u * 6 + 4), q_len, h, stride_ot,
                        stride_oh, stride_lt, WG, G, HEAD_DIM, WRITE_LSE)
        else:
            for t in range(it, it + (e1 - e0 + 1) // 2):
                mbarrier.wait(k_ready.index(t % STAGES), (t // STAGES) & 1)
                mbarrier.arrive(k_empty.index(t % STAGES), count=1)
                mbarrier.wait(v_ready.index(t % STAGES), (t // STAGES) & 1)
                mbarrier.arrive(v_empty.index(t % STAGES), count=1)
        it += (e1 - e0 + 1) // 2


@gluon.jit
def _pairs_kernel(q, units, unit_count, kv_chunk, kv_lo, kv_hi, k_desc, v_desc, o, lse, stride_qt,
                  stride_qh, stride_ot, stride_oh, stride_lt, scale_log2, HKV: gl.constexpr,
                  G: gl.constexpr, HEAD_DIM: gl.constexpr, WRITE_LSE: gl.constexpr,
                  ROWS_REGS: gl.constexpr, TRIGGER: gl.constexpr, DTYPE: gl.constexpr,
                  RING_LAYOUT: gl.constexpr):
    if TRIGGER:  # a merging narrow launch may start beside this one (`launch.launch_worklist`)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], DTYPE)
    q_smem = gl.allocate_shared_memory(DTYPE, [2, 64, HEAD_DIM], q_layout)
    k_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_DIM], RING_LAYOUT)
    v_bufs = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, HEAD_DIM], RING_LAYOUT)
    k_ready, k_empty = _ring_barriers()
    v_ready, v_empty = _ring_barriers()
    gl.warp_specialize([
        (_rows_partition, (q, units, unit_count, kv_lo, kv_hi, o, lse, q_smem.index(0), k_bufs, v_bufs,
                           k_ready, v_ready, k_empty, v_empty, stride_qt, stride_qh, stride_ot,
                           stride_oh, stride_lt, scale_log2, 0, HKV, G, HEAD_DIM, WRITE_LSE)),
        (_rows_partition, (q, units, unit_count, kv_lo, kv_hi, o, lse, q_smem.index(1), k_bufs, v_bufs,
                           k_ready, v_ready, k_empty, v_empty, stride_qt, stride_qh, stride_ot,
                           stride_oh, stride_lt, scale_log2, 1, HKV, G, HEAD_DIM, WRITE_LSE)),
        (_load_partition, (units, unit_count, kv_chunk, k_desc, v_desc, k_bufs, v_bufs, k_ready,
                           v_ready, k_empty, v_empty, HKV, HEAD_DIM)),
    ], [4, 1], [ROWS_REGS, 24])


@gluon.jit
def _ring_barriers():
    """A ring's (ready, empty) mbarriers [STAGES, 1]: TMA's bytes ready a stage, an arrival of
    each row warpgroup frees it."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return ready, empty


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, units: torch.Tensor,
           count: torch.Tensor, kv_chunk: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor,
           scale: float, o: torch.Tensor, lse: torch.Tensor | None, programs: int,
           block_m: int = 128, maxnreg: int = 0, trigger: bool = False,
           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           kv_scale: torch.Tensor | None = None) -> None:
    """`hopper.launch` (the same arguments) for a launch where this kernel `applies`."""
    assert applies(k_cache, block_m, new_kv, kv_scale), (k_cache.shape, k_cache.dtype, block_m)
    n_chunks, _, hkv, d = k_cache.shape
    dtype = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    ring = gl.NVMMASharedLayout.get_default_for([BLOCK_N.value, d], dtype)
    half = gl.NVMMASharedLayout.get_default_for([CHUNK.value, d], dtype)
    c = CHUNK.value
    k_desc, v_desc = (TensorDescriptor(x, [n_chunks * c, hkv * d], [hkv * d, 1], [c, d], half)
                      for x in (k_cache, v_cache))
    maxnreg = maxnreg or MAXNREG
    _pairs_kernel[(programs,)](
        q, units, count, kv_chunk, kv_lo, kv_hi, k_desc, v_desc, o, o if lse is None else lse,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), 0 if lse is None else lse.stride(0),
        scale * 1.4426950408889634, HKV=hkv, G=q.shape[1] // hkv, HEAD_DIM=d, WRITE_LSE=lse is not None,
        ROWS_REGS=rows_regs(maxnreg), TRIGGER=trigger, DTYPE=dtype, RING_LAYOUT=ring, num_warps=4,
        maxnreg=maxnreg)
