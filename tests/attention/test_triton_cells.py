"""Deterministic mode's Triton executor (`ops.triton.cells`) on random prefix trees: close to
dense float64 attention, and every row's bits the same on every backend, alone or batched,
padded for a CUDA graph or not, full or sliding.

Runs in Triton's interpreter (TRITON_INTERPRET=1) or, with PREFIXSERVE_TRITON_TEST_DEVICE=cuda,
compiled on a GPU (where the products and the row sums run on the hardware whose order the
one launch shape fixes; interpreted, numpy's).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton
pytest.importorskip("triton")

from prefixserve.attention.backends.auto import AutoBackend  # noqa: E402
from prefixserve.attention.backends.chunk import ChunkBackend  # noqa: E402
from prefixserve.attention.backends.hydragen import HydragenBackend  # noqa: E402
from prefixserve.attention.backends.paged import PagedBackend  # noqa: E402
from prefixserve.attention.backends.relay import RelayBackend  # noqa: E402
from prefixserve.attention.base import AttentionBatch, PaddedRows, Segment, SeqQueries  # noqa: E402
from prefixserve.attention.ops.triton.cell_worklist import LOAD, tile_keys  # noqa: E402
from prefixserve.attention.ops.triton.cells import CellKernels, cell_configs  # noqa: E402

from attn_trees import dense_attention  # noqa: E402
from test_cells import alone, first_chunk  # noqa: E402
from test_triton_ops import U, o_tol, to_dev, tree_case  # noqa: E402

BACKENDS = [PagedBackend, RelayBackend, HydragenBackend, ChunkBackend, AutoBackend]
CASES = [(i, dt, d, g, (16, 64)[i % 2], bool(i // 2 % 2), (128, 256)[i // 4 % 2])
         for i, (dt, d, g) in enumerate([(torch.float32, 64, 1), (torch.bfloat16, 64, 3), (torch.float16, 128, 8),
                                         (torch.bfloat16, 128, 1), (torch.float32, 128, 3), (torch.bfloat16, 64, 8)])]


def executor(shape) -> CellKernels:
    if DEVICE.type != "cpu":
        return CellKernels(shape)
    # Interpreted, a row's chain of tile updates run partly in a 64-row tile and partly in a
    # 16-row one (a split cell's prefix, then its continuation) came out a last bit off the
    # chain run in one shape (the interpreter's arithmetic; its dot and sum alone agree across
    # the two shapes): there the narrow class takes the wide shape. Compiled, the two shapes
    # agree (cell_configs), and the GPU run of this file checks both.
    narrow, wide = cell_configs(shape)
    return CellKernels(shape, (dataclasses.replace(narrow, block_m=wide.block_m), wide), sms=3)


def det(case, cell: int, window: int | None = None):
    shape = dataclasses.replace(case.shape, cell=cell, sliding_window=window)
    return dataclasses.replace(case, shape=shape)


def run(cls, case, batch=None, rows=slice(None), window=None, padded=0):
    """o of `batch` (default: the case's) through `cls` on the cell executor; a batch of part
    of the rows finds the others' new keys stored; `padded` extra graph rows."""
    batch = batch or case.batch
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    if rows != slice(None):
        hkv, d = case.k.shape[1:]
        k_cache.view(-1, hkv, d)[case.batch.slots] = case.k
        v_cache.view(-1, hkv, d)[case.batch.slots] = case.v
    q, k, v = case.q[rows], case.k[rows], case.v[rows]
    if padded:
        pad_slot = k_cache.shape[0] * k_cache.shape[1]
        k_cache, v_cache = (torch.cat([c, torch.zeros_like(c[:1])]) for c in (k_cache, v_cache))
        batch = dataclasses.replace(batch, padded=PaddedRows(batch.num_tokens + padded, pad_slot))
        q, k, v = (torch.cat([x, torch.randn(padded, *x.shape[1:]).to(x.dtype)]) for x in (q, k, v))
    backend = cls(case.shape, kernels=executor(case.shape), window_kernels=executor(case.shape))
    backend.plan(batch)
    o = backend.run(*to_dev(q, k, v), *to_dev(k_cache, v_cache), window=window).cpu()
    return o


def check_dense(o, case, ref):
    vmax = max(v.double().abs().max() for _, v in case.seq_kv)
    bound = U[case.shape.dtype] * ref.abs() + o_tol(case.shape.dtype) * vmax
    assert ((o.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("seed,dtype,head_dim,group,chunk,prefill,cell", CASES)
def test_cell_executor_gives_each_row_one_result(seed, dtype, head_dim, group, chunk, prefill, cell):
    case = det(tree_case(seed, dtype, head_dim, group, chunk, prefill), cell)
    first = run(PagedBackend, case)
    check_dense(first, case, dense_attention(case))
    for cls in BACKENDS[1:]:
        assert torch.equal(run(cls, case), first), cls.__name__
    for i in range(len(case.batch.seqs)):
        for part in (alone(case, i), first_chunk(case, i)):  # batched, alone, or an earlier prefill chunk
            if part is not None:
                assert torch.equal(run(BACKENDS[i % len(BACKENDS)], case, *part), first[part[1]]), i
    if not prefill:  # a decode step replayed in a graph: padded rows, fixed grids, the same bits
        o = run(HydragenBackend, case, padded=5)
        assert torch.equal(o[:len(first)], first) and not o[len(first):].any()


@pytest.mark.parametrize("seed,window,prefill", [(0, 5, False), (1, 40, True), (2, 1, True)])
def test_sliding_layers(seed, window, prefill):
    case = det(tree_case(seed, torch.bfloat16, 64, 3, 16, prefill), 128, window)
    first = run(PagedBackend, case, window=window)
    check_dense(first, case, dense_attention(case, window))
    for cls in BACKENDS[1:]:
        assert torch.equal(run(cls, case, window=window), first), cls.__name__


def test_split_cells_compute_their_shared_tiles_once():
    """A tree whose shared prefixes end inside cells (case 0): their leading tiles run once, in
    prefix units whose state the sequences continue (LOAD), on every backend -- paged too --
    and each row still has the bits it has alone (test above)."""
    case = det(tree_case(*CASES[0][:6]), CASES[0][6])
    for cls in (PagedBackend, RelayBackend):
        backend = cls(case.shape, kernels=executor(case.shape))
        backend.plan(case.batch)
        assert backend.current is not None
        x = backend.current.extra
        prefix, wide, narrow = (int(n) for n in x["unit_counts"].cpu())
        segs = x["segs"].cpu()
        assert prefix > 0 and (segs[:, 3] == LOAD).sum() >= 2 * prefix, cls.__name__


def test_advanced_decode_steps_equal_rebuilt_plans(monkeypatch):
    """Decode steps at positions 120..139 of two sequences below a shared root (cell 256, tile
    64): steps inside a tile put the new keys in the last work's tiles (no rebuild), the step
    whose key opens a tile (128) rebuilds; every step has the work and the bits of a plan
    built from scratch."""
    import prefixserve.attention.ops.triton.cells as cells_module
    builds = []
    build = cells_module.build_cell_work
    monkeypatch.setattr(cells_module, "build_cell_work", lambda *a: builds.append(1) or build(*a))
    c = 16
    shape = dataclasses.replace(tree_case(0, torch.float32, 64, 2, c, False).shape, cell=256, device=DEVICE)
    root = Segment(0, 0, 100, tuple(range(7)), 0)

    def step(n: int) -> AttentionBatch:
        own = [Segment(i + 1, 100, n, tuple(range(10 + 10 * i, 10 + 10 * i + -(-n // c))), 0) for i in range(2)]
        seqs = tuple(SeqQueries(i, 1, 99 + n, (root, own[i])) for i in range(2))
        return AttentionBatch(seqs, c, torch.cat([g.slots(c)[-1:] for g in own]))

    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(40, c, shape.num_kv_heads, 64, generator=gen) for _ in range(2))
    backend = RelayBackend(shape, kernels=executor(shape))
    backend.plan(step(20))
    for n in range(21, 41):
        full = step(n)
        assert backend.can_advance()
        backend.plan(AttentionBatch((), c, full.slots, advance=True))
        q = torch.randn(2, shape.num_heads, 64, generator=gen)
        k, v = (torch.randn(2, shape.num_kv_heads, 64, generator=gen) for _ in range(2))
        fresh = RelayBackend(shape, kernels=executor(shape))
        fresh.plan(full)
        assert backend.current is not None and fresh.current is not None
        for name in ("tile_slots", "tile_pos", "segs", "narrow_units", "prefix_units"):
            assert torch.equal(backend.current.extra[name], fresh.current.extra[name]), (n, name)
        out = [b.run(*to_dev(q, k, v, k_cache, v_cache)).cpu() for b in (backend, fresh)]
        assert torch.equal(out[0], out[1]), n
    assert len(builds) == 1 + 20 + 1  # the first plan, every fresh one, and the step at 128


def test_tile_keys_place_every_key_at_its_position():
    """Entries of random lengths and offsets, split over chunks: every key in its item's tile
    of its position, lane pos % BLOCK_N, holding its slot; nothing else in any tile."""
    rng = np.random.default_rng(0)
    size, block_n = 16, 32
    indptr, chunk, lo, hi, pos, expect = [0], [], [], [], [], []
    for item in range(20):
        p = int(rng.integers(0, 300))
        for _ in range(int(rng.integers(1, 5))):
            a = int(rng.integers(0, size))
            b = int(rng.integers(a + 1, size + 1))
            c = int(rng.integers(0, 1000))
            chunk.append(c), lo.append(a), hi.append(b), pos.append(p)
            expect += [(item, p + j, c * size + a + j) for j in range(b - a)]
            p += b - a + int(rng.integers(0, 3)) * int(rng.integers(0, 2))  # gaps: a window's cut
        indptr.append(len(chunk))
    slots, tile_pos, item_tiles = tile_keys(*(np.array(x) for x in (indptr, chunk, lo, hi, pos)), size, block_n)
    got = set()
    for item in range(20):
        for t in range(item_tiles[item], item_tiles[item + 1]):
            assert tile_pos[t] % block_n == 0
            got |= {(item, int(tile_pos[t]) + lane, int(s)) for lane, s in enumerate(slots[t]) if s >= 0}
    assert got == set(expect) and (slots >= 0).sum() == len(expect)
