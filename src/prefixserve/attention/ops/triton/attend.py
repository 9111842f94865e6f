"""The attend kernel: every work unit of a schedule, in one launch per unit class (`worklist`).

Program (unit u, KV head h) computes, for the unit's R query rows x the G query heads of h
(M = R * G rows, one tile), attention over the unit's entries, as fp32 partials:

    q tile   [BLOCK_M, D]   row m = (query row u.q_start + m // G, head h * G + m % G)
    keys     virtual slots: entry e0 + v // C_PAD, slot v % C_PAD of its chunk; a slot is a key
             iff it lies in the entry's [lo, hi); tiles of BLOCK_N virtual slots cover
             [e0, e1) (C_PAD = next_pow2(C)). BLOCK_N <= C_PAD: a tile is a slot range of one
             chunk (scalar index loads, one base address + the slots' offsets); else it spans
             BLOCK_N / C_PAD whole chunks (per-key gathers)
    scores   q @ k^T (tensor cores), masked to the entry's slots and, if CAUSAL, by position:
             key position kv_pos[e] + slot - lo[e] <= q_pos[row] (decode launches need no
             position mask: every key a decode row reads precedes it); if SLIDING (a sliding
             layer, window W > 0) always by both bounds, q_pos[row] - W < key position <= q_pos[row]
    online softmax in base 2 (FlashAttention), then o = acc / l, lse = ln 2 * (m + log2 l)

A row that sees no key writes (0, -inf). Masked lanes read nothing (loads return 0), so a NaN
in an unused slot cannot leak in.

STORE (decode): a unit whose `store` column names a row t (its one row) takes t's new key and
value at KV head h from k_new/v_new [T, Hkv, D] rather than from the cache: that key is the
last of the unit's last entry, so the tile walk ends one slot earlier there (or, if the entry
held nothing else, the work list left it out: `worklist`), the key joins the softmax from
registers after the walk, and the unit writes it into slots[t]. No program reads that slot
in the step (`worklist.mark_stores`), so the write needs no ordering. ROW_KEYS (a wide launch
that stores): a unit whose `store` is -2 - t holds the new keys of its rows t, t + 1, ...,
each row its own (worklist's `_absorb_keys`), loaded as a [BLOCK_M, D] tile.

MERGE (the narrow launch of a plan whose narrow units merge: worklist's `fused`): a unit
(one row) keeps its partial in registers and merges it with the row's other partials
(scratch rows `others`, written by the wide launch: after `griddepcontrol.wait` when PDL, the
launch having started beside the wide one, which TRIGGERs its dependents as it starts; by
stream order where it runs after it, `after_wide`, as the fp8 row walk often does), in
MERGE_CHUNK partials at a time (one round trip each), writing the final row in o's dtype:

    (m, d, acc) = (lse_own, 1, o_own);  per chunk: m' = max(m, max_i lse_i);
    acc = acc e^(m - m') + sum_i e^(lse_i - m') o_i;  d likewise;  o = acc / d, lse = m + ln d

FP8_CACHE (an fp8 cache, `reference`'s kv_scale [4, Hkv]): K/V tiles load as e4m3 (half the
bytes) and widen to fp16 in registers, exactly (a bf16 q tile is taken to fp16:
`store.fp8_query`); the head's K scale joins the score scale and its V scale multiplies the
output (powers of two: exact). A stored new key is quantized as the store launch quantizes it
(`store.quantize_fp8`) before it joins the softmax.

The host side -- checks, arguments, the grid, and where a Gluon launch runs instead -- is `launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .store import K_INV_ROW, K_SCALE_ROW, V_INV_ROW, V_SCALE_ROW, fp8_query, quantize_fp8

_LOG2E = 1.4426950408889634
MERGE_CHUNK = 8  # partials a merging narrow unit loads at once (a row's usually all of them)


@triton.jit
def _rows_mask(rows_ok, col_ok, EVEN_D: tl.constexpr):
    """[R, 1] (D a power of two: constant along each row, so accesses stay 16 bytes wide) or
    [R, BLOCK_D] (padded D) mask of a tile's valid elements."""
    if EVEN_D:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & col_ok


@triton.jit
def _tile_update(qt, kt, vt, key_ok, k_pos, qp, m_i, l_i, acc, scale_log2, window,
                 CAUSAL: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
                 DOT_FP32: tl.constexpr, K_FIRST: tl.constexpr = False):
    """One K/V tile ([BLOCK_N, BLOCK_D] each) into the running (m_i, l_i, acc) of qt's rows;
    K_FIRST: the scores as K Q^T (an fp8 cache's narrow tiles)."""
    if DOT_FP32:
        kt = kt.to(tl.float32)
    if K_FIRST:  # keys as the A operand: K^T as B would be a transposed load of the widened
        # 8-bit tile, which has no fast form; S^T = K Q^T then a [BLOCK_N, BLOCK_M] transpose
        # (fp8, H200: paged decode of 32 x 4,096 keys 401 -> 342 us, 32 x 2,048 208 -> 179).
        # Narrow tiles only: a wide tile's [64, 128] transpose costs more than it saves
        # (1,024 x 2K shared keys: 827 us with, 478 without; 16-bit 433)
        s = tl.trans(tl.dot(kt, tl.trans(qt), input_precision=PRECISION))
    else:
        s = tl.dot(qt, tl.trans(kt), input_precision=PRECISION)  # unscaled scores [BLOCK_M, BLOCK_N]
    if SLIDING:
        seen = (k_pos[None, :] <= qp[:, None]) & (k_pos[None, :] > qp[:, None] - window)
        s = tl.where(key_ok[None, :] & seen, s, float("-inf"))
    elif CAUSAL:
        s = tl.where(key_ok[None, :] & (k_pos[None, :] <= qp[:, None]), s, float("-inf"))
    else:  # one add per score: the mask is a [BLOCK_N] bias
        s = s + tl.where(key_ok, 0.0, float("-inf"))[None, :]
    # m_i is in scaled (base-2) units; scale > 0, so max(s) * scale = max(s * scale)
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite
    p = tl.exp2(s * scale_log2 - m_safe[:, None])  # one multiply-add per score
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = p.to(vt.dtype)  # 16-bit P on the tensor cores, as FlashAttention
    if DOT_FP32:
        pv, vt = pv.to(tl.float32), vt.to(tl.float32)
    acc = tl.dot(pv, vt, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_kernel(q, k_cache, v_cache, q_pos, units, unit_count, kv_chunk, kv_lo, kv_hi, kv_pos,
                   o, lse, k_new, v_new, slots, kv_scale, queue, fused, others, o_parts, lse_parts,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_kt, stride_kh,
                   stride_vt, stride_vh, stride_pt, stride_ph, stride_lp, scale_log2, chunk_size,
                   window, HKV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   C_PAD: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                   WRITE_LSE: tl.constexpr, STORE: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_FP32: tl.constexpr, FP8_CACHE: tl.constexpr, DYNAMIC: tl.constexpr,
                   MERGE: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
                   CHUNK: tl.constexpr, ROW_KEYS: tl.constexpr):
    # Persistent: program p takes work items p, p + P, p + 2P, ... of the unit_count[0] * HKV
    # (unit, KV head) pairs; units are longest first, so each stride of P items is balanced.
    # DYNAMIC: programs take the items in order from a device counter instead (`_take`).
    if TRIGGER:  # the merging narrow launch may start beside this one (`launch_worklist`)
        gdc_launch_dependents()
    num_work = tl.load(unit_count) * HKV
    w = _take(queue, tl.program_id(0), num_work, DYNAMIC)
    while w < num_work:
        nxt = _take(queue, w + tl.num_programs(0), num_work, DYNAMIC)  # taken now: its latency under this item
        merge = (fused, others, o_parts, lse_parts, stride_pt, stride_ph, stride_lp, w // HKV)
        _attend_unit(q, k_cache, v_cache, q_pos, kv_chunk, kv_lo, kv_hi, kv_pos, o, lse,
                     k_new, v_new, slots, kv_scale, _unit_head(units, w // HKV), w % HKV, merge,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_kt, stride_kh,
                     stride_vt, stride_vh, scale_log2, chunk_size, window, HKV, G, HEAD_DIM,
                     BLOCK_D, BLOCK_M, BLOCK_N, C_PAD, CAUSAL, SLIDING, WRITE_LSE, STORE,
                     PRECISION, DOT_FP32, FP8_CACHE, MERGE, PDL, CHUNK, ROW_KEYS)
        w = nxt
    if PDL:  # every program: this launch ends after the wide one, so the next kernel sees both
        gdc_wait()


@triton.jit
def _unit_head(units, u):
    """Unit u's row of the work list: (q_start, q_len, e0, e1, out, store; see `worklist`)."""
    row = units + u * 6
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4),
            tl.load(row + 5))


@triton.jit
def _take(queue, strided, num_work, DYNAMIC: tl.constexpr):
    """The next work item: `strided` (a fixed stride), or DYNAMIC the next of queue[0] (one
    atomic a take: a launch that shares the SMs with another keeps its resident programs busy
    while the rest wait for room). The counter is 0 when a launch starts and is left at 0:
    each of the P programs takes until a take returns >= num_work, then no more, so the
    launch's takes return 0 .. num_work + P - 1, and the program that gets the last resets
    it. Every other take precedes that one in the counter's order of atomics, and the reset
    follows it in its program, so no fence is needed (with a programs-done count, released
    at each program's end, Table 3's fp8 steps on an H200 took 1-3.6% longer: kernels-notes.md,
    issue 25 part forty)."""
    if DYNAMIC:
        w = tl.atomic_add(queue, 1, sem="relaxed")
        if w == num_work + tl.num_programs(0) - 1:
            tl.store(queue, 0)
        return w
    else:
        return strided


@triton.jit
def _attend_unit(q, k_cache, v_cache, q_pos, kv_chunk, kv_lo, kv_hi, kv_pos, o, lse,
                 k_new, v_new, slots, kv_scale, unit, h, merge, stride_qt, stride_qh, stride_ot,
                 stride_oh, stride_lt, stride_kt, stride_kh, stride_vt, stride_vh, scale_log2,
                 chunk_size, window, HKV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 C_PAD: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                 WRITE_LSE: tl.constexpr, STORE: tl.constexpr, PRECISION: tl.constexpr,
                 DOT_FP32: tl.constexpr, FP8_CACHE: tl.constexpr, MERGE: tl.constexpr,
                 PDL: tl.constexpr, CHUNK: tl.constexpr, ROW_KEYS: tl.constexpr):
    """The unit whose header is `unit` (`_unit_head`) x KV head h: the tile walk described in
    the module docstring. merge: (fused, others, o_parts, lse_parts, their three strides, the
    unit's index), read iff MERGE."""
    q_start, q_len, e0, e1, out, t = unit
    if MERGE:  # the row to merge and its first partials' scratch rows: loaded now, under the walk
        fused, others, o_parts, lse_parts, stride_pt, stride_ph, stride_lp, u = merge
        f, first, count = tl.load(fused + u * 3), tl.load(fused + u * 3 + 1), tl.load(fused + u * 3 + 2)
        c = tl.arange(0, CHUNK)
        parts0 = tl.load(others + first + c, mask=c < count, other=0).to(tl.int64)
    row_stride = HKV * HEAD_DIM  # elements per cache slot; caches are contiguous
    head_off = h * HEAD_DIM
    d = tl.arange(0, BLOCK_D)
    if FP8_CACHE:  # scores and output in the dequantized units (exact: powers of two)
        scale_log2 = scale_log2 * tl.load(kv_scale + K_SCALE_ROW * HKV + h)
    m = tl.arange(0, BLOCK_M)
    row, head = m // G, h * G + m % G  # [BLOCK_M]
    row_ok = row < q_len
    col_ok = (d < HEAD_DIM)[None, :]
    if STORE:  # t: the row whose new key this unit holds (-1: none; see worklist's `store`)
        e_new = tl.where(t >= 0, e1 - 1, -1)  # the entry whose last slot is the new key, if any
        t = tl.where(t >= -1, t, -2 - t).to(tl.int64)
        # the new key and value and their slot: loaded now, so that their latency hides
        # under the walk (a decode tail is a tile or two: each dependent load costs as much)
        if ROW_KEYS:  # [BLOCK_M, BLOCK_D]: row r's own key r (t + row; one row where t >= 0)
            key_row = (t + row).to(tl.int64)
            own_ok = row_ok & (key_row >= row)  # t >= 0 (a [BLOCK_M] mask: the interpreter
            # loads take no mask made with a scalar)
            kv_ok = own_ok[:, None] & col_ok
            kn = tl.load(k_new + key_row[:, None] * stride_kt + h * stride_kh + d[None, :], mask=kv_ok)
            vn = tl.load(v_new + key_row[:, None] * stride_vt + h * stride_vh + d[None, :], mask=kv_ok)
            dst = (tl.load(slots + key_row, mask=own_ok, other=0)[:, None] * row_stride + head_off
                   + d[None, :])
        else:  # [BLOCK_D]: a narrow unit's one row
            d_new = tl.where(t >= 0, HEAD_DIM, 0)  # its columns (none without a new key)
            kn = tl.load(k_new + t * stride_kt + h * stride_kh + d, mask=d < d_new)
            vn = tl.load(v_new + t * stride_vt + h * stride_vh + d, mask=d < d_new)
            dst = tl.load(slots + tl.maximum(t, 0)) * row_stride + head_off + d  # (t -1: unused)
    q_ptr = q + (q_start + row)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
    qt = tl.load(q_ptr + d[None, :], mask=_rows_mask(row_ok, col_ok, BLOCK_D == HEAD_DIM),
                 other=0.0)
    if FP8_CACHE:
        qt, scale_log2 = fp8_query(qt, scale_log2, q.dtype.element_ty == tl.bfloat16)
    if DOT_FP32:
        qt = qt.to(tl.float32)
    qp = tl.load(q_pos + q_start + row, mask=row_ok, other=-1)  # masked rows see nothing

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    if BLOCK_N <= C_PAD:  # a tile is slots [slot0, slot0 + BLOCK_N) of one entry's chunk
        for v0 in range(0, (e1 - e0) * C_PAD, BLOCK_N):
            e = e0 + v0 // C_PAD
            slot = v0 % C_PAD + n
            lo = tl.load(kv_lo + e)
            hi = tl.load(kv_hi + e)
            if STORE:  # the new key joins from registers
                hi = tl.where(e == e_new, hi - 1, hi)
            key_ok = (slot >= lo) & (slot < hi)
            k_pos = tl.load(kv_pos + e) + slot - lo
            base = tl.load(kv_chunk + e).to(tl.int64) * chunk_size * row_stride + head_off
            # offsets from the tile's slots, not a hoisted [BLOCK_N, BLOCK_D] offset tile:
            # 1-3.5% less time on the wide launch (H200; kernels-notes.md v9)
            tile_off = (slot * row_stride)[:, None] + d[None, :]
            kv_mask = _rows_mask(key_ok, col_ok, BLOCK_D == HEAD_DIM)
            kt = tl.load(k_cache + base + tile_off, mask=kv_mask, other=0.0)
            vt = tl.load(v_cache + base + tile_off, mask=kv_mask, other=0.0)
            if FP8_CACHE:
                kt, vt = kt.to(qt.dtype), vt.to(qt.dtype)  # exact
            m_i, l_i, acc = _tile_update(qt, kt, vt, key_ok, k_pos, qp, m_i, l_i, acc,
                                         scale_log2, window, CAUSAL, SLIDING, PRECISION,
                                         DOT_FP32, FP8_CACHE and BLOCK_M <= 16)
    else:  # a tile spans BLOCK_N / C_PAD entries: per-key gathers
        for v0 in range(0, (e1 - e0) * C_PAD, BLOCK_N):
            e = e0 + (v0 + n) // C_PAD
            slot = (v0 + n) % C_PAD
            e_ok = e < e1
            lo = tl.load(kv_lo + e, mask=e_ok, other=0)
            hi = tl.load(kv_hi + e, mask=e_ok, other=0)  # -> key_ok False past e1
            if STORE:
                hi = tl.where(e == e_new, hi - 1, hi)
            key_ok = (slot >= lo) & (slot < hi)
            k_pos = tl.load(kv_pos + e, mask=e_ok, other=0) + slot - lo
            chunk = tl.load(kv_chunk + e, mask=e_ok, other=0).to(tl.int64)
            kv_off = ((chunk * chunk_size + slot) * row_stride + head_off)[:, None] + d[None, :]
            kv_mask = _rows_mask(key_ok, col_ok, BLOCK_D == HEAD_DIM)
            kt = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
            vt = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
            if FP8_CACHE:
                kt, vt = kt.to(qt.dtype), vt.to(qt.dtype)  # exact
            m_i, l_i, acc = _tile_update(qt, kt, vt, key_ok, k_pos, qp, m_i, l_i, acc,
                                         scale_log2, window, CAUSAL, SLIDING, PRECISION,
                                         DOT_FP32, FP8_CACHE and BLOCK_M <= 16)

    if STORE:
        if t >= 0:  # the new key: one more online-softmax step (fp32), rounded to the cache's
            # dtype first, as the store launch writes it and later steps read it
            if FP8_CACHE:
                kc = quantize_fp8(kn, tl.load(kv_scale + K_INV_ROW * HKV + h))
                vc = quantize_fp8(vn, tl.load(kv_scale + V_INV_ROW * HKV + h))
            else:
                kc, vc = kn.to(k_cache.dtype.element_ty), vn.to(v_cache.dtype.element_ty)
            if ROW_KEYS:  # each row its own key; rows past q_len score -inf
                s_new = tl.sum(qt.to(tl.float32) * kc.to(tl.float32), 1) * scale_log2
                s_new = tl.where(own_ok, s_new, float("-inf"))
                v_add = vc.to(tl.float32)
                first = own_ok & (m % G == 0)  # one write a key (its G heads share it)
                mine = first[:, None] & col_ok
            else:  # q_len 1: rows m < G
                s_new = tl.sum(qt.to(tl.float32) * kc.to(tl.float32)[None, :], 1) * scale_log2
                v_add = vc.to(tl.float32)[None, :]
                mine = d < HEAD_DIM
            m_new = tl.maximum(m_i, s_new)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row: no key
            alpha = tl.exp2(m_i - m_safe)
            p_new = tl.exp2(s_new - m_safe)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_add
            m_i = m_new
            tl.store(k_cache + dst, kc, mask=mine)
            tl.store(v_cache + dst, vc, mask=mine)

    seen = l_i > 0.0
    o_tile = acc / tl.where(seen, l_i, 1.0)[:, None]
    if FP8_CACHE:
        o_tile = o_tile * tl.load(kv_scale + V_SCALE_ROW * HKV + h)
    ln_l = (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453  # x ln 2
    lse_row = tl.where(seen, ln_l, float("-inf"))
    if MERGE:
        if PDL:  # the wide launch's partials are written and visible past this
            gdc_wait()
        for g in tl.static_range(G):  # row 0 (one-row units) x head h * G + g
            _merge_row(o_tile, lse_row, m == g, parts0, first, count, others, o_parts, lse_parts,
                       stride_pt, stride_ph, stride_lp, o + f.to(tl.int64) * stride_ot
                       + (h * G + g) * stride_oh, lse + f.to(tl.int64) * stride_lt + h * G + g,
                       h * G + g, d, HEAD_DIM, WRITE_LSE, CHUNK)
    else:
        o_ptr = o + (out + row)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
        tl.store(o_ptr + d[None, :], o_tile.to(o.dtype.element_ty),
                 mask=_rows_mask(row_ok, col_ok, BLOCK_D == HEAD_DIM))
        if WRITE_LSE:
            tl.store(lse + (out + row).to(tl.int64) * stride_lt + head, lse_row, mask=row_ok)


@triton.jit
def _merge_row(o_tile, lse_rows, lane, parts0, first, count, others, o_parts, lse_parts, stride_pt,
               stride_ph, stride_lp, o_row, lse_out, head, d, HEAD_DIM: tl.constexpr,
               WRITE_LSE: tl.constexpr, CHUNK: tl.constexpr):
    """MERGE: the partial in the `lane` row of (o_tile [BLOCK_M, BLOCK_D], lse_rows) with the
    `count` scratch rows others[first:] (parts0: the first CHUNK of them, loaded), at query
    head `head`, into o_row [BLOCK_D] (o's dtype) and, if WRITE_LSE, lse_out."""
    d_ok = d < HEAD_DIM
    m = tl.max(tl.where(lane, lse_rows, float("-inf")), 0)
    acc = tl.sum(tl.where(lane[:, None], o_tile, 0.0), 0)  # [BLOCK_D]: 0 where it saw no key
    denom = tl.where(m == float("-inf"), 0.0, 1.0)
    c = tl.arange(0, CHUNK)
    m, denom, acc = _merge_chunk(parts0, c < count, m, denom, acc, o_parts, lse_parts, stride_pt,
                                 stride_ph, stride_lp, head, d, d_ok)
    for c0 in range(CHUNK, count, CHUNK):  # rows with more partials than a chunk
        ok = c0 + c < count
        parts = tl.load(others + first + c0 + c, mask=ok, other=0).to(tl.int64)
        m, denom, acc = _merge_chunk(parts, ok, m, denom, acc, o_parts, lse_parts, stride_pt,
                                     stride_ph, stride_lp, head, d, d_ok)
    seen = denom > 0.0
    tl.store(o_row + d, (acc / tl.where(seen, denom, 1.0)).to(o_row.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        tl.store(lse_out, tl.where(seen, m + tl.log(tl.where(seen, denom, 1.0)), float("-inf")))


@triton.jit
def _merge_chunk(parts, ok, m, denom, acc, o_parts, lse_parts, stride_pt, stride_ph, stride_lp,
                 head, d, d_ok):
    """(m, denom, acc [BLOCK_D]) merged with the partials at scratch rows parts [CHUNK] where ok
    (read through L2: another SM wrote them)."""
    lse_i = tl.load(lse_parts + parts * stride_lp + head, mask=ok, other=float("-inf"),
                    cache_modifier=".cg")
    o_i = tl.load(o_parts + parts[:, None] * stride_pt + head * stride_ph + d[None, :],
                  mask=ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
    m_new = tl.maximum(m, tl.max(lse_i, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    w = tl.exp(lse_i - m_safe)  # [CHUNK]: 0 where not ok
    acc = acc * alpha + tl.sum(w[:, None] * o_i, 0)
    return m_new, denom * alpha + tl.sum(w, 0), acc
