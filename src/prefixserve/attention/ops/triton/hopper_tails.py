"""The narrow attend launch of a decode step on Hopper (sm_90), in Gluon: decode tails of G > 1.

The same function as `attend._attend_kernel` over the narrow units of a step whose KV heads
have G = 2..16 query heads (Llama-3, Qwen3, Gemma 3, the Hydragen grid), no position mask,
a 16-bit cache, D 128; twin `ops.reference.attend_items`. Such a unit is a sequence's own
tail: q_len x G <= 16 query rows against a run of chunks that no other unit reads. The
Triton kernel walks it one 16-row tile at a time with one K/V tile in flight (its address
chain keeps Triton's pipeliner from buffering the next), so where the tails' bytes outlast
the shared products its programs stream ~47 GB/s an SM, where an SM can pull ~100 (issue 25
part twenty-eight). Here a CTA is one warpgroup walking work items (item w: unit w // Hkv,
KV head w % Hkv; p, p + P, ... or, DYNAMIC, each the next of a device counter, the first
too -- `hopper_rows._take` --, so that a CTA still waiting for room beside the products holds
none: started by PDL, the resident CTAs wait at their end for the wide launch, and a first
item held by one not yet resident would start only after the products, its whole walk
exposed; on an H200 relay's step on the Hydragen rows of 512-key tails under 8-16K shared
keys took 1-8% less than by stride first, issue 25 part thirty-one) with the products
swapped, so that the keys, not the rows, are wgmma's 64-row M side:

    a TMA ring   STAGES tiles [BLOCK_N = 64, D] of K and of V (`ready`: one mbarrier a
                 stage), issued up to STAGES - 1 tiles ahead of the walk across items
                 (`hopper_rows._issue`, `_next`)
    S^T = K Q^T  [64 keys, 16 rows] fp32: A the K tile, B the unit's Q [16, D] staged in
                 shared memory (rows past q_len x G zero)
    softmax      online, in base 2, over the keys: down S^T's columns (a column is a row)
    O^T += V^T P^T  [D, 16]: A the V tile read transposed, B P^T [64, 16] in 16 bits
                 through shared memory (wgmma's B operand), V rows outside [lo, hi) zeroed

Each item's query rows are copied (cp.async) into the second of two Q slots as the producer
moves on to it, and its new key (STORE, as `hopper_rows`: it joins the softmax from registers
after the walk and is written into its slot) is loaded before the walk, so that an item of a
few tiles does not wait for them. The launch writes partial rows (o, lse) for the merge launch.
The tensor cores do 4x the tails' products (16 rows for G = 4), beside the shared products'
275 GFLOP of a 16K-key Hydragen row about 12% more tensor work. One CTA (125 registers a
thread, 74 KB of shared memory) fits beside the Gluon wide CTA, 3 on a free SM.

Measured on an H200 against the Triton narrow launch (relay's step; kernels-notes.md, issue 25
part twenty-eight): where the wide units leave a quarter of the SMs or more to the tails, the
Hydragen grid's steps with 512-key tails 1-7% shorter, with 128-key tails -1%..+2%; where the
products hold every SM in two waves, up to 10% longer (beside one CTA an SM it streams no more
than the Triton kernel's two, and the chunk pairs' CTA leaves it no room); beside one wave of
them on every SM, 1-9% shorter while a wide item walks fewer than 64x a tail's entries (part
twenty-nine): `configs.choose_configs`, `TritonKernels.plan_extra`.

Gluon does not run in Triton's interpreter: tested on the GPU against the twin
(tests/attention/test_hopper_tails.py); CI tests the twin and the Triton kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .hopper_products import _IO_LAYOUT, _bounds, _mma_layout
from .hopper_rows import _issue, _item, _take

ROWS = gl.constexpr(16)  # query rows a unit (q_len x G <= NARROW_ROWS): S^T's N side
BLOCK_N = gl.constexpr(64)  # keys a tile: S^T's M side (wgmma's 64)


def supports(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, group: int,
             head_dim: int) -> bool:
    """The part of `applies` that a model's shape decides."""
    if torch.device(device).type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return dtype in (torch.float16, torch.bfloat16) and kv_dtype == dtype and 2 <= group <= ROWS.value and head_dim == 128


def applies(q: torch.Tensor, k_cache: torch.Tensor, block_n: int, causal: bool, window: int | None) -> bool:
    """Whether `launch` can run this narrow launch (`KernelConfig.tails`): G 2-16, a cache of
    q's dtype, D 128, no position mask, no sliding window, 64-key tiles within a chunk."""
    return (supports(q.device, q.dtype, k_cache.dtype, q.shape[1] // k_cache.shape[2], q.shape[-1])
            and block_n == BLOCK_N.value and not causal and window is None and k_cache.shape[1] % block_n == 0)


@gluon.jit
def _fetch_q(q, q_smem, units, w, num_work, stride_qt, HKV: gl.constexpr, G: gl.constexpr,
             HEAD_DIM: gl.constexpr):
    """Start copying item w's query rows [ROWS, D] into q_smem (cp.async, one group; column c
    of S^T: row row0 + c // G, head h G + c % G; past q_len x G, or past the work, zeros), so
    that the item's first product need not wait for them (`_next`: as the ring's producer
    moves on to the item, under the last one's walk)."""
    ok = w < num_work
    u = w // HKV
    h = w % HKV
    row0 = gl.load(units + u * 6, mask=ok, other=0)
    rows = gl.where(ok, gl.load(units + u * 6 + 1, mask=ok, other=0) * G, 0)
    c = gl.arange(0, ROWS, layout=gl.SliceLayout(1, _IO_LAYOUT))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, _IO_LAYOUT))
    ptr = q + (row0 + c // G).to(gl.int64)[:, None] * stride_qt + ((h * G + c % G) * HEAD_DIM)[:, None] + d[None, :]
    async_copy.async_copy_global_to_shared(q_smem, ptr, mask=(c < rows)[:, None])
    async_copy.commit_group()


@gluon.jit
def _next(q, q_bufs, queue, units, pid, taken, num_work, stride_qt, HKV: gl.constexpr, G: gl.constexpr,
          HEAD_DIM: gl.constexpr, TPE: gl.constexpr, DYNAMIC: gl.constexpr):
    """The producer's next item after `taken` ones -- (w, taken + 1, its first entry, its
    tiles) -- its query rows fetched into the Q slot after the consumer's (the producer is at
    most one item ahead of the walk: it moves on only from the walk's item)."""
    w = _take(queue, pid, taken, num_work, DYNAMIC, False)
    e0, n, _ = _item(units, w, num_work, HKV, TPE)
    _fetch_q(q, q_bufs.index((taken + 1) % 2), units, w, num_work, stride_qt, HKV, G, HEAD_DIM)
    return w, taken + 1, e0, n


@gluon.jit
def _zero_outside(buf, lo, hi):
    """buf [BLOCK_N, D] in shared memory: its rows (slots) outside [lo, hi) = 0 (0 * a stale inf
    would be NaN), 16 rows at a time (`hopper_products._zero_outside` holds the whole tile in
    registers), fenced for the tensor cores' reads."""
    n = gl.arange(0, 16, layout=gl.SliceLayout(1, _IO_LAYOUT))
    gl.thread_barrier()
    for i in gl.static_range(BLOCK_N // 16):
        rows = buf.slice(16 * i, 16)
        vt = rows.load(_IO_LAYOUT)
        rows.store(gl.where(((n + 16 * i >= lo) & (n + 16 * i < hi))[:, None], vt, 0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _tile(q_smem, k_buf, v_buf, p_smem, acc, m_i, l_i, lo, hi, sl2):
    """One online-softmax step over a K/V tile whose key slots [lo, hi) are keys (the
    others score -inf; their V rows are zeroed first): (acc [D, ROWS], m_i, l_i [ROWS])."""
    s_layout: gl.constexpr = _mma_layout(ROWS)
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    tok = warpgroup_mma(k_buf, q_smem.permute((1, 0)), gl.zeros([BLOCK_N, ROWS], gl.float32, s_layout),
                        use_acc=False, is_async=True)
    if (lo > 0) | (hi < BLOCK_N):
        _zero_outside(v_buf, lo, hi)
    sc, _, _ = warpgroup_mma_wait(0, deps=[tok, k_buf, q_smem])
    sc = gl.where(((n >= lo) & (n < hi))[:, None], sc * sl2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite
    p = gl.exp2(sc - m_safe[None, :])
    alpha = gl.exp2(m_i - m_safe)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()  # every warp's P^T is in shared memory
    tok = warpgroup_mma(v_buf.permute((1, 0)), p_smem, acc * alpha[None, :], is_async=True)
    acc, _, _ = warpgroup_mma_wait(0, deps=[tok, v_buf, p_smem])
    return acc, m_new, l_i * alpha + gl.sum(p, 0)


@gluon.jit
def _join_new(acc, m_i, l_i, qt, kn, vn, sl2, HEAD_DIM: gl.constexpr):
    """(acc, m_i, l_i) after one more online-softmax step: the unit's new key kn, value vn
    ([D], cache dtype) scored against its rows qt [ROWS, D]."""
    s_layout: gl.constexpr = _mma_layout(ROWS)
    s_new = gl.sum(qt.to(gl.float32) * gl.convert_layout(kn, gl.SliceLayout(0, _IO_LAYOUT)).to(gl.float32)[None, :],
                   1) * sl2
    s_new = gl.convert_layout(s_new, gl.SliceLayout(0, s_layout))
    m_new = gl.maximum(m_i, s_new)
    alpha = gl.exp2(m_i - m_new)
    p_new = gl.exp2(s_new - m_new)
    v_col = gl.convert_layout(vn, gl.SliceLayout(1, s_layout)).to(gl.float32)
    return acc * alpha[None, :] + v_col[:, None] * p_new[None, :], m_new, l_i * alpha + p_new


@gluon.jit
def _write(o, lse, acc, m_i, l_i, out, q_len, h, stride_ot, stride_lt, G: gl.constexpr, HEAD_DIM: gl.constexpr,
           WRITE_LSE: gl.constexpr):
    """o = acc / l at the unit's out rows (column c: row out + c // G, head h G + c % G), and
    lse = ln 2 (m + log2 l); a row that saw no key writes (0, -inf)."""
    s_layout: gl.constexpr = _mma_layout(ROWS)
    c = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, s_layout))
    seen = l_i > 0.0
    o_t = acc / gl.where(seen, l_i, 1.0)[None, :]
    row = (out + c // G).to(gl.int64)
    ptr = o + row[None, :] * stride_ot + ((h * G + c % G) * HEAD_DIM)[None, :] + d[:, None]
    gl.store(ptr, o_t.to(o.dtype.element_ty), mask=(c < q_len * G)[None, :])
    if WRITE_LSE:
        ln_l = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(lse + row * stride_lt + h * G + c % G, ln_l, mask=c < q_len * G)


@gluon.jit
def _tails_kernel(q, units, unit_count, kv_chunk, kv_lo, kv_hi, k_desc, v_desc, o, lse, k_cache, v_cache,
                  k_new, v_new, slots, queue, stride_qt, stride_ot, stride_lt, stride_kt, stride_vt,
                  scale_log2, chunk_size, HKV: gl.constexpr, G: gl.constexpr, HEAD_DIM: gl.constexpr,
                  TPE: gl.constexpr, STAGES: gl.constexpr, WRITE_LSE: gl.constexpr, STORE: gl.constexpr,
                  DYNAMIC: gl.constexpr, PDL: gl.constexpr):
    dtype: gl.constexpr = k_desc.dtype
    s_layout: gl.constexpr = _mma_layout(ROWS)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype))
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, ROWS],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROWS], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, _IO_LAYOUT))
    num_work = gl.load(unit_count) * HKV
    pid = gl.program_id(0)
    taken = 1
    w = _take(queue, pid, 0, num_work, DYNAMIC, False)  # the walk's item; the producer's, pw: w or the one after it
    pw = w
    p_e0, p_n, _ = _item(units, pw, num_work, HKV, TPE)
    _fetch_q(q, q_bufs.index(1), units, pw, num_work, stride_qt, HKV, G, HEAD_DIM)  # Q slot: taken % 2
    pj = 0  # the producer's next tile of item pw, `issued` tiles so far
    issued = 0
    it = 0  # tiles walked so far: tile it is in slot it % STAGES, lap it // STAGES
    while w < num_work:
        u = w // HKV
        h = w % HKV
        q_len = gl.load(units + u * 6 + 1)
        e0 = gl.load(units + u * 6 + 2)
        e1 = gl.load(units + u * 6 + 3)
        e_new = -1
        if STORE:  # t >= 0: the new key is the last slot of entry e1 - 1; -2 - t: left out; -1: none
            t = gl.load(units + u * 6 + 5)
            e_new = gl.where(t >= 0, e1 - 1, -1)
            t = gl.where(t >= -1, t, -2 - t).to(gl.int64)
            d_new = gl.where(t >= 0, HEAD_DIM, 0)  # loaded before the walk, so that their latency hides
            kn = gl.load(k_new + t * stride_kt + h * HEAD_DIM + d, mask=d < d_new, other=0.0)
            vn = gl.load(v_new + t * stride_vt + h * HEAD_DIM + d, mask=d < d_new, other=0.0)
        # the item's Q slot: the walk's item is the producer's (taken) or the one before it
        q_smem = q_bufs.index(gl.where(pw == w, taken, taken - 1) % 2)
        async_copy.wait_group(0)  # (the producer has not moved past this item: its copy is the last)
        fence_async_shared()
        gl.thread_barrier()
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(0, s_layout))
        acc = gl.zeros([HEAD_DIM, ROWS], gl.float32, s_layout)
        for j in range(0, (e1 - e0) * TPE):
            # tiles it .. it + STAGES - 1 in flight: slot (it - 1) % STAGES is free (the
            # barrier that ended tile it - 1)
            more = 1
            while (more == 1) & (issued < it + STAGES):
                if pj < p_n:
                    _issue(k_desc, v_desc, k_bufs, v_bufs, ready, kv_chunk, p_e0, pj, (pw % HKV) * HEAD_DIM,
                           issued % STAGES, chunk_size, BLOCK_N, TPE)
                    pj += 1
                    issued += 1
                elif pw == w:  # on to the next item
                    pw, taken, p_e0, p_n = _next(q, q_bufs, queue, units, pid, taken, num_work, stride_qt, HKV, G,
                                                 HEAD_DIM, TPE, DYNAMIC)
                    pj = 0
                else:
                    more = 0
            s = it % STAGES
            lo, hi = _bounds(kv_lo, kv_hi, e0, j, BLOCK_N, TPE)
            hi = gl.where(e0 + j // TPE == e_new, hi - 1, hi)  # the new key joins from registers
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc, m_i, l_i = _tile(q_smem, k_bufs.index(s), v_bufs.index(s), p_smem, acc, m_i, l_i, lo, hi,
                                  scale_log2)
            gl.thread_barrier()  # every warp is done with slot s: a later top-up may refill it
            it += 1
        if STORE:
            if t >= 0:  # the new key: one more online-softmax step, then into its slot
                kc = kn.to(k_cache.dtype.element_ty)
                vc = vn.to(v_cache.dtype.element_ty)
                acc, m_i, l_i = _join_new(acc, m_i, l_i, q_smem.load(_IO_LAYOUT), kc, vc, scale_log2, HEAD_DIM)
                dst = gl.load(slots + t) * (HKV * HEAD_DIM) + h * HEAD_DIM + d
                gl.store(k_cache + dst, kc)
                gl.store(v_cache + dst, vc)
        _write(o, lse, acc, m_i, l_i, gl.load(units + u * 6 + 4), q_len, h, stride_ot, stride_lt, G, HEAD_DIM,
               WRITE_LSE)
        if pw == w:  # the producer had not moved on: the next item starts its ring tiles
            pw, taken, p_e0, p_n = _next(q, q_bufs, queue, units, pid, taken, num_work, stride_qt, HKV, G, HEAD_DIM,
                                         TPE, DYNAMIC)
            pj = 0
        w = pw
    if PDL:  # started beside the wide launch: ends after it, so the next kernel sees both
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, units: torch.Tensor,
           count: torch.Tensor, kv_chunk: torch.Tensor, kv_lo: torch.Tensor, kv_hi: torch.Tensor,
           scale: float, o: torch.Tensor, lse: torch.Tensor | None, programs: int, stages: int, maxnreg: int,
           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           queue: torch.Tensor | None = None, pdl: bool = False) -> None:
    """`launch.launch_units` for a narrow launch that `applies`: the first count[0] units on a
    persistent grid of `programs` one-warpgroup CTAs, 64-key tiles in a `stages`-deep ring, at
    most `maxnreg` registers a thread; o, lse: partial rows. pdl: started beside the wide
    launch by PDL (`launch.pdl_beside`)."""
    n_chunks, chunk_size, hkv, d = k_cache.shape
    gdt = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[k_cache.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N.value, d], gdt)
    k_desc, v_desc = (TensorDescriptor(c, [n_chunks * chunk_size, hkv * d], [hkv * d, 1], [BLOCK_N.value, d], layout)
                      for c in (k_cache, v_cache))
    k_new, v_new, slots = new_kv or (q, q, units)
    assert q.stride(-1) == 1 and q.stride(1) == d and o.stride(-1) == 1 and o.stride(1) == d
    assert k_new.stride(-1) == 1 and k_new.stride(1) == d and v_new.stride(-1) == 1 and v_new.stride(1) == d
    _tails_kernel[(programs,)](
        q, units, count, kv_chunk, kv_lo, kv_hi, k_desc, v_desc, o, o if lse is None else lse, k_cache, v_cache,
        k_new, v_new, slots, units if queue is None else queue, q.stride(0), o.stride(0),
        0 if lse is None else lse.stride(0), k_new.stride(0), v_new.stride(0), scale * 1.4426950408889634,
        chunk_size, HKV=hkv, G=q.shape[1] // hkv, HEAD_DIM=d, TPE=chunk_size // BLOCK_N.value, STAGES=stages,
        WRITE_LSE=lse is not None, STORE=new_kv is not None, DYNAMIC=queue is not None, PDL=pdl, num_warps=4,
        maxnreg=maxnreg, **({"launch_pdl": True} if pdl else {}))
