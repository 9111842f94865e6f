"""The narrow attend launch of a decode step on Hopper (sm_90), in Gluon: a row walk.

The same function as `attend._attend_kernel` over the narrow units of a step with one query
head a KV head (G = 1: Llama-2-7B, CodeLlama-13B), no position mask (decode) and an fp8 KV
cache -- or a 16-bit one where the walk runs beside the shared products (below) --, twin
`ops.reference.attend_items`. Such a unit has 1-16 rows, mostly 1 (a sequence's own tail):
it fills 1 of the 16 rows of the Triton kernel's narrow tile, where the tensor cores buy
nothing and a program walks one tile at a time, its loads behind its math. Here each CTA is
one warp (8 an SM; 89-128 registers a thread and 16 KB of shared memory, so that they also
fit beside the Gluon wide CTA: `hopper.MAXNREG`), walking work items (item w: unit w // Hkv,
KV head w % Hkv; first p, then p + P, ... or, DYNAMIC, the next of a device counter, as
`attend._take`, `_next_item`: a CTA that waits for room beside the products holds one item, not 1/P of
them), each row of a unit's one walk over its tiles, with

    a TMA ring   STAGES tiles [BLOCK_N, D] of K and of V (`ready`: one mbarrier a stage),
                 issued up to STAGES - 1 tiles ahead of the walk, across items: the producer
                 runs on into the item after the walk's (taken when it gets there), so that
                 item's first tiles load under this one's last
    the math     on CUDA cores in fp32, the e4m3 values widened in registers (exactly), the
                 head's K scale in the score scale and its V scale on the output (powers
                 of two: exact; not FP8, a 16-bit cache: no scales): a lane holds 8
                 contiguous D values of BLOCK_N / 4 keys (layout KL), scores s = q . k
                 reduced over 8 lanes, the online softmax in base 2, acc += p v -- a short
                 chain of FMAs a tile, no P layout change (the loop is bound by its latency,
                 not its issue: the scores by mma, 18% fewer instructions, measured no
                 faster; nor by the warps an SM: two warps a CTA, each on half of every
                 tile, 2-4% slower at the same grid and ring; kernels-notes.md, issue 25
                 parts twenty-four and twenty-five)

Measured on an H200 against the Triton narrow launch (kernels-notes.md, issue 25 part nine):
where a plan takes it and where not is `configs.choose_configs`'s. Over a 16-bit cache the
same walk measured within 0.6% of the Triton kernel on paged decode, made the engine's
1,024 x 16K step 1-4% slower and Table 3's rows with tails 1-5% slower after the products,
so it reads a 16-bit cache only beside them, on SMs of their own (`merge_beside`: Table 3's
rows whose shared keys are 3x a tail's 1-11% faster; issue 25 part twenty-four).

Tiles: the cache viewed as [chunks * C, Hkv * D]; tile j of entry e: rows kv_chunk[e] * C +
(j % TPE) * BLOCK_N, + BLOCK_N (TPE = C // BLOCK_N), columns h * D, + D. A slot outside the
entry's [lo, hi) scores -inf and its V row is zeroed in registers (a where: a stale NaN or inf
cannot reach the output). STORE as in `attend`: a one-row unit's new key joins the softmax
from registers after the walk (over fp8 quantized first, as the store launch quantizes it:
`_quantize_rounded`), and is written to its slot. MERGE as in `attend` (the walk with the wide
launch of units of <= 64 rows: worklist's `fused`): a one-row unit merges its row with the
wide units' partials and writes the final row (no merge launch; on an H200 2.1-3.5 us off
each of Table 3's fp8 rows with tails: kernels-notes.md, issue 25 part sixteen). After that
launch (`after_wide`) stream order makes them visible; beside it (PDL, `merge_beside`: the
wide units on SMs of their own, `grids.walk_sms`) a unit waits for its end
(`griddepcontrol.wait`) once it has walked its tail, before the merge.

Gluon does not run in Triton's interpreter: tested on the GPU against the twin
(tests/attention/test_hopper_rows.py); CI tests the twin and the Triton kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..reference import FP8
from .attend import MERGE_CHUNK
from .hopper_products import _K_INV, _K_SCALE, _V_INV, _V_SCALE, _bounds, _quantize_rounded
from .launch import Merge

KL = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0]))  # [BLOCK_N, D] over 1 warp


def supports(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, group: int,
             head_dim: int) -> bool:
    """The part of `applies` that a model's shape decides."""
    if torch.device(device).type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return dtype in (torch.float16, torch.bfloat16) and kv_dtype in (FP8, dtype) and group == 1 and head_dim in (64, 128)


def applies(q: torch.Tensor, k_cache: torch.Tensor, block_n: int, causal: bool, window: int | None) -> bool:
    """Whether `launch` can run this narrow launch (`KernelConfig.walk`: a decode step's, the
    plan's choice): G 1, an fp8 cache or one of q's dtype, no position mask, no sliding
    window, tiles within a chunk."""
    chunk = k_cache.shape[1]
    return (supports(q.device, q.dtype, k_cache.dtype, q.shape[1] // k_cache.shape[2], q.shape[-1])
            and not causal and window is None and chunk % block_n == 0)


@gluon.jit
def _item(units, w, num_work, HKV: gl.constexpr, TPE: gl.constexpr):
    """Item w's first entry, tiles of one row's walk, tiles of all its rows' (0 past the work)."""
    ok = w < num_work
    u = w // HKV
    e0 = gl.load(units + u * 6 + 2, mask=ok, other=0)
    per_row = (gl.load(units + u * 6 + 3, mask=ok, other=0) - e0) * TPE
    return e0, per_row, per_row * gl.load(units + u * 6 + 1, mask=ok, other=0)


@gluon.jit
def _take(queue, pid, taken, num_work, DYNAMIC: gl.constexpr, STRIDE_FIRST: gl.constexpr):
    """Work item number `taken` (from 0) of CTA p: p + taken * P, or DYNAMIC the next of
    queue[0] -- after a first item p by stride where STRIDE_FIRST (the counter then counts
    from P; the caller takes item 0 itself, and a CTA p >= num_work none), else the first one
    too (`hopper_tails`, whose CTAs may wait for room beside the products). The row walk takes
    its first by stride: its 16 KB CTAs are all resident, and the first from the counter was
    1-2% slower on Table 3's fp8 rows on an H200 (kernels-notes.md, issue 25 part thirty-one).
    Either way the launch's last take returns num_work + P - 1, and its CTA resets the
    counter for the next launch (`attend._take`)."""
    w = pid + taken * gl.num_programs(0)
    if DYNAMIC:
        w = gl.atomic_add(queue, 1, sem="relaxed")
        if STRIDE_FIRST:
            w += gl.num_programs(0)
        if w == num_work + gl.num_programs(0) - 1:
            gl.store(queue, 0)
    return w


@gluon.jit
def _next_item(queue, units, pid, taken, num_work, HKV: gl.constexpr, TPE: gl.constexpr,
               DYNAMIC: gl.constexpr):
    """The program's next work item after `taken` ones (`_take`, its first by stride) and
    `_item` of it: (w, taken + 1, *_item)."""
    w = _take(queue, pid, taken, num_work, DYNAMIC, True)
    e0, per_row, n = _item(units, w, num_work, HKV, TPE)
    return w, taken + 1, e0, per_row, n


@gluon.jit
def _issue(k_desc, v_desc, k_bufs, v_bufs, ready, kv_chunk, e0, j, col, slot, chunk_size,
           BLOCK_N: gl.constexpr, TPE: gl.constexpr):
    """TMA copies of tile j of a walk from entry e0 (K and V, columns col..) into ring slot `slot`."""
    row = gl.load(kv_chunk + e0 + j // TPE) * chunk_size + (j % TPE) * BLOCK_N
    mbarrier.expect(ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], ready.index(slot), k_bufs.index(slot))
    tma.async_copy_global_to_shared(v_desc, [row, col], ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _rows_kernel(q, units, unit_count, kv_chunk, kv_lo, kv_hi, k_desc, v_desc, o, lse,
                 k_cache, v_cache, k_new, v_new, slots, kv_scale, queue, fused, others, o_parts,
                 lse_parts, stride_qt, stride_ot, stride_lt, stride_kt, stride_vt, stride_pt,
                 stride_lp, scale_log2, chunk_size, HKV: gl.constexpr, HEAD_DIM: gl.constexpr,
                 BLOCK_N: gl.constexpr, TPE: gl.constexpr, STAGES: gl.constexpr,
                 WRITE_LSE: gl.constexpr, STORE: gl.constexpr, DYNAMIC: gl.constexpr,
                 MERGE: gl.constexpr, PDL: gl.constexpr, CHUNK: gl.constexpr, FP8: gl.constexpr):
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, KL))  # [BLOCK_N] a tile's slots
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, KL))  # [D]
    num_work = gl.load(unit_count) * HKV
    pid = gl.program_id(0)
    taken = 1
    w = pid  # the walk's item; the producer's, pw: w or the one after it
    pw = w
    p_e0, p_row, p_n = _item(units, pw, num_work, HKV, TPE)
    pj = 0  # the producer's next tile of item pw (pjj: of the row walk), `issued` tiles so far
    pjj = 0
    issued = 0
    it = 0  # tiles walked so far: tile it is in slot it % STAGES, lap it // STAGES
    while w < num_work:
        u = w // HKV
        h = w % HKV
        e0 = gl.load(units + u * 6 + 2)
        e1 = gl.load(units + u * 6 + 3)
        e_new = -1
        if STORE:  # (a one-row unit) t >= 0: the new key is the last slot of entry e1 - 1;
            # -2 - t: left out; -1: none
            t = gl.load(units + u * 6 + 5)
            e_new = gl.where(t >= 0, e1 - 1, -1)
            t = gl.where(t >= -1, t, -2 - t).to(gl.int64)
            d_new = gl.where(t >= 0, HEAD_DIM, 0)
            kn = gl.load(k_new + t * stride_kt + h * HEAD_DIM + c, mask=c < d_new, other=0.0)
            vn = gl.load(v_new + t * stride_vt + h * HEAD_DIM + c, mask=c < d_new, other=0.0)
        sl2 = scale_log2
        if FP8:
            sl2 = scale_log2 * gl.load(kv_scale + _K_SCALE * HKV + h)  # the head's K scale (exact)
        for r in range(0, gl.load(units + u * 6 + 1)):  # the unit's rows, one walk each
            row = gl.load(units + u * 6) + r
            qv = gl.load(q + row.to(gl.int64) * stride_qt + h * HEAD_DIM + c).to(gl.float32)  # [D]
            m_i = gl.max(gl.full([BLOCK_N], float("-inf"), gl.float32, gl.SliceLayout(1, KL)), 0)
            l_i = gl.sum(gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, KL)), 0)
            acc = gl.zeros([HEAD_DIM], gl.float32, gl.SliceLayout(0, KL))
            for j in range(0, (e1 - e0) * TPE):
                # tiles it .. it + STAGES - 1 in flight: slot (it - 1) % STAGES is free (the
                # barrier that ended tile it - 1)
                more = 1
                while (more == 1) & (issued < it + STAGES):
                    if pj < p_n:
                        _issue(k_desc, v_desc, k_bufs, v_bufs, ready, kv_chunk, p_e0, pjj, (pw % HKV) * HEAD_DIM,
                               issued % STAGES, chunk_size, BLOCK_N, TPE)
                        pj += 1
                        pjj += 1
                        pjj = gl.where(pjj == p_row, 0, pjj)
                        issued += 1
                    elif pw == w:  # on to the next item
                        pw, taken, p_e0, p_row, p_n = _next_item(queue, units, pid, taken, num_work, HKV, TPE,
                                                                 DYNAMIC)
                        pj = 0
                        pjj = 0
                    else:
                        more = 0
                s = it % STAGES
                lo, hi = _bounds(kv_lo, kv_hi, e0, j, BLOCK_N, TPE)
                hi = gl.where(e0 + j // TPE == e_new, hi - 1, hi)  # the new key joins from registers
                key_ok = (n >= lo) & (n < hi)
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                kt = k_bufs.index(s).load(KL).to(gl.float32)  # [BLOCK_N, D]
                sc = gl.where(key_ok, gl.sum(kt * qv[None, :], 1) * sl2, float("-inf"))  # [BLOCK_N]
                m_new = gl.maximum(m_i, gl.max(sc, 0))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                p = gl.exp2(sc - m_safe)
                alpha = gl.exp2(m_i - m_safe)
                l_i = l_i * alpha + gl.sum(p, 0)
                m_i = m_new
                vt = gl.where(key_ok[:, None], v_bufs.index(s).load(KL).to(gl.float32), 0.0)
                acc = acc * alpha + gl.sum(p[:, None] * vt, 0)
                gl.thread_barrier()  # the warp is done with slot s: a later top-up may refill it
                it += 1
            if STORE:
                if t >= 0:  # the new key: one more online-softmax step, then into its slot
                    if FP8:
                        kc = _quantize_rounded(kn, gl.load(kv_scale + _K_INV * HKV + h))
                        vc = _quantize_rounded(vn, gl.load(kv_scale + _V_INV * HKV + h))
                    else:
                        kc = kn.to(k_cache.dtype.element_ty)
                        vc = vn.to(v_cache.dtype.element_ty)
                    s_new = gl.sum(qv * kc.to(gl.float32), 0) * sl2
                    m_new = gl.maximum(m_i, s_new)
                    alpha = gl.exp2(m_i - m_new)
                    p_new = gl.exp2(s_new - m_new)
                    l_i = l_i * alpha + p_new
                    acc = acc * alpha + p_new * vc.to(gl.float32)
                    m_i = m_new
                    dst = gl.load(slots + t) * (HKV * HEAD_DIM) + h * HEAD_DIM + c
                    gl.store(k_cache + dst, kc)
                    gl.store(v_cache + dst, vc)
            seen = l_i > 0.0
            o_row = acc / gl.where(seen, l_i, 1.0)
            if FP8:
                o_row = o_row * gl.load(kv_scale + _V_SCALE * HKV + h)
            ln_l = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                            float("-inf"))  # x ln 2
            out = gl.load(units + u * 6 + 4).to(gl.int64) + r
            if MERGE:  # (a one-row unit) the final row, its other partials, then (o, lse) of it
                out = gl.load(fused + u * 3).to(gl.int64)
                if PDL:  # started beside the wide launch: its partials once it has ended
                    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                              is_pure=False, pack=1)
                o_row, ln_l = _merge_row(o_row, ln_l, gl.load(fused + u * 3 + 1), gl.load(fused + u * 3 + 2),
                                         others, o_parts, lse_parts, stride_pt, stride_lp, h, c, HEAD_DIM, CHUNK)
            gl.store(o + out * stride_ot + h * HEAD_DIM + c, o_row.to(o.dtype.element_ty))
            if WRITE_LSE:
                gl.store(lse + out * stride_lt + h, ln_l)
        if pw == w:  # the producer had not moved on: the next item starts its ring tiles
            pw, taken, p_e0, p_row, p_n = _next_item(queue, units, pid, taken, num_work, HKV, TPE, DYNAMIC)
            pj = 0
            pjj = 0
        w = pw


@gluon.jit
def _merge_row(o_row, lse_row, first, count, others, o_parts, lse_parts, stride_pt, stride_lp, h, c,
               HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr):
    """(o, lse) of a row whose own partial is (o_row [D] fp32, lse_row) and whose other
    partials are scratch rows others[first:][:count] at head h (the wide launch's, which ended
    before this launch began), CHUNK at a time: `attend._merge_row`'s arithmetic."""
    k = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, KL))
    m = lse_row
    acc = o_row  # 0 where it saw no key
    denom = gl.where(m == float("-inf"), 0.0, 1.0)
    for c0 in range(0, count, CHUNK):
        ok = c0 + k < count
        parts = gl.load(others + first + c0 + k, mask=ok, other=0).to(gl.int64)
        lse_i = gl.load(lse_parts + parts * stride_lp + h, mask=ok, other=float("-inf"))  # [CHUNK]
        o_i = gl.load(o_parts + parts[:, None] * stride_pt + h * HEAD_DIM + c[None, :], mask=ok[:, None],
                      other=0.0)  # [CHUNK, D]
        m_new = gl.maximum(m, gl.max(lse_i, 0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m - m_safe)
        w = gl.exp(lse_i - m_safe)  # 0 where not ok
        acc = acc * alpha + gl.sum(w[:, None] * o_i, 0)
        denom = denom * alpha + gl.sum(w, 0)
        m = m_new
    seen = denom > 0.0
    return (acc / gl.where(seen, denom, 1.0),
            gl.where(seen, m + gl.log(gl.where(seen, denom, 1.0)), float("-inf")))


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, units: torch.Tensor,
           count: torch.Tensor, kv_chunk: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor,
           scale: float, o: torch.Tensor, lse: torch.Tensor | None, programs: int, block_n: int,
           stages: int, maxnreg: int, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           kv_scale: torch.Tensor | None = None, queue: torch.Tensor | None = None,
           merge: Merge | None = None) -> None:
    """`launch.launch_units` for a narrow launch that `applies`: the first count[0] units on a
    persistent grid of `programs` one-warp CTAs, tiles of `block_n` keys in a `stages`-deep
    ring, at most `maxnreg` registers a thread. merge: its units merge their rows (o, lse:
    the final rows) with the wide launch's partials -- started beside it by PDL if merge.pdl."""
    n_chunks, chunk_size, hkv, d = k_cache.shape
    fp8 = k_cache.dtype == FP8
    assert kv_scale is not None or not fp8
    gdt = {FP8: gl.float8e4nv, torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[k_cache.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    k_desc, v_desc = (TensorDescriptor(c, [n_chunks * chunk_size, hkv * d], [hkv * d, 1], [block_n, d], layout)
                      for c in (k_cache, v_cache))
    k_new, v_new, slots = new_kv or (q, q, units)
    assert q.stride(-1) == 1 and q.stride(1) == d and o.stride(-1) == 1 and o.stride(1) == d
    assert k_new.stride(-1) == 1 and k_new.stride(1) == d and v_new.stride(-1) == 1 and v_new.stride(1) == d
    if merge is not None:
        assert merge.o_parts.stride(1) == d and merge.o_parts.stride(-1) == 1
    pdl = merge is not None and merge.pdl
    fused, others, o_parts, lse_parts = ((merge.rows, merge.others, merge.o_parts, merge.lse_parts)
                                         if merge else (units, units, o, o))
    _rows_kernel[(programs,)](
        q, units, count, kv_chunk, kv_lo, kv_hi, k_desc, v_desc, o, o if lse is None else lse,
        k_cache, v_cache, k_new, v_new, slots, o if kv_scale is None else kv_scale,
        o if queue is None else queue, fused, others, o_parts, lse_parts, q.stride(0),
        o.stride(0), 0 if lse is None else lse.stride(0), k_new.stride(0), v_new.stride(0),
        o_parts.stride(0), lse_parts.stride(0), scale * 1.4426950408889634, chunk_size, HKV=hkv,
        HEAD_DIM=d, BLOCK_N=block_n, TPE=chunk_size // block_n, STAGES=stages,
        WRITE_LSE=lse is not None, STORE=new_kv is not None, DYNAMIC=queue is not None,
        MERGE=merge is not None, PDL=pdl, CHUNK=MERGE_CHUNK, FP8=fp8, num_warps=1, maxnreg=maxnreg,
        **({"launch_pdl": True} if pdl else {}))
