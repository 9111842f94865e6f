"""The row warpgroups of the Gluon wide kernel (`hopper`): one warpgroup's 64 rows of a unit.

Its Q tile [64, D] is staged in shared memory (`_stage_q`), then the unit's K/V tiles are
walked as the load warp's ring delivers them (`_walk`): S = Q K^T (wgmma, async), the online
softmax in base 2 (`_softmax`), O += P V (P from registers), each stage released once read;
software-pipelined as FlashAttention-3 within a warpgroup: the scores and softmax of tile
j + 1 run while tile j's P V is on the tensor cores. Then its rows are written (`_write_rows`:
o = acc / l, lse = ln 2 (m + log2 l)). A warpgroup whose rows are all padding only turns the
ring (`_skip`). A prompt's rows (CAUSAL) are masked by position too, in the tiles that cross
their diagonal only (`_softmax`; the work list leaves the tiles after it out).

Tiles: the cache is viewed as [chunks * C, Hkv * D]; tile j of entry e is rows kv_chunk[e] * C
+ (j % TPE) * BLOCK_N, + BLOCK_N (TPE = C // BLOCK_N tiles per entry, so a tile never leaves
its chunk), columns h * D, + D. A slot outside the entry's [lo, hi) scores -inf (a where, not
an add: a stale NaN or inf in a slot cannot leak into a score; with two row warpgroups only in
tiles that hold such slots, `_softmax`), and such slots' V rows are zeroed in shared memory
before the product (0 * inf would be NaN) -- only in tiles that hold such slots.

A unit that holds its rows' new keys (store -2 - t: a step whose keys sit alone in their
chunks under the shared ones, as after a shared prompt) takes each row's own key as one more
online-softmax step after its tiles (`_own_join`; loaded in the accumulator's layout before
its Q tile, written into the cache and scored before its walk: `_own_keys`): such a step is
one launch and a merge launch (started beside it: `merge_rows(pdl=True)`).

`_quantize` is an fp8 cache's e4m3 rounding of a new key, bit for bit the store launch's
(`hopper_rows` quantizes its tails' new keys with `_quantize_rounded`, the same bytes).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..reference import K_INV, K_SCALE, V_INV, V_SCALE

_K_SCALE, _V_SCALE, _K_INV, _V_INV = (gl.constexpr(r) for r in (K_SCALE, V_SCALE, K_INV, V_INV))


@gluon.jit
def _quantize(x, inv):
    """`store.quantize_fp8` in Gluon, bit for bit: e4m3 of x * inv (fp32) in one conversion
    a pair of values (`cvt.rn.satfinite.e4m3x2.f32`: to nearest, ties to even, saturated at
    +-448). On the [64, D] tile of a unit's own keys the wide kernel compiles to ~1,500 fewer
    SASS instructions than with `_quantize_rounded`, and Table 3's all-shared fp8 steps take
    8-11% less time on an H200 (kernels-notes.md, issue 25 part thirty-eight)."""
    return (x.to(gl.float32) * inv).to(gl.float8e4nv)


@gluon.jit
def _quantize_rounded(x, inv):
    """`_quantize` with the value rounded to e4m3's grid in fp32 first (normal: 3 mantissa
    bits, ties to even; subnormal: multiples of 2^-9), so that the conversion is exact. The row
    walk's: there ptxas 12.8 (Triton 3.6's) schedules some of the widenings of the converted
    key before the conversion that writes their registers, and this form it compiles in order
    (kernels-notes.md, issue 25 part sixteen; tests/attention/test_hopper.py scans the SASS)."""
    y = gl.minimum(gl.maximum(x.to(gl.float32) * inv, -448.0), 448.0)
    bits = y.to(gl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    sub = ((y + 24576.0) - 24576.0).to(gl.int32, bitcast=True) | (bits & -0x80000000)
    y = gl.where((bits & 0x7FFFFFFF) >= 0x3C800000, normal, sub).to(gl.float32, bitcast=True)
    return y.to(gl.float8e4nv)


@gluon.jit
def _bounds(kv_lo, kv_hi, e0, j, BLOCK_N: gl.constexpr, TPE: gl.constexpr):
    """The unit's tile j's key slots [lo, hi), in the tile's own slot numbers."""
    e = e0 + j // TPE
    first = (j % TPE) * BLOCK_N
    return gl.load(kv_lo + e) - first, gl.load(kv_hi + e) - first


@gluon.jit
def _key_base(kv_pos, kv_lo, e0, j, BLOCK_N: gl.constexpr, TPE: gl.constexpr):
    """The position of the key in the unit's tile j's slot 0 (slot n's: + n; a position mask's)."""
    e = e0 + j // TPE
    return gl.load(kv_pos + e) - gl.load(kv_lo + e) + (j % TPE) * BLOCK_N


@gluon.jit
def _row_positions(q_pos, q_start, q_len, WG: gl.constexpr, G: gl.constexpr, BLOCK_N: gl.constexpr):
    """(qp [64]: the positions of a warpgroup's rows, in the scores' row layout, -1 for
    padding rows (they see no key); q_min: the least of them) -- a position mask's rows."""
    m = WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _mma_layout(BLOCK_N)))
    real = m // G < q_len
    qp = gl.load(q_pos + q_start + m // G, mask=real, other=-1)
    return qp, gl.min(gl.where(real, qp, 2147483647), 0)


@gluon.constexpr_function
def _mma_layout(n):
    """The wgmma accumulator layout of a warpgroup's [64, n] tile."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


_IO_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # 16-byte row pieces


@gluon.jit
def _stage_q(q_rows, row_ok, q_smem, HEAD_DIM: gl.constexpr):
    """The Q tile [64, D] (pointers q_rows [64, 1] to each row's D values; padding rows 0)
    into q_smem, for the products' A operand. A bf16 tile staged as fp16 (an fp8 cache's
    products run in fp16) is taken x 2^-8, as `store.fp8_query` (the score scale x 2^8)."""
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, _IO_LAYOUT))
    qt = gl.load(q_rows + cols[None, :], mask=row_ok[:, None], other=0.0)
    if qt.dtype != q_smem.dtype:
        qt = (qt.to(gl.float32) * 0.00390625).to(q_smem.dtype)
    gl.thread_barrier()  # the last work item's products are done with q_smem
    q_smem.store(qt)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _own_loads(new_kv, own, q_len, t, h, WG: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr,
               HEAD_DIM: gl.constexpr, FP8: gl.constexpr):
    """Where `own` (the unit holds its rows' keys: row r's is key t + r - q_start of new_kv =
    (k_new, v_new [T, Hkv, D], slots, k_cache, v_cache, their strides, kv_scale)): the keys
    and values of rows [64 WG, + 64) [64, D] in the accumulator's layout (no shared memory),
    FP8: quantized as the store launch quantizes them (`_quantize`), and their cache offsets;
    else nothing loaded (zeros)."""
    k_new, v_new, slots, k_cache, v_cache, stride_kt, stride_kh, stride_vt, stride_vh, kv_scale = new_kv
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    m = WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ok = (m // G < q_len) & own
    tile_ok = ok[:, None] & (cols < HEAD_DIM)[None, :]
    key = (t + m // G).to(gl.int64)
    kt = gl.load(k_new + key[:, None] * stride_kt + h * stride_kh + cols[None, :], mask=tile_ok,
                 other=0.0)
    vt = gl.load(v_new + key[:, None] * stride_vt + h * stride_vh + cols[None, :], mask=tile_ok,
                 other=0.0)
    if FP8:
        kt = _quantize(kt, gl.load(kv_scale + _K_INV * HKV + h))
        vt = _quantize(vt, gl.load(kv_scale + _V_INV * HKV + h))
    dst = (gl.load(slots + key, mask=ok, other=0) * (HKV * HEAD_DIM) + h * HEAD_DIM)[:, None] + cols[None, :]
    return kt, vt, dst


@gluon.jit
def _own_keys(q_smem, kt, vt, dst, new_kv, own, q_len, scale_log2, WG: gl.constexpr,
              G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """Where `own`: each row's own key (kt, vt, dst: `_own_loads`') written into the cache (no
    unit reads those slots in the step), and its score [64] (base 2, rows past q_len -inf:
    no key), from the staged Q tile, in the running max's layout."""
    k_cache, v_cache = new_kv[3], new_kv[4]
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    m = WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ok = (m // G < q_len) & own
    first = (ok & (m % G == 0))[:, None] & (cols < HEAD_DIM)[None, :]  # one write a key (its
    # G heads' rows share it)
    gl.store(k_cache + dst, kt, mask=first)
    gl.store(v_cache + dst, vt, mask=first)
    s = gl.sum(q_smem.load(o_layout).to(gl.float32) * kt.to(gl.float32), 1) * scale_log2
    return gl.convert_layout(gl.where(ok, s, float("-inf")), gl.SliceLayout(1, _mma_layout(BLOCK_N)))


@gluon.jit
def _own_join(acc, m_i, l_i, s, vt, HEAD_DIM: gl.constexpr):
    """The running (acc [64, D], m_i, l_i [64]) after one more online-softmax step: each
    row's own key, of score s (`_own_keys`) and value vt."""
    m_new = gl.maximum(m_i, s)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe)
    rows: gl.constexpr = gl.SliceLayout(1, _mma_layout(HEAD_DIM))
    acc = (acc * gl.convert_layout(alpha, rows)[:, None]
           + gl.convert_layout(p, rows)[:, None] * vt.to(gl.float32))
    return acc, m_new, l_i * alpha + p


@gluon.jit
def _walk(q_smem, k_bufs, v_bufs, k_ready, v_ready, empty, kv_lo, kv_hi, e0, num_tiles, it,
          scale_log2, causal, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
          TPE: gl.constexpr, FULL_SKIP: gl.constexpr, CAUSAL: gl.constexpr):
    """The unit's tiles it, it + 1, ... (num_tiles of them) into (acc [64, D] unnormalized,
    m_i, l_i [64]: running max and sum, base 2), releasing each stage once read. Software-
    pipelined as FlashAttention-3 within a warpgroup: the scores and softmax of tile j + 1 run
    while tile j's P V is on the tensor cores. FULL_SKIP: `_softmax`'s. CAUSAL: the position
    mask, causal = (kv_pos, qp, q_min: `_row_positions`)."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _IO_LAYOUT))
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    alpha = gl.full([64], 1.0, gl.float32, gl.SliceLayout(1, s_layout))
    pv = gl.zeros([64, BLOCK_N], dtype, p_layout)
    lo = e0 * 0  # the current tile's key slots [lo, hi)
    hi = e0 * 0
    kb = e0 * 0  # and (CAUSAL) its slot 0's key position
    if num_tiles > 0:  # (a unit with no entries reads no bounds: e0 may be past the last)
        lo, hi = _bounds(kv_lo, kv_hi, e0, 0, BLOCK_N, TPE)
        if CAUSAL:
            kb = _key_base(causal[0], kv_lo, e0, 0, BLOCK_N, TPE)
        sc = _scores(q_smem, k_bufs, k_ready, it, BLOCK_N, s_layout)
        pv, alpha, m_i, l_i = _softmax(sc, n, lo, hi, m_i, l_i, scale_log2, p_layout, dtype,
                                       FULL_SKIP, kb, causal, CAUSAL)
    for j in range(0, num_tiles - 1):
        s = (it + j) % stages
        # the next tile's bounds: loaded before the waits, so that their latency hides
        n_lo, n_hi = _bounds(kv_lo, kv_hi, e0, j + 1, BLOCK_N, TPE)
        n_kb = kb
        if CAUSAL:
            n_kb = _key_base(causal[0], kv_lo, e0, j + 1, BLOCK_N, TPE)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        nxt = _issue_scores(q_smem, k_bufs, k_ready, it + j + 1, BLOCK_N, s_layout)
        v_buf = _ready_v(v_bufs, v_ready, it + j, n_v, lo, hi)
        tok = warpgroup_mma(pv, v_buf, acc, is_async=True)
        sc, _, _ = warpgroup_mma_wait(1, deps=[nxt, q_smem, k_bufs.index((s + 1) % stages)])
        pv_next, alpha, m_i, l_i = _softmax(sc, n, n_lo, n_hi, m_i, l_i, scale_log2, p_layout,
                                            dtype, FULL_SKIP, n_kb, causal, CAUSAL)
        acc, _, _ = warpgroup_mma_wait(0, deps=[tok, v_buf, pv])
        pv = pv_next
        lo, hi, kb = n_lo, n_hi, n_kb
        gl.thread_barrier()  # every warp's products read stage s: release it
        mbarrier.arrive(empty.index(s), count=1)
    if num_tiles > 0:  # the last tile: nothing left to overlap
        last = it + num_tiles - 1
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        v_buf = _ready_v(v_bufs, v_ready, last, n_v, lo, hi)
        tok = warpgroup_mma(pv, v_buf, acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=[tok, v_buf, pv])
        gl.thread_barrier()
        mbarrier.arrive(empty.index(last % stages), count=1)
    return acc, m_i, l_i


@gluon.jit
def _write_rows(o, lse, acc, m_i, l_i, v_scale, out, q_len, h, stride_ot, stride_oh, stride_lt,
                WG: gl.constexpr, G: gl.constexpr, HEAD_DIM: gl.constexpr,
                WRITE_LSE: gl.constexpr):
    """o = acc / l x v_scale (an fp8 head's V scale, else 1: a power of two, exact; and lse =
    ln 2 (m + log2 l)) at the unit's out rows; a row that saw no key writes (0, -inf)."""
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    seen = l_i > 0.0
    inv = gl.convert_layout(1.0 / gl.where(seen, l_i, 1.0), gl.SliceLayout(1, o_layout))
    o_tile = gl.convert_layout((acc * inv[:, None] * v_scale).to(o.dtype.element_ty), _IO_LAYOUT)
    m = WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _IO_LAYOUT))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, _IO_LAYOUT))
    o_ptr = (o + (out + m // G).to(gl.int64)[:, None] * stride_ot
             + (h * G + m % G)[:, None] * stride_oh + cols[None, :])
    gl.store(o_ptr, o_tile, mask=(m // G < q_len)[:, None])
    if WRITE_LSE:
        ln_l = (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453  # x ln 2
        lse_row = gl.convert_layout(gl.where(seen, ln_l, float("-inf")),
                                    gl.SliceLayout(1, _IO_LAYOUT))
        gl.store(lse + (out + m // G).to(gl.int64) * stride_lt + h * G + m % G, lse_row,
                 mask=m // G < q_len)


@gluon.jit
def _skip(k_ready, v_ready, empty, it, num_tiles):
    """Tiles it, it + 1, ... of a unit whose rows here are all padding: wait, release."""
    stages: gl.constexpr = k_ready.type.shape[0]
    for j in range(0, num_tiles):
        s = (it + j) % stages
        mbarrier.wait(k_ready.index(s), ((it + j) // stages) & 1)
        mbarrier.wait(v_ready.index(s), ((it + j) // stages) & 1)
        mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def _issue_scores(q_smem, k_bufs, k_ready, it, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Wait for tile `it`'s K and start S = Q K^T [64, BLOCK_N] (async: a token)."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    mbarrier.wait(k_ready.index(it % stages), (it // stages) & 1)
    return warpgroup_mma(q_smem, k_bufs.index(it % stages).permute((1, 0)),
                         gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False,
                         is_async=True)


@gluon.jit
def _scores(q_smem, k_bufs, k_ready, it, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """S = Q K^T of tile `it`, waited for."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    tok = _issue_scores(q_smem, k_bufs, k_ready, it, BLOCK_N, s_layout)
    sc, _, _ = warpgroup_mma_wait(0, deps=[tok, q_smem, k_bufs.index(it % stages)])
    return sc


@gluon.jit
def _softmax(sc, n, lo, hi, m_i, l_i, scale_log2, p_layout: gl.constexpr, dtype: gl.constexpr,
             FULL_SKIP: gl.constexpr, kb, causal, CAUSAL: gl.constexpr):
    """Online-softmax step of one tile (scores sc [64, BLOCK_N], unscaled; its keys are the
    slots n [BLOCK_N] in [lo, hi), the others score -inf). Returns (P in the 16-bit dtype as
    the P V product's register operand, alpha: the rescale of the running output, m_i, l_i).
    FULL_SKIP: a tile whose slots are all keys (most of them) skips the select, which leaves
    such a tile's scores as they are: the output is bit-identical either way. With two row
    warpgroups that took 2-5% off three of the Hydragen grid's four FLOP-bound steps in every
    pass (the fourth: -8.5%, +3.5%, -6.3%; the launch alone up to 12%); with one, the branch
    made Table 3's 2,048-key all-shared step 2-4% slower in every pass, so it selects on every
    tile there (kernels-notes.md, issue 25 part eighteen). CAUSAL: in a tile whose last key
    follows the warpgroup's first row (a prompt's diagonal; slot n's key at position kb + n,
    the rows' at causal[1], the least causal[2]) a key after a row's position scores -inf for
    that row; the other tiles select nothing more."""
    BLOCK_N: gl.constexpr = sc.shape[1]
    if FULL_SKIP:
        if (lo > 0) | (hi < BLOCK_N):
            sc = gl.where(((n >= lo) & (n < hi))[None, :], sc, float("-inf"))
    else:
        sc = gl.where(((n >= lo) & (n < hi))[None, :], sc, float("-inf"))
    if CAUSAL:
        if kb + hi - 1 > causal[2]:
            sc = gl.where((kb + n)[None, :] <= causal[1][:, None], sc, float("-inf"))
    return _online(sc, m_i, l_i, scale_log2, p_layout, dtype)


@gluon.jit
def _online(sc, m_i, l_i, scale_log2, p_layout: gl.constexpr, dtype: gl.constexpr):
    """`_softmax` after its mask: (P, alpha, m_i, l_i) of the masked scores sc."""
    m_new = gl.maximum(m_i, gl.max(sc, 1) * scale_log2)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite
    p = gl.exp2(sc * scale_log2 - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_i


@gluon.jit
def _ready_v(v_bufs, v_ready, it, n_v, lo, hi):
    """Tile `it`'s V buffer, once loaded, with its rows outside the keys' slots [lo, hi) set
    to 0 if it has such rows (0 * a stale inf would be NaN; both row warpgroups may write
    the same zeros)."""
    stages: gl.constexpr = v_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = v_bufs.type.shape[1]
    v_buf = v_bufs.index(it % stages)
    mbarrier.wait(v_ready.index(it % stages), (it // stages) & 1)
    if (lo > 0) | (hi < BLOCK_N):
        _zero_outside(v_buf, n_v, lo, hi)
    return v_buf


@gluon.jit
def _zero_outside(buf, n, lo, hi):
    """buf [keys, D] in shared memory: its rows n (slots) outside [lo, hi) = 0, fenced for the
    tensor cores' reads."""
    vt = buf.load(_IO_LAYOUT)
    gl.thread_barrier()
    buf.store(gl.where(((n >= lo) & (n < hi))[:, None], vt, 0.0))
    fence_async_shared()
    gl.thread_barrier()
