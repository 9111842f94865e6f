"""Deterministic mode on the GPU: the cell kernel and `CellKernels`, the executor of cell plans
(the twin of `ops.reference.attend_cells` + `merge_in_order`; see attention/cells.py).

Program (unit u, KV head h): the unit's R query rows x G heads against its cell's tiles, one
tile of BLOCK_N positions at a time (`cell_worklist`): the keys are gathered lane by lane from
`tile_slots`, absent lanes load nothing and are masked, and the tile goes through the attend
kernel's online-softmax update (`attend._tile_update`). Every unit runs in one launch shape, so
a (row, cell) partial is the same chain of tile updates, in the same register layout, whichever
unit computes it -- a shared cell's unit of many rows or one sequence's -- and the merge folds
a row's partials in cell order. What differs from the default path, and why:

    no split of an item (a cell is one unit)     a split would change the row's sum
    tiles at fixed positions, gathered           chunk-aligned tiles follow the storage layout
    K/V stored first, then read from the cache   the default decode step's register-fed newest
                                                 key is one more update, off the tile grid
    every row merged, in cell order              one partial or many: the same fold
    one launch shape (64 rows, 4 warps)          tl.sum adds a row of P in an order that
                                                 follows the register layout, so the shape
                                                 (two shapes, 16 and 128 rows: 3.2x slower too,
                                                 the 128-row one out of registers, H100)
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ...base import AttentionBatch, AttentionShape
from ...plan import DevicePlan, HostArrays, HostExtras, required
from .attend import _LOG2E, _rows_mask, _tile_update, grid_size, num_sms
from .cell_worklist import build_cell_work
from .kernels import _addressable, _int, _tensor
from .merge import merge_rows
from .store import store_kv
from .worklist import KernelConfig, choose_configs, next_pow2


@triton.jit
def _cell_kernel(q, k_cache, v_cache, q_pos, units, unit_count, tile_slots, tile_pos, o, lse,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, scale_log2, window,
                 HKV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 SLIDING: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    # Persistent: program p takes (unit, KV head) pairs p, p + P, ... of unit_count[0] * HKV.
    num_work = tl.load(unit_count) * HKV
    for w in range(tl.program_id(0), num_work, tl.num_programs(0)):
        u, h = w // HKV, w % HKV
        q_start = tl.load(units + u * 5)
        q_len = tl.load(units + u * 5 + 1)
        t0 = tl.load(units + u * 5 + 2)
        t1 = tl.load(units + u * 5 + 3)
        out = tl.load(units + u * 5 + 4)
        row_stride = HKV * HEAD_DIM  # elements per cache slot
        d = tl.arange(0, BLOCK_D)
        m = tl.arange(0, BLOCK_M)
        row, head = m // G, h * G + m % G
        row_ok = row < q_len
        col_ok = (d < HEAD_DIM)[None, :]
        q_ptr = q + (q_start + row)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
        qt = tl.load(q_ptr + d[None, :], mask=_rows_mask(row_ok, col_ok, BLOCK_D == HEAD_DIM), other=0.0)
        if DOT_FP32:
            qt = qt.to(tl.float32)
        qp = tl.load(q_pos + q_start + row, mask=row_ok, other=-1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for t in range(t0, t1):
            slot = tl.load(tile_slots + t * BLOCK_N + n)
            key_ok = slot >= 0
            off = (slot.to(tl.int64) * row_stride + h * HEAD_DIM)[:, None] + d[None, :]
            kv_mask = _rows_mask(key_ok, col_ok, BLOCK_D == HEAD_DIM)
            kt = tl.load(k_cache + off, mask=kv_mask, other=0.0)
            vt = tl.load(v_cache + off, mask=kv_mask, other=0.0)
            k_pos = tl.load(tile_pos + t) + n
            m_i, l_i, acc = _tile_update(qt, kt, vt, key_ok, k_pos, qp, m_i, l_i, acc, scale_log2,
                                         window, CAUSAL, SLIDING, PRECISION, DOT_FP32)
        seen = l_i > 0.0
        o_tile = acc / tl.where(seen, l_i, 1.0)[:, None]
        o_ptr = o + (out + row)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
        tl.store(o_ptr + d[None, :], o_tile, mask=_rows_mask(row_ok, col_ok, BLOCK_D == HEAD_DIM))
        ln_l = (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453  # x ln 2
        tl.store(lse + (out + row).to(tl.int64) * stride_lt + head, tl.where(seen, ln_l, float("-inf")),
                 mask=row_ok)


def launch_cells(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                 units: torch.Tensor, count: torch.Tensor, tile_slots: torch.Tensor, tile_pos: torch.Tensor,
                 scale: float, o: torch.Tensor, lse: torch.Tensor, cfg: KernelConfig, causal: bool,
                 programs: int, window: int | None = None) -> None:
    """The first count[0] units of `units` ([>= U, 5] int32) on `programs` persistent programs,
    writing fp32 partials o [P, Hq, D], lse [P, Hq] at the units' out rows."""
    t, hq, d = q.shape
    _, chunk_size, hkv, d_cache = k_cache.shape
    assert d_cache == d and hq % hkv == 0 and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and units.is_contiguous()
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and o.shape[1:] == q.shape[1:]
    assert o.dtype == lse.dtype == torch.float32 and lse.shape == o.shape[:2]
    assert tile_slots.dtype == torch.int32 and tile_slots.shape[1] == cfg.block_n and tile_slots.is_contiguous()
    for idx in (q_pos, count, units, tile_pos):
        assert idx.dtype == torch.int32 and idx.device == q.device
    g = hq // hkv
    if programs == 0:
        return
    assert cfg.block_m >= g, "a KV head's G query heads must fit one tile"
    _cell_kernel[(programs,)](
        q, k_cache, v_cache, q_pos, units, count, tile_slots, tile_pos, o, lse, q.stride(0), q.stride(1),
        o.stride(0), o.stride(1), lse.stride(0), scale * _LOG2E, window or 0,
        HKV=hkv, G=g, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, SLIDING=window is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=q.device.type == "cpu" and q.dtype == torch.bfloat16,  # the interpreter's bf16 dot
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def cell_config(shape: AttentionShape) -> KernelConfig:
    """The one launch shape of a model's cell units: 64 rows (or G, if more) x the attend
    kernel's key tile for this head size and dtype, 4 warps."""
    block_n = choose_configs(0, shape.head_dim, shape.dtype.itemsize)[0].block_n
    g = shape.num_heads // shape.num_kv_heads
    return KernelConfig(max(64, next_pow2(g)), block_n, num_warps=4, num_stages=3, programs_per_sm=4)


class CellKernels:
    """The executor of deterministic plans on the GPU (`ops.Executor`): plan_extra builds the
    cell work (`cell_worklist`); run stores K/V, runs the units, and merges every row in cell
    order into q's dtype. A padded plan (a CUDA-graph step) fixes its grid and its scratch (a
    buffer that only grows; `generation` counts its moves)."""

    def __init__(self, shape: AttentionShape, config: KernelConfig | None = None, sms: int | None = None) -> None:
        assert shape.cell is not None, "a deterministic shape"
        self.shape = shape
        self.config = config or cell_config(shape)
        assert shape.cell % self.config.block_n == 0, (shape.cell, self.config)
        self.group = shape.num_heads // shape.num_kv_heads
        self.sms = sms or num_sms(shape.device)
        self.generation = 0
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan_extra(self, batch: AttentionBatch, arrays: HostArrays) -> HostExtras:
        s, cfg, padded = self.shape, self.config, batch.padded is not None
        num_out = int(required(arrays, "item_q_len").sum())
        work = build_cell_work(arrays, cfg, self.group, batch.chunk_size, num_out)
        assert not (padded and work.causal), "a padded (graph) step is a decode step"
        if padded:
            self._reserve(num_out)
        return {"units": _addressable(work.units), "unit_count": np.array([len(work.units)], np.int64),
                "tile_slots": _addressable(work.tile_slots), "tile_pos": _addressable(work.tile_pos),
                "merge_indptr": work.merge_indptr, "merge_parts": _addressable(work.merge_parts),
                "causal": int(work.causal), "programs": grid_size(len(work.units), s.num_kv_heads, cfg, self.sms, padded)}

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, plan: DevicePlan, scale: float, window: int | None = None) -> torch.Tensor:
        x = plan.extra
        store_kv(k_cache, v_cache, k, v, plan.slots)
        o_s, lse_s = self._scratch if plan.padded and self._scratch else self._new(plan.num_out_rows)
        launch_cells(q, k_cache, v_cache, plan.q_pos, _tensor(x, "units"), _tensor(x, "unit_count"),
                     _tensor(x, "tile_slots"), _tensor(x, "tile_pos"), scale, o_s, lse_s, self.config,
                     bool(x["causal"]), _int(x, "programs"), window)
        out = torch.empty_like(q)
        merge_rows(o_s, lse_s, _tensor(x, "merge_indptr"), _tensor(x, "merge_parts"), out, None)
        return out

    def _new(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        rows = max(1, rows)
        return (torch.empty((rows, s.num_heads, s.head_dim), dtype=torch.float32, device=s.device),
                torch.empty((rows, s.num_heads), dtype=torch.float32, device=s.device))

    def _reserve(self, rows: int) -> None:
        if self._scratch is None or self._scratch[1].shape[0] < rows:
            self._scratch = self._new(max(256, 1 << max(0, rows - 1).bit_length()))
            self.generation += 1
