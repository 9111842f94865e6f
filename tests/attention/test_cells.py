"""Deterministic mode's attention (attention/cells.py): any schedule cut into key cells gives
every row the same bits, whatever the backend and whatever else is in the batch, on random
prefix trees; the reference executor here, the Triton one in test_triton_cells.py."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from prefixserve.attention import AttentionBatch, SeqQueries, create_backend
from prefixserve.attention.cells import cells
from prefixserve.attention.schedule import SCHEDULES

from attn_trees import dense_attention, make_case
from test_backends import check_close, check_written

EXACT = ["paged", "relay", "hydragen", "chunk", "auto"]
CASES = [(seed, dtype, prefill, cell) for seed in range(6) for dtype in (torch.float32, torch.bfloat16)
         for prefill in (False, True) for cell in ((16, 64)[seed % 2],)]


def det_case(seed: int, dtype: torch.dtype, prefill: bool, cell: int):
    rng = random.Random(seed)
    case = make_case(rng.randint, torch.Generator().manual_seed(seed), (1, 16)[seed % 2], 3, dtype, prefill)
    return dataclasses.replace(case, shape=dataclasses.replace(case.shape, cell=cell))


def alone(case, i: int):
    """Sequence i of the case as a batch of its own: (batch, its rows)."""
    s = case.batch.seqs[i]
    rows = slice(s.q_start, s.q_start + s.q_len)
    seq = SeqQueries(0, s.q_len, s.q_pos, s.segments)
    pinned = case.batch.pinned_node_ids & {g.node_id for g in s.segments}
    return AttentionBatch((seq,), case.batch.chunk_size, case.batch.slots[rows], frozenset(pinned)), rows


def first_chunk(case, i: int):
    """Sequence i's first half of its query rows, as a chunked prefill's earlier step would run
    them: the keys after them not there yet. -> (batch, rows) or None (one row only)."""
    s = case.batch.seqs[i]
    cut = s.q_len // 2
    if cut < 1:
        return None
    kv_len, segs, left = s.q_pos + cut, [], s.q_pos + cut
    for g in s.segments:
        if left > 0:
            segs.append(dataclasses.replace(g, length=min(g.length, left)))
        left -= g.length
    rows = slice(s.q_start, s.q_start + cut)
    seq = SeqQueries(0, cut, s.q_pos, tuple(segs))
    assert seq.kv_len == kv_len
    return AttentionBatch((seq,), case.batch.chunk_size, case.batch.slots[rows]), rows


def run(name, case, batch, rows=slice(None)):
    """o of `batch` (the case's rows `rows`) and the caches after; a batch of part of the
    case's rows finds the other rows' new keys stored (their steps ran before, or, for a
    chunk's later keys, were written and are masked: as the longer batch has them)."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    if rows != slice(None):
        hkv, d = case.k.shape[1:]
        k_cache.view(-1, hkv, d)[case.batch.slots] = case.k
        v_cache.view(-1, hkv, d)[case.batch.slots] = case.v
    backend = create_backend(name, case.shape)
    backend.plan(batch)
    return backend.run(case.q[rows], case.k[rows], case.v[rows], k_cache, v_cache), k_cache, v_cache


@pytest.mark.parametrize("seed,dtype,prefill,cell", CASES)
def test_every_schedule_cut_to_cells_partitions_each_rows_keys_by_cell(seed, dtype, prefill, cell):
    """Each row: one item per cell it has keys in, holding exactly those keys, in cell order;
    an item of several sequences only for a cell whole in each (their keys there identical)."""
    case = det_case(seed, dtype, prefill, cell)
    batch = case.batch
    for name, schedule in SCHEDULES.items():
        sched = cells(schedule(batch), batch, cell)
        per_row: dict[int, list[tuple[int, set[int]]]] = {}
        for item in sched.items:
            pos = {p.seg.pos_start + j for p in item.pieces for j in range(p.lo, p.hi)}
            assert len({x // cell for x in pos}) == 1, (name, item)
            for r in range(item.q_start, item.q_start + item.q_len):
                per_row.setdefault(r, []).append((min(pos) // cell, pos))
        for s in batch.seqs:
            keys = {g.pos_start + j for g in s.segments for j in range(g.length)}
            for r in range(s.q_start, s.q_start + s.q_len):
                got = per_row[r]
                assert [c for c, _ in got] == sorted({k // cell for k in keys}), (name, s)
                assert [p for _, p in got] == [{k for k in keys if k // cell == c} for c, _ in got], (name, s)


@pytest.mark.parametrize("seed,dtype,prefill,cell", CASES)
def test_every_backend_gives_every_row_the_same_bits_batched_or_alone(seed, dtype, prefill, cell):
    case = det_case(seed, dtype, prefill, cell)
    ref = dense_attention(case)
    first, k_cache, v_cache = run("paged", case, case.batch)
    check_close(first, case, ref)
    check_written(case, k_cache, v_cache)
    for name in EXACT[1:]:
        o, _, _ = run(name, case, case.batch)
        assert torch.equal(o, first), name
    for i in range(len(case.batch.seqs)):
        for part in (alone(case, i), first_chunk(case, i)):
            if part is not None:
                o, _, _ = run(EXACT[i % len(EXACT)], case, *part)
                assert torch.equal(o, first[part[1]]), i


def test_the_default_mode_differs_where_cells_do_not():
    """The test above can fail: without cells, hydragen and paged differ in the last bits."""
    for seed in range(6):
        case = det_case(seed, torch.float32, True, 16)
        case = dataclasses.replace(case, shape=dataclasses.replace(case.shape, cell=None))
        if not torch.equal(run("paged", case, case.batch)[0], run("hydragen", case, case.batch)[0]):
            return
    pytest.fail("paged and hydragen agreed bit for bit on every case")


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("seed,window", [(0, 1), (1, 5), (2, 17), (3, 40)])
def test_sliding_layers_too(seed, window, prefill):
    """Both plans (full, and cut to the window) cut to cells: the same bits on every backend
    and alone; a cell the window cuts keeps its keys at their places."""
    case = det_case(seed, torch.float32, prefill, 16)
    case = dataclasses.replace(case, shape=dataclasses.replace(case.shape, sliding_window=window))
    refs = {None: dense_attention(case), window: dense_attention(case, window)}
    outs = {}
    for name in EXACT:
        backend = create_backend(name, case.shape)
        backend.plan(case.batch)
        for w in refs:
            o = backend.run(case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone(), window=w)
            check_close(o, case, refs[w])
            assert torch.equal(o, outs.setdefault(w, o)), (name, w)
