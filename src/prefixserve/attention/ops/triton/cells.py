"""Deterministic mode on the GPU: the cell kernel and `CellKernels`, the executor of cell plans
(the twin of `ops.reference.attend_cells` + `merge_in_order`; see attention/cells.py).

Program (unit u, KV head h): the unit's R query rows x G heads against each of its segments
(one cell's tiles, `cell_worklist`) in turn, one tile of BLOCK_N positions at a time: the keys
are gathered lane by lane from `tile_slots`, absent lanes load nothing and are masked, and the
tile goes through the attend kernel's online-softmax update (`attend._tile_update`). A
segment starts afresh or from a state a prefix unit stored (a split cell's shared tiles), and
ends in a partial or, for a prefix unit, in that raw state. So a (row, cell) partial is the
same chain of tile updates whichever units compute it -- a shared cell's unit of many rows,
a prefix and its continuation, or one sequence's unit -- and the merge folds a row's partials
in cell order. What differs from the default path, and why:

    no split of a cell across units              a split would change the row's sum
    tiles at fixed positions, gathered           chunk-aligned tiles follow the storage layout
    K/V stored first, then read from the cache   the default decode step's register-fed newest
                                                 key is one more update, off the tile grid
    every row merged, in cell order              one partial or many: the same fold
    two launch shapes whose warps hold whole     tl.sum adds a row of P in an order that
    16-row slices (16 rows / 1 warp, 64 / 4)     follows the register layout: 32 rows on 2
                                                 warps gave other bits (H100, `cell_configs`)
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ...base import AttentionBatch, AttentionShape
from ...plan import DevicePlan, HostArrays, HostExtras, required
from ..reference import FP8
from .attend import _LOG2E, _rows_mask, _tile_update
from .cell_worklist import build_cell_work, newest_tiles
from .configs import NARROW_ROWS, KernelConfig, choose_configs, next_pow2
from .kernels import _addressable, _int, _tensor
from .launch import grid_size, num_sms
from .merge import merge_rows
from .store import K_SCALE_ROW, V_SCALE_ROW, fp8_query, store_kv


@triton.jit
def _cell_kernel(q, k_cache, v_cache, q_pos, units, unit_count, segs, tile_slots, tile_pos, o, lse, l_state,
                 kv_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, scale_log2, window,
                 HKV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 SLIDING: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
                 FP8_CACHE: tl.constexpr):
    # Persistent: program p takes (unit, KV head) pairs p, p + P, ... of unit_count[0] * HKV.
    num_work = tl.load(unit_count) * HKV
    for w in range(tl.program_id(0), num_work, tl.num_programs(0)):
        u, h = w // HKV, w % HKV
        q_start = tl.load(units + u * 4)
        q_len = tl.load(units + u * 4 + 1)
        s0 = tl.load(units + u * 4 + 2)
        s1 = tl.load(units + u * 4 + 3)
        row_stride = HKV * HEAD_DIM  # elements per cache slot
        d = tl.arange(0, BLOCK_D)
        m = tl.arange(0, BLOCK_M)
        row, head = m // G, h * G + m % G
        row_ok = row < q_len
        col_ok = (d < HEAD_DIM)[None, :]
        rows_mask = _rows_mask(row_ok, col_ok, BLOCK_D == HEAD_DIM)
        q_ptr = q + (q_start + row)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
        qt = tl.load(q_ptr + d[None, :], mask=rows_mask, other=0.0)
        scale_h, v_deq = scale_log2, 1.0  # an fp8 cache: the head's scales (attend.py)
        if FP8_CACHE:
            qt, scale_h = fp8_query(qt, scale_log2, q.dtype.element_ty == tl.bfloat16)
            scale_h = scale_h * tl.load(kv_scale + K_SCALE_ROW * HKV + h)
            v_deq = tl.load(kv_scale + V_SCALE_ROW * HKV + h)
        if DOT_FP32:
            qt = qt.to(tl.float32)
        qp = tl.load(q_pos + q_start + row, mask=row_ok, other=-1)
        n = tl.arange(0, BLOCK_N)
        for sg in range(s0, s1):  # the unit's cells, in order: one partial per row each
            t0 = tl.load(segs + sg * 4)
            t1 = tl.load(segs + sg * 4 + 1)
            out = tl.load(segs + sg * 4 + 2)
            flags = tl.load(segs + sg * 4 + 3)
            o_ptr = o + (out + row)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
            st_ptr = (out + row).to(tl.int64) * stride_lt + head
            # LOAD: continue the raw state a prefix unit stored in these rows (else start afresh)
            load = row_ok & (((row * 0 + flags) & 1) != 0)  # [BLOCK_M] (a tensor for the interpreter)
            m_i = tl.load(lse + st_ptr, mask=load, other=float("-inf"))
            l_i = tl.load(l_state + st_ptr, mask=load, other=0.0)
            acc = tl.load(o_ptr, mask=rows_mask & load[:, None], other=0.0)
            for t in range(t0, t1):
                slot = tl.load(tile_slots + t * BLOCK_N + n)
                key_ok = slot >= 0
                off = (slot.to(tl.int64) * row_stride + h * HEAD_DIM)[:, None] + d[None, :]
                kv_mask = _rows_mask(key_ok, col_ok, BLOCK_D == HEAD_DIM)
                kt = tl.load(k_cache + off, mask=kv_mask, other=0.0)
                vt = tl.load(v_cache + off, mask=kv_mask, other=0.0)
                if FP8_CACHE:
                    kt, vt = kt.to(qt.dtype), vt.to(qt.dtype)  # exact
                k_pos = tl.load(tile_pos + t) + n
                m_i, l_i, acc = _tile_update(qt, kt, vt, key_ok, k_pos, qp, m_i, l_i, acc, scale_h,
                                             window, CAUSAL, SLIDING, PRECISION, DOT_FP32)
            if (flags & 2) != 0:  # STORE: the raw state, for the rows' own continuations
                tl.store(o_ptr, acc, mask=rows_mask)
                tl.store(lse + st_ptr, m_i, mask=row_ok)
                tl.store(l_state + st_ptr, l_i, mask=row_ok)
            else:
                seen = l_i > 0.0
                tl.store(o_ptr, acc / tl.where(seen, l_i, 1.0)[:, None] * v_deq, mask=rows_mask)
                ln_l = (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453  # x ln 2
                tl.store(lse + st_ptr, tl.where(seen, ln_l, float("-inf")), mask=row_ok)


def launch_cells(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                 units: torch.Tensor, count: torch.Tensor, segs: torch.Tensor, tile_slots: torch.Tensor,
                 tile_pos: torch.Tensor, scale: float, o: torch.Tensor, lse: torch.Tensor, l_state: torch.Tensor,
                 cfg: KernelConfig, causal: bool, programs: int, window: int | None = None,
                 kv_scale: torch.Tensor | None = None) -> None:
    """The first count[0] units of `units` ([>= U, 4] int32, segments in `segs`) on `programs`
    persistent programs, writing fp32 partials o [P, Hq, D], lse [P, Hq] at the segments' out
    rows (a STORE segment: the raw acc, m and l, in o, lse and l_state; an fp8 cache's V
    scale multiplies only finished partials). kv_scale: [4, Hkv], iff the cache is fp8."""
    t, hq, d = q.shape
    _, chunk_size, hkv, d_cache = k_cache.shape
    assert d_cache == d and hq % hkv == 0 and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and units.is_contiguous() and segs.is_contiguous()
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and o.shape[1:] == q.shape[1:]
    assert o.dtype == lse.dtype == l_state.dtype == torch.float32 and lse.shape == l_state.shape == o.shape[:2]
    assert l_state.stride() == lse.stride()
    assert tile_slots.dtype == torch.int32 and tile_slots.shape[1] == cfg.block_n and tile_slots.is_contiguous()
    for idx in (q_pos, count, units, segs, tile_pos):
        assert idx.dtype == torch.int32 and idx.device == q.device
    g = hq // hkv
    assert (k_cache.dtype == FP8) == (kv_scale is not None), "an fp8 cache, and only it, has scales"
    if programs == 0:
        return
    assert cfg.block_m >= g, "a KV head's G query heads must fit one tile"
    _cell_kernel[(programs,)](
        q, k_cache, v_cache, q_pos, units, count, segs, tile_slots, tile_pos, o, lse, l_state,
        q_pos if kv_scale is None else kv_scale,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), lse.stride(0), scale * _LOG2E, window or 0,
        HKV=hkv, G=g, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, SLIDING=window is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=q.device.type == "cpu" and q.dtype == torch.bfloat16,  # the interpreter's bf16 dot
        FP8_CACHE=kv_scale is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def cell_configs(shape: AttentionShape) -> tuple[KernelConfig, KernelConfig]:
    """(narrow, wide) launch shapes: 16 rows on 1 warp (decode tails) and 64 rows on 4 warps
    (or G rows if more, 1 warp per 16), both on the attend kernel's key tile for this head size
    and dtype. A row's tile updates have the same bits in both: each warp holds whole 16-row
    slices, so a row's sum of P adds the same registers in the same order (measured on an
    H100: 16/1, 64/4, 128/4 and 128/8 agree on every row; 32 rows on 2 warps does not)."""
    block_n = choose_configs(0, shape.head_dim, shape.dtype.itemsize)[0].block_n
    wide_m = max(64, next_pow2(shape.num_heads // shape.num_kv_heads))
    return (KernelConfig(NARROW_ROWS, block_n, num_warps=1, num_stages=3, programs_per_sm=32),
            KernelConfig(wide_m, block_n, num_warps=4, num_stages=3, programs_per_sm=4))


class CellKernels:
    """The executor of deterministic plans on the GPU (`ops.Executor`): plan_extra builds the
    cell work (`cell_worklist`); run stores K/V, runs the prefix units, then the wide and the
    narrow ones, and merges every row in cell order into q's dtype. A padded plan (a CUDA-graph
    step) fixes its grids and its scratch (buffers that only grow; `generation` counts their
    moves)."""

    def __init__(self, shape: AttentionShape, configs: tuple[KernelConfig, KernelConfig] | None = None,
                 sms: int | None = None) -> None:
        assert shape.cell is not None, "a deterministic shape"
        self.shape = shape
        self.configs = configs or cell_configs(shape)  # (narrow, wide)
        assert all(shape.cell % c.block_n == 0 for c in self.configs), (shape.cell, self.configs)
        assert self.configs[0].block_n == self.configs[1].block_n, "one key tile: one chain of updates"
        self.group = shape.num_heads // shape.num_kv_heads
        self.sms = sms or num_sms(shape.device)
        self.generation = 0
        self._scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._last: tuple[HostExtras, np.ndarray] | None = None  # a decode plan's extras, newest_tiles

    def plan_extra(self, batch: AttentionBatch, arrays: HostArrays) -> HostExtras:
        if batch.advance and self._last is not None:
            advanced = self._advanced(arrays)
            if advanced is not None:
                return advanced
        s, (narrow, wide), padded = self.shape, self.configs, batch.padded is not None
        num_out = int(required(arrays, "item_q_len").sum())
        work = build_cell_work(arrays, wide.block_m, self.group, batch.chunk_size, wide.block_n, num_out)
        assert not (padded and work.causal), "a padded (graph) step is a decode step"
        if padded:
            self._reserve(num_out)
        units = dict(zip(_CLASSES, work.units, strict=True))
        extras: HostExtras = {
            **{f"{c}_units": _addressable(u) for c, u in units.items()},
            **{f"{c}_programs": grid_size(len(u), s.num_kv_heads, narrow if c == "narrow" else wide,
                                          self.sms, padded) for c, u in units.items()},
            "unit_counts": np.array([len(u) for u in work.units], np.int64), "segs": _addressable(work.segs),
            "tile_slots": _addressable(work.tile_slots), "tile_pos": _addressable(work.tile_pos),
            "merge_indptr": work.merge_indptr, "merge_parts": _addressable(work.merge_parts),
            "causal": int(work.causal)}
        rows = batch.num_tokens  # the real rows (a padded plan's padding reads no keys)
        newest = newest_tiles(work.tile_slots, required(arrays, "slots")[:rows], required(arrays, "q_pos")[:rows],
                              work.causal)
        self._last = None if newest is None else (extras, newest)
        return extras

    def _advanced(self, arrays: HostArrays) -> HostExtras | None:
        """The last work with every row's new key in its lane of the row's newest tile: O(rows)
        (a decode step's tiles, units and merge stay), or None when a key opens a tile."""
        assert self._last is not None
        extras, newest = self._last
        rows = len(newest)
        pos, slots = required(arrays, "q_pos")[:rows], required(arrays, "slots")[:rows]
        lane = pos % self.configs[1].block_n
        if (lane == 0).any():
            return None
        tile_slots = np.array(extras["tile_slots"], copy=True)  # a new array: the plan cache uploads it
        tile_slots[newest, lane] = slots
        extras = {**extras, "tile_slots": tile_slots}
        self._last = (extras, newest)
        return extras

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, plan: DevicePlan, scale: float, window: int | None = None,
            kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        x = plan.extra
        store_kv(k_cache, v_cache, k, v, plan.slots, kv_scale)
        o_s, lse_s, l_s = self._scratch if plan.padded and self._scratch else self._new(plan.num_out_rows)
        counts = _tensor(x, "unit_counts")
        for i, c in enumerate(_CLASSES):  # in order: prefix units store what the others load
            launch_cells(q, k_cache, v_cache, plan.q_pos, _tensor(x, f"{c}_units"), counts[i:],
                         _tensor(x, "segs"), _tensor(x, "tile_slots"), _tensor(x, "tile_pos"), scale, o_s,
                         lse_s, l_s, self.configs[0 if c == "narrow" else 1], bool(x["causal"]), _int(x, f"{c}_programs"),
                         window, kv_scale)
        out = torch.empty_like(q)
        merge_rows(o_s, lse_s, _tensor(x, "merge_indptr"), _tensor(x, "merge_parts"), out, None)
        return out

    def _new(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        rows = max(1, rows)
        return (torch.empty((rows, s.num_heads, s.head_dim), dtype=torch.float32, device=s.device),
                torch.empty((rows, s.num_heads), dtype=torch.float32, device=s.device),
                torch.empty((rows, s.num_heads), dtype=torch.float32, device=s.device))

    def _reserve(self, rows: int) -> None:
        if self._scratch is None or self._scratch[1].shape[0] < rows:
            self._scratch = self._new(max(256, 1 << max(0, rows - 1).bit_length()))
            self.generation += 1


_CLASSES = ("prefix", "wide", "narrow")  # cell_worklist's unit classes, in launch order
