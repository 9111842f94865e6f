"""The Triton kernels against their reference twins (and the backends' Triton path against dense
float64 attention), on random prefix trees laid out in chunks.

Runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before triton is
first imported); PREFIXSERVE_TRITON_TEST_DEVICE=cuda runs the same tests compiled on a GPU.
Skipped only where triton is not installed.

Tolerances, relative to max|v| (u: unit roundoff of the input type). fp32 runs the products
in IEEE fp32: FP32_TOL as in test_reference_ops. 16-bit types multiply P rounded to the input
type (as FlashAttention does): |o - o_ref| <= u * sum_j p_j |v_j| <= u * max|v|, taken twice
for headroom (fp16 u = 2^-11, bf16 u = 2^-8). lse comes from fp32 scores of exact products:
2e-4 * (1 + |lse|) bounds its rounding with headroom.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton
pytest.importorskip("triton")

from prefixserve.attention import ops  # noqa: E402
from prefixserve.attention.backends.chunk import ChunkBackend  # noqa: E402
from prefixserve.attention.backends.hydragen import HydragenBackend  # noqa: E402
from prefixserve.attention.backends.paged import PagedBackend  # noqa: E402
from prefixserve.attention.backends.relay import RelayBackend  # noqa: E402
from prefixserve.attention.base import PaddedRows  # noqa: E402
from prefixserve.attention.ops import reference  # noqa: E402
from prefixserve.attention.ops import triton as tops  # noqa: E402
from prefixserve.attention.ops.triton import grids, worklist  # noqa: E402
from prefixserve.attention.ops.triton.configs import (  # noqa: E402
    NARROW_REGS_BESIDE_GLUON,
    NARROW_ROWS,
    KernelConfig,
    choose_configs,
)
from prefixserve.attention.ops.triton.worklist import build_worklist, items_need_causal  # noqa: E402
from prefixserve.attention.plan import index_arrays  # noqa: E402
from prefixserve.attention.schedule import SCHEDULES  # noqa: E402

from attn_trees import dense_attention, make_case  # noqa: E402

FP32_TOL = 1e-5
U = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = {"paged": PagedBackend, "relay": RelayBackend, "hydragen": HydragenBackend,
            "chunk": ChunkBackend}


def o_tol(dtype: torch.dtype) -> float:
    return FP32_TOL + 2 * U[dtype]


def widen(case, head_dim: int, seed: int):
    """The case's tree and batch with fresh K/V/q of `head_dim` (make_case draws d in {8, 16}).
    Unused slots stay NaN, and so do the new tokens' slots until store_kv writes them (two
    sequences may compute the same new token: the same slot gets the same K/V)."""
    g = torch.Generator().manual_seed(seed)
    dt, (n, c, hkv, _) = case.shape.dtype, case.k_cache.shape
    rnd = lambda *s: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    slots = case.batch.slots
    unused = case.k_cache[..., :1].isnan().expand(n, c, hkv, head_dim).reshape(-1, hkv, head_dim)
    unused = unused.clone().index_fill_(0, slots, False)  # make_case NaNs the new slots too
    full_k, full_v = (rnd(n * c, hkv, head_dim).masked_fill(unused, float("nan")) for _ in "kv")
    k, v = full_k[slots], full_v[slots]
    k_cache, v_cache = (x.clone().index_fill_(0, slots, float("nan")).view(n, c, hkv, head_dim)
                        for x in (full_k, full_v))
    seq_kv = []
    for s in case.batch.seqs:
        keys = torch.cat([seg.slots(c) for seg in s.segments])
        seq_kv.append((full_k[keys], full_v[keys]))
    shape = dataclasses.replace(case.shape, head_dim=head_dim, scale=case.shape.scale
                                * (case.k.shape[-1] / head_dim) ** 0.5, device=DEVICE)
    return dataclasses.replace(case, shape=shape, q=rnd(len(case.q), case.q.shape[1], head_dim),
                               k=k, v=v, k_cache=k_cache, v_cache=v_cache, seq_kv=seq_kv)


def tree_case(seed: int, dtype, head_dim: int, group: int, chunk: int, prefill: bool):
    rng = random.Random(seed)
    case = make_case(rng.randint, torch.Generator().manual_seed(seed), chunk, group, dtype,
                     prefill, max_nodes=8)
    return widen(case, head_dim, seed)


def to_dev(*xs):
    return [x.to(DEVICE) for x in xs]


# (dtype, D, G) all 18 combinations; chunk size, decode/prefill and the schedule rotate
ATTEND_CASES = [(i, dt, d, g, (16, 64)[i % 2], bool(i // 2 % 2), list(SCHEDULES)[i % 4])
                for i, (dt, d, g) in enumerate(itertools.product(DTYPES, (64, 128), (1, 3, 8)))]


@pytest.mark.parametrize("seed,dtype,head_dim,group,chunk,prefill,sched", ATTEND_CASES)
def test_attend_items_matches_reference(seed, dtype, head_dim, group, chunk, prefill, sched):
    check_attend_items(tree_case(seed, dtype, head_dim, group, chunk, prefill), sched)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attend_items_with_128_row_wide_tiles(dtype):
    # choose_configs picks 128-row wide tiles for big shared items; the random trees above
    # rarely have that many rows, so force the shape (prefill: rows x G = 8 per token)
    wide = KernelConfig(128, 64, num_stages=2)
    check_attend_items(tree_case(3, dtype, 128, 8, 64, True), "hydragen",
                       configs=(KernelConfig(16, 64, num_warps=2), wide))


def check_attend_items(case, sched: str, configs=None):
    reference.store_kv(case.k_cache, case.v_cache, case.k, case.v, case.batch.slots)
    schedule = SCHEDULES[sched](case.batch)
    a = index_arrays(schedule, case.batch)
    idx = [torch.from_numpy(a[f]).int() for f in ("q_pos", "item_q_start", "item_q_len",
           "item_out_start", "item_kv_indptr", "kv_chunk", "kv_lo", "kv_hi", "kv_pos")]
    rows = sum(it.q_len for it in schedule.items) + 2  # two partial rows no item writes
    args = (case.q, case.k_cache, case.v_cache, *idx)
    o_ref, lse_ref = reference.attend_items(*args, case.shape.scale, rows)
    o, lse = tops.attend_items(*to_dev(*args), case.shape.scale, rows, sms=3, configs=configs)
    o, lse = o.cpu(), lse.cpu()
    assert o.dtype == lse.dtype == torch.float32 and o.shape == o_ref.shape
    vmax = case.v_cache.nan_to_num(0).abs().max().float()
    assert (o - o_ref).abs().max() <= o_tol(case.shape.dtype) * vmax
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert ((lse - lse_ref)[fin].abs() <= 2e-4 * (1 + lse_ref[fin].abs())).all()


@pytest.mark.parametrize("cast", [False, True], ids=["same-dtype", "from-fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_exactly_the_slots(dtype, cast):
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(5, 16, 3, 64, generator=g).to(dtype) for _ in "kv"]
    kv = torch.randn(7, 2, 3, 64, generator=g).to(torch.float32 if cast else dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided: every other row
    slots = torch.randperm(80, generator=g)[:7]
    expect = [c.clone() for c in caches]
    reference.store_kv(*expect, k, v, slots)
    got = to_dev(*caches)
    tops.store_kv(*got, *to_dev(k, v, slots))
    # the interpreter truncates fp32 -> bf16 (triton 3.9); compiled Triton rounds to nearest
    # even, as torch does: one bf16 ulp of slack there only
    ulp = 2.0**-7 if cast and dtype == torch.bfloat16 and DEVICE.type == "cpu" else 0.0
    for x, y in zip(got, expect, strict=True):
        assert ((x.cpu().float() - y.float()).abs() <= ulp * y.float().abs()).all()


def test_merge_partials_matches_reference():
    g = torch.Generator().manual_seed(2)
    o_parts = torch.randn(40, 6, 64, generator=g)
    lse_parts = torch.randn(40, 6, generator=g) * 5
    lse_parts[torch.rand(40, 6, generator=g) < 0.3] = float("-inf")  # empty partials
    counts = torch.tensor([3, 0, 1, 7, 2, 4, 0, 9, 5, 9])  # rows 1 and 6 have no partial
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int()
    parts = torch.randperm(40, generator=g).int()
    o_ref, lse_ref = reference.merge_partials(o_parts, lse_parts, indptr, parts)
    o, lse = (x.cpu() for x in tops.merge_partials(*to_dev(o_parts, lse_parts, indptr, parts)))
    assert (o - o_ref).abs().max() <= 1e-5 * o_parts.abs().max()
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert torch.allclose(lse[fin], lse_ref[fin], rtol=0, atol=1e-5)
    assert torch.equal(o[[1, 6]], torch.zeros(2, 6, 64))


def test_merge_chunks_fold_a_row_of_as_many_partials_bit_for_bit():
    """A chunk of the plan's most partials a row (`merge.unroll_for`) folds each row as a chunk
    of 8 does, bit for bit; rows with more partials than the chunk still merge right."""
    from prefixserve.attention.ops.triton.merge import UNROLL, merge_rows, unroll_for
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([2, 0, 1, 2, 3, 4, 2, 9])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int()
    o_parts = torch.randn(int(counts.sum()), 4, 32, generator=g)
    lse_parts = torch.randn(int(counts.sum()), 4, generator=g) * 5
    parts = torch.randperm(int(counts.sum()), generator=g).int()
    o_ref, lse_ref = reference.merge_partials(o_parts, lse_parts, indptr, parts)
    outs = {}
    for unroll in (1, 2, 4, UNROLL):
        o, lse = torch.zeros(len(counts), 4, 32), torch.zeros(len(counts), 4)
        o, lse = to_dev(o, lse)
        merge_rows(*to_dev(o_parts, lse_parts, indptr, parts), o, lse, unroll=unroll)
        outs[unroll] = o.cpu(), lse.cpu()
        assert (outs[unroll][0] - o_ref).abs().max() <= 1e-5 * o_parts.abs().max()
        assert torch.allclose(outs[unroll][1][counts > 0], lse_ref[counts > 0], rtol=0, atol=1e-5)
    for unroll, (o, lse) in outs.items():
        inside = counts <= unroll
        assert torch.equal(o[inside], outs[UNROLL][0][inside]) and torch.equal(lse[inside], outs[UNROLL][1][inside])
    assert [unroll_for(np.array(c)) for c in ([0, 2, 4, 6], [0, 3, 3], [0, 1, 6], [0, 9], [0, 0])] == [2, 4, 8, 8, 2]
    assert unroll_for(None) == UNROLL


BACKEND_CASES = [(100 + i, dt, d, g, c, pre) for i, (dt, d, g, c, pre) in enumerate(
    [(torch.float32, 64, 3, 16, False), (torch.float16, 128, 8, 64, False),
     (torch.bfloat16, 64, 1, 16, True), (torch.float16, 64, 3, 64, True)])]
# decode steps whose units write the new keys (seeds with no recomputed cached token), the
# second with G = 20: its tails are wide units
BACKEND_CASES += [(104, torch.bfloat16, 128, 4, 64, False), (108, torch.float16, 64, 20, 16, False)]


def folds(case, prefill: bool) -> bool:
    """Whether the units write the new keys (`worklist.mark_stores`): a decode step in which
    no sequence's new key is in another sequence's context."""
    if prefill:
        return False
    seqs, c = case.batch.seqs, case.batch.chunk_size
    keys = [set(torch.cat([seg.slots(c) for seg in s.segments]).tolist()) for s in seqs]
    new = case.batch.slots.tolist()
    return not any(new[s.q_start] in keys[j] for i, s in enumerate(seqs)
                   for j in range(len(seqs)) if j != i)


@pytest.mark.parametrize("seed,dtype,head_dim,group,chunk,prefill", BACKEND_CASES)
def test_backends_on_triton_match_dense(seed, dtype, head_dim, group, chunk, prefill):
    """plan/run through `TritonKernels` (split-K units, the composed merge, direct output;
    the new keys written by a store launch or, in decode, by the units that read them)."""
    case = tree_case(seed, dtype, head_dim, group, chunk, prefill)
    ref = dense_attention(case)
    vmax = max(v.double().abs().max() for _, v in case.seq_kv)
    for name, cls in BACKENDS.items():
        backend = cls(case.shape, kernels=tops.TritonKernels(case.shape, sms=3))  # splits
        backend.plan(case.batch)
        x = backend.current.extra
        assert x["stores"] == folds(case, prefill), name
        if not x["direct"]:  # the merge takes each row's partials in one chunk
            most = int(x["merge_indptr"].diff().max())
            assert x["merge_unroll"] == min(8, max(2, 1 << (most - 1).bit_length())), name
        k_cache, v_cache = to_dev(case.k_cache.clone(), case.v_cache.clone())
        o = backend.run(*to_dev(case.q, case.k, case.v), k_cache, v_cache).cpu()
        assert o.dtype == dtype and o.shape == case.q.shape, name
        bound = U[dtype] * ref.abs() + o_tol(dtype) * vmax  # + rounding of o to dtype
        assert ((o.double() - ref).abs() <= bound).all(), name
        flat = k_cache.view(-1, *k_cache.shape[2:]).cpu()
        assert torch.equal(flat[case.batch.slots], case.k.to(dtype)), name


@pytest.mark.parametrize("prefill", [False, True])
def test_dynamic_launches_match_dense_run_after_run(prefill):
    """Programs that take their units from a device counter (`KernelConfig.dynamic`, a launch
    that shares the SMs with another): the same rows as a fixed stride, and the counter back
    at 0 after each launch -- else the next layer's launch would start past its units and
    write nothing (the second run checks it)."""
    case = tree_case(4 + prefill, torch.float16, 64, 3, 16, prefill)
    ref = dense_attention(case)
    vmax = max(v.double().abs().max() for _, v in case.seq_kv)
    configs = (KernelConfig(16, 16, num_warps=2, dynamic=True), KernelConfig(32, 16, dynamic=True))
    kernels = tops.TritonKernels(case.shape, configs=configs, sms=3)
    backend = HydragenBackend(case.shape, kernels=kernels)
    backend.plan(case.batch)
    assert all(la.queue is not None for la in kernels.launches(backend.current.extra))
    for _ in range(2):
        k_cache, v_cache = to_dev(case.k_cache.clone(), case.v_cache.clone())
        o = backend.run(*to_dev(case.q, case.k, case.v), k_cache, v_cache).cpu()
        bound = U[torch.float16] * ref.abs() + o_tol(torch.float16) * vmax
        assert ((o.double() - ref).abs() <= bound).all()
        assert not kernels.queues.any()


def test_launch_shapes_follow_the_kernel_that_runs_the_wide_units(monkeypatch):
    """Where the Gluon wide kernel runs (made to seem so here: the CPU has none), a decode
    step's launches take the shapes chosen for it (24 sequences under a shared prefix: 32-row
    wide units), and so do a prefill step's over a 16-bit cache (its wide units masked by
    position); over an fp8 cache prefill rows need the position mask, and a decode step with
    G > NARROW_ROWS has wide units that store the new keys: only the Triton kernel does
    either, and those keep the Triton kernel's shapes."""
    from prefixserve.bench.kernels.rows import Workload, build

    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_wide", lambda shape, chunk_size: True)
    decode = build(Workload("test", 24, 16, 16, 64, 300, (256,), 16, "float16"), torch.device("cpu"))
    prefill = tree_case(5, torch.float16, 64, 3, 16, True)
    prefill_fp8 = dataclasses.replace(prefill, shape=dataclasses.replace(prefill.shape, kv_dtype=reference.FP8))
    g20 = build(Workload("test", 4, 40, 2, 64, 300, (256,), 16, "float16"), torch.device("cpu"))
    for case, gluon_shapes, block_m in ((decode, True, 32), (prefill, True, 128), (prefill_fp8, False, 128),
                                        (g20, False, 128)):
        kernels = tops.TritonKernels(case.shape, sms=3)
        backend = RelayBackend(case.shape, kernels=kernels)
        backend.plan(case.batch)
        x = backend.current.extra
        assert x["wide_programs"] > 0 and x["wide_block_m"] == block_m
        fp8 = case.shape.kv_dtype == reference.FP8
        gluon, triton = (choose_configs(block_m, 64, 2, gluon=g, fp8=fp8) for g in (True, False))
        assert gluon != triton
        chosen = (kernels.launch_config(x, "narrow"), kernels.launch_config(x, "wide"))
        assert chosen == (gluon if gluon_shapes else triton)


def test_walk_beside_the_products_where_it_pays():
    """`grids.walk_sms` on Table 3's fp8 rows (32 sequences x 32 heads, 32-row wide units)
    and an H200's 132 SMs: the walk beside the wide units, each on an SM of its own, where
    they walk 3x a tail's keys; after them at 1x; after them where the walk's CTAs would not
    all fit on the other SMs (64 sequences: 2,048) or the wide items need more than half the
    SMs; and never for tails of their new keys alone (a step after a shared prompt: the wide
    units take those keys, split over every SM)."""
    assert grids.walk_sms(1, 768, 257, 32, 32, 132) == 32
    assert grids.walk_sms(1, 1024, 1025, 32, 32, 132) == 132
    assert grids.walk_sms(1, 1024, 1, 32, 32, 132) == 132
    assert grids.walk_sms(1, 768, 257, 64, 32, 132) == 132
    assert grids.walk_sms(3, 768, 257, 32, 32, 132) == 132


def test_plans_take_the_row_walk_for_decode_tails(monkeypatch):
    """Where the Gluon row walk runs (made to seem so here), a decode step of G 1 over an fp8
    cache takes its narrow shape: paged (no wide units) and relay over 96 sequences (128-row
    units) beside the wide launch, relay over 24 (32-row units) after it, where its units
    merge their rows (no merge launch), or on 16 SMs beside it on SMs of their own, merging
    once it ends (`grids.walk_sms`). Over a 16-bit cache only the last: relay over 24
    sequences on 16 SMs, not where the tails outgrow half the shared keys (then the Triton
    kernel's shape, as without Gluon on 3 SMs or without wide units). Prefill rows (the
    position mask) and G 2 never do. The same output as the twin: on the CPU from the Triton
    kernel in the walk's shape (`hopper_rows.applies` is false there), on a Hopper GPU from
    the walk."""
    from prefixserve.bench.kernels.rows import Workload, build

    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_rows", lambda shape: True)
    walk = choose_configs(0, 64, 2, fp8=True, walk=True)[0]
    assert walk.walk and walk.dynamic and walk.block_n == 64 and walk.num_warps == 1
    assert choose_configs(4096, 128, 2, fp8=True, walk=True)[0].block_n == 32
    after = dataclasses.replace(walk, block_n=32, after_wide=True)
    assert choose_configs(32, 128, 2, fp8=True, walk=True)[0] == after
    assert not choose_configs(4096, 128, 2, fp8=True, walk=True)[0].after_wide
    assert not choose_configs(0, 128, 2, fp8=True, walk=True)[0].after_wide
    assert not choose_configs(0, 128, 2, walk=True)[0].walk
    # over a 16-bit cache: beside Gluon units of <= 64 rows only (16 keys of 128 dims a 4 KB tile)
    assert choose_configs(32, 128, 2, gluon=True, walk=True)[0] == dataclasses.replace(after, block_n=16)
    assert not choose_configs(32, 128, 2, walk=True)[0].walk
    assert not choose_configs(4096, 128, 2, gluon=True, walk=True)[0].walk

    def row(batch, heads, kv, context=300):
        return build(Workload("test", batch, heads, 4, 64, context, (256,), 16, "float16", kv_dtype=kv), DEVICE)

    cases = [(row(24, 4, "fp8"), PagedBackend, True, 3), (row(96, 4, "fp8"), RelayBackend, True, 3),
             (row(24, 4, "fp8"), RelayBackend, True, 3), (row(24, 4, "fp8"), RelayBackend, True, 16),
             (row(24, 4, ""), RelayBackend, True, 16), (row(24, 4, "", context=600), RelayBackend, False, 16),
             (row(24, 4, ""), RelayBackend, False, 3), (row(24, 4, ""), PagedBackend, False, 3),
             (row(24, 8, "fp8"), PagedBackend, False, 3),
             (tree_case(5, torch.float16, 64, 1, 16, True), RelayBackend, False, 3)]
    for case, cls, on, sms in cases:
        # (the wide units in the Gluon kernel's shape -- one CTA an SM -- as on sm_90, for 16)
        monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_wide", lambda shape, chunk, s=sms: s == 16)
        backend = cls(case.shape, kernels=tops.TritonKernels(case.shape, sms=sms))
        backend.plan(case.batch)
        x = backend.current.extra
        assert x["narrow_walk"] == on and x["narrow_programs"] > 0, (cls.name, case.shape)
        if on:
            beside = x["wide_programs"] == 0 or x["wide_block_m"] == 128
            # 16 SMs: 4 for the 4 KV heads' wide units (256 keys, 5.7x a 45-key tail), 12 hold
            # the 96 walk CTAs: the walk runs beside them, merging once they end
            merging_beside = sms == 16
            assert backend.kernels.launch_config(x, "narrow") == dataclasses.replace(
                walk, block_n=64 if case.k_cache.dtype == reference.FP8 else 32, after_wide=not beside and not merging_beside,
                merge_beside=merging_beside)
            assert x["fused"] == (not beside and x["direct"] == 0), (cls.name, case.shape)
            assert not merging_beside or int(x["unit_counts"][3]) == x["wide_programs"] == 4
            args = (case.q, case.k, case.v, case.k_cache.clone(), case.v_cache.clone())
            o = backend.run(*args, kv_scale=case.kv_scale)
            twin = cls(case.shape, kernels=ops.ReferenceKernels(case.shape))
            twin.plan(case.batch)
            ref = twin.run(*args[:3], case.k_cache.clone(), case.v_cache.clone(), kv_scale=case.kv_scale)
            assert (o.float() - ref.float()).abs().max() <= 4 * U[torch.float16] * case.vmax


def test_a_graphs_plan_is_captured_again_when_the_walk_flips(monkeypatch):
    """A padded (graph) plan bakes the narrow launch's shape into its graph. Over a 16-bit
    cache (the Gluon kernels made to seem on, 16 SMs), 24 sequences whose tails outgrow half of
    256 shared keys keep the Triton kernel's shape; once their tails are shorter (a new batch),
    the walk runs beside the wide units: the kernels' generation moves once (a new capture),
    and not between two plans of the same choice."""
    from prefixserve.bench.kernels.rows import Workload, build

    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_rows", lambda shape: True)
    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_wide", lambda shape, chunk: True)
    rows = [build(Workload("test", 24, 4, 4, 64, context, (256,), 16, "float16"), DEVICE) for context in (600, 610, 300)]
    assert graph_plans(rows, "narrow_walk") == [(False, 0), (False, 0), (True, 1)]


def test_plans_take_the_swapped_walk_where_the_wide_units_leave_sms(monkeypatch):
    """Where the Gluon swapped walk runs (made to seem so here, with the Gluon wide kernel, 16
    SMs), a decode step of G 4 over a 16-bit cache takes its narrow shape where the wide units
    leave a quarter of the SMs or more to the tails (96 sequences under 256 shared keys, 44
    of their own: 3 row blocks x 4 KV heads on 6 SMs), and the Triton kernel's elsewhere (256
    sequences under 1,024 shared keys, 17 of their own: 32 units on all 16 SMs), and a plan
    builds one work list once the choice is made (on an H200 a second one on every plan made
    a host-bound engine step 33% longer: kernels-notes.md, issue 25 part twenty-eight). The
    same output as the twin (on the CPU from
    the Triton kernel in the walk's shape). A graph's plan is captured again when it flips."""
    from prefixserve.attention.ops.triton import kernels as tk
    from prefixserve.bench.kernels.rows import Workload, build

    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_tails", lambda shape: True)
    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_wide", lambda shape, chunk: True)
    walk = choose_configs(4096, 128, 2, gluon=True, tails=True)[0]
    assert walk.tails and walk.dynamic and walk.block_n == 64 and walk.num_warps == 4
    assert not choose_configs(32, 128, 2, gluon=True, tails=True)[0].tails  # beside 128-row units only
    rows = [build(Workload("test", b, 16, 4, 128, context, (shared,), 16, "float16"), DEVICE)
            for b, context, shared in ((96, 300, 256), (256, 1040, 1024))]
    builds = []
    build_worklist = tk.build_worklist
    monkeypatch.setattr(tk, "build_worklist", lambda *a, **k: builds.append(1) or build_worklist(*a, **k))
    for row, on in zip(rows, (True, False), strict=True):
        backend = RelayBackend(row.shape, kernels=tops.TritonKernels(row.shape, sms=16))
        for batch in (build(row.w, DEVICE, seed=1).batch, row.batch):  # a plan's work lists: two where
            builds.clear()  # the walk's choice flips, then one
            backend.plan(batch)
            assert len(builds) == (2 if on and batch is not row.batch else 1)
        x = backend.current.extra
        assert x["narrow_tails"] == on and x["wide_block_m"] == 128 and x["narrow_programs"] > 0
        assert not on or backend.kernels.launch_config(x, "narrow") == walk
        args = (row.q, row.k, row.v, row.k_cache.clone(), row.v_cache.clone())
        o = backend.run(*args)
        twin = RelayBackend(row.shape, kernels=ops.ReferenceKernels(row.shape))
        twin.plan(row.batch)
        ref = twin.run(*args[:3], row.k_cache.clone(), row.v_cache.clone())
        assert (o.float() - ref.float()).abs().max() <= 4 * U[torch.float16] * row.vmax
    assert graph_plans(rows[::-1] + rows[::-1][1:], "narrow_tails") == [(False, 0), (True, 1), (True, 1)]


def test_plans_take_the_swapped_walk_beside_one_wave_of_wide_units(monkeypatch):
    """Where the wide units hold every SM in one wave, the swapped walk runs beside them if a
    wide item walks fewer than WALK_OVER_TAILS x a tail's entries (64 sequences under 1,024
    shared keys, 33 of their own: 64 / 3 entries; 2 row blocks x 4 KV heads split in 2 on all
    16 SMs), and not at 64x (10 of their own: one entry)."""
    from prefixserve.bench.kernels.rows import Workload, build

    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_tails", lambda shape: True)
    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_wide", lambda shape, chunk: True)
    for context, on in ((1056, True), (1034, False)):
        row = build(Workload("test", 64, 16, 4, 128, context, (1024,), 16, "float16"), DEVICE)
        backend = RelayBackend(row.shape, kernels=tops.TritonKernels(row.shape, sms=16))
        backend.plan(row.batch)
        x = backend.current.extra
        assert int(x["unit_counts"][2]) * 4 == 16 and int(x["wide_programs"]) == 16  # every SM, one wave
        assert bool(x["narrow_tails"]) == on


def graph_plans(rows: list, key: str) -> list[tuple[bool, int]]:
    """Relay's padded (graph) plans of `rows` in turn on one TritonKernels (16 SMs): each plan's
    extra `key`, and the kernels' generation counted from the first plan's."""
    kernels = tops.TritonKernels(rows[0].shape, sms=16)
    backend = RelayBackend(rows[0].shape, kernels=kernels)
    seen = []
    for row in rows:
        backend.plan(dataclasses.replace(row.batch, padded=PaddedRows(row.batch.num_tokens + 2, 0)))
        seen.append((bool(backend.current.extra[key]), kernels.generation))
    return [(value, generation - seen[0][1]) for value, generation in seen]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_units_that_store_use_the_new_keys_as_the_cache_holds_them(dtype):
    """New keys given in fp32, between two values of the cache's dtype: the units that write
    them attend with them rounded to it, as a store launch writes them and later steps read
    them -- the same output as for the keys given in the cache's dtype."""
    case = tree_case(108, dtype, 64, 20, 16, False)
    # a relative nudge under half an ulp: the same cache values, other fp32 products
    nudge = 1 + 2.0 ** -({torch.float16: 10, torch.bfloat16: 7}[dtype] + 2)  # mantissa bits + 2
    k, v = case.k.float() * nudge, case.v.float() * nudge
    assert torch.equal(k.to(dtype), case.k) and not torch.equal(k, case.k.float())
    outs = []
    for new_k, new_v in ((case.k, case.v), (k, v)):
        backend = RelayBackend(case.shape, kernels=tops.TritonKernels(case.shape, sms=3))
        backend.plan(case.batch)
        assert backend.current.extra["stores"]
        k_cache, v_cache = to_dev(case.k_cache.clone(), case.v_cache.clone())
        outs.append(backend.run(*to_dev(case.q, new_k, new_v), k_cache, v_cache).cpu())
        flat = k_cache.view(-1, *k_cache.shape[2:]).cpu()
        assert torch.equal(flat[case.batch.slots], case.k)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("seed,dtype,head_dim,group,chunk,prefill",
                         [c for c in BACKEND_CASES if not c[-1]])  # graphs replay decode steps
def test_padded_batches_on_triton_match_dense(seed, dtype, head_dim, group, chunk, prefill):
    """A CUDA-graph batch (fixed grids, forced merge into reserved scratch): real rows as
    unpadded, padding rows 0 and writing at most the pad slot (in a chunk of its own): a store
    launch writes their keys there, units that store write none."""
    case = tree_case(seed, dtype, head_dim, group, chunk, prefill)
    ref, t = dense_attention(case), case.batch.num_tokens
    vmax = max(v.double().abs().max() for _, v in case.seq_kv)
    pad_slot = case.k_cache.shape[0] * chunk
    batch = dataclasses.replace(case.batch, padded=PaddedRows(t + 5, pad_slot))
    q, k, v = (torch.cat([x, torch.randn(5, *x.shape[1:]).to(x.dtype)]) for x in (case.q, case.k, case.v))
    for name, cls in BACKENDS.items():
        backend = cls(case.shape, kernels=tops.TritonKernels(case.shape, sms=3))
        backend.plan(batch)
        stores = backend.current.extra["stores"]
        assert stores == folds(case, prefill), name
        assert backend.current.extra["merge_unroll"] == 8, name  # a graph's, right for any later plan
        k_cache, v_cache = (torch.cat([c, torch.zeros_like(c[:1])]) for c in (case.k_cache, case.v_cache))
        k_cache, v_cache = to_dev(k_cache, v_cache)
        o = backend.run(*to_dev(q, k, v), k_cache, v_cache).cpu()
        assert o.shape == q.shape and not o[t:].any(), name
        bound = U[dtype] * ref.abs() + o_tol(dtype) * vmax
        assert ((o[:t].double() - ref).abs() <= bound).all(), name
        pad_chunk = k_cache[-1].cpu()  # [C, Hkv, D]: slot 0 holds the padding rows' keys
        # (on a GPU they race: each element is some padding row's), or nothing
        if stores:
            assert not pad_chunk.any(), name
        else:
            assert (pad_chunk[0][None] == k[t:].to(dtype)).any(0).all(), name
            assert not pad_chunk[1:].any(), name
        flat = k_cache[:-1].reshape(-1, *k_cache.shape[2:]).cpu()
        assert torch.equal(flat[case.batch.slots], case.k.to(dtype)), name


def _random_items(rng: np.random.Generator, merge: bool):
    n = int(rng.integers(1, 12))
    q_len = rng.integers(1, 40, n)
    entries = rng.integers(1, 30, n)
    q_start = rng.integers(0, 50, n)  # items may share rows (as shared items do)
    kv_indptr = np.concatenate([[0], np.cumsum(entries)])
    out_start = np.concatenate([[0], np.cumsum(q_len)[:-1]])
    if not merge:
        return q_start, q_len, out_start, kv_indptr, int(q_len.sum()), None, None
    num_rows = int(q_len.sum()) // 2 + 1  # partial rows -> final rows, at random
    final = rng.integers(0, num_rows, int(q_len.sum()))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(final, minlength=num_rows))])
    return q_start, q_len, out_start, kv_indptr, num_rows, indptr, np.argsort(final, kind="stable")


def test_items_need_the_position_mask_as_their_units_do():
    """`items_need_causal` (asked before the items are cut, to choose the launch shapes)
    answers as the units' `needs_causal` does, per launch class, both ways."""
    answers = set()
    for seed in range(12):
        rng = np.random.default_rng(seed)
        q_start, q_len, out_start, kv_indptr, num_rows, _, _ = _random_items(rng, False)
        n_rows, n_entries = int((q_start + q_len).max()), int(kv_indptr[-1])
        q_pos = rng.integers(150, 400, n_rows)  # keys at 0-199 + up to 8 slots: some rows precede some
        kv_lo = rng.integers(0, 8, n_entries)
        kv_hi = kv_lo + rng.integers(1, 9, n_entries)
        kv_pos = rng.integers(0, 200, n_entries)
        cfgs = (KernelConfig(16, 32), KernelConfig(64, 32))
        wl = build_worklist(q_start, q_len, out_start, kv_indptr, num_rows, None, None, cfgs, group=2,
                            num_kv_heads=2, chunk_size=16, itemsize=2, num_sms=3,
                            positions=[q_pos, kv_pos, kv_lo, kv_hi])
        wide = q_len * 2 > NARROW_ROWS
        for cls, select in enumerate((~wide, wide)):
            answer = items_need_causal(q_start, q_len, kv_indptr, select, q_pos, kv_pos, kv_lo, kv_hi)
            assert answer == wl.causal[cls], (seed, cls)
            answers.add(answer)
    assert answers == {False, True}


def _prompt(cached: int, new: int, chunk: int):
    """One sequence's prefill: `new` rows after `cached` cached keys, one item over all its
    chunks (as `plan.index_arrays` cuts it): (q_pos, item arrays, kv_chunk, kv_lo, kv_hi, kv_pos)."""
    n_chunks = -(-(cached + new) // chunk)
    kv_lo = np.zeros(n_chunks, np.int64)
    kv_hi = np.minimum(chunk, cached + new - chunk * np.arange(n_chunks))
    kv_pos = chunk * np.arange(n_chunks)
    return (cached + np.arange(new), np.array([0]), np.array([new]), np.array([0]),
            np.array([0, n_chunks]), np.arange(n_chunks)[::-1].copy(), kv_lo, kv_hi, kv_pos)


@pytest.mark.parametrize("cached,new,group,block_m", [(0, 300, 1, 64), (40, 200, 4, 64), (0, 128, 2, 128),
                                                      (500, 20, 1, 64)])
def test_prefill_units_leave_out_the_keys_after_their_rows(cached, new, group, block_m):
    """A prompt's row blocks read its entries up to their last row's position, each such
    (row, entry) pair once; nothing after it (the upper triangle's tiles, all masked)."""
    q_pos, q_start, q_len, out_start, kv_indptr, _, kv_lo, kv_hi, kv_pos = _prompt(cached, new, 16)
    cfgs = (KernelConfig(16, 32), KernelConfig(block_m, 32))
    wl = build_worklist(q_start, q_len, out_start, kv_indptr, new, None, None, cfgs, group=group,
                        num_kv_heads=2, chunk_size=16, itemsize=2, num_sms=4,
                        positions=[q_pos, kv_pos, kv_lo, kv_hi])
    units = np.concatenate([wl.narrow, wl.wide])
    assert wl.causal == (len(wl.narrow) > 0, len(wl.wide) > 0)
    pairs = set()
    for qs, n, e0, e1, _, _ in units.tolist():
        last_row = q_pos[qs + n - 1]
        assert e0 == e1 or kv_pos[e1 - 1] <= last_row  # its last entry: seen by its last row
        pairs |= {(r, e) for r in range(qs, qs + n) for e in range(e0, e1)}
    if -(-new * group // block_m) > 1:  # two row blocks or more: some reads fewer entries than all
        assert len(pairs) < new * int(kv_indptr[-1])
    seen = {(r, e) for r in range(new) for e in range(int(kv_indptr[-1])) if kv_pos[e] <= q_pos[r]}
    assert seen <= pairs  # every entry a row sees some key of
    assert sum(int(n) * int(e1 - e0) for _, n, e0, e1, _, _ in units.tolist()) == len(pairs)  # each once
    for e0, e1 in zip(units[:-1, 3] - units[:-1, 2], units[1:, 3] - units[1:, 2], strict=True):
        assert e0 >= e1  # longest first


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_without_the_upper_triangle_gives_the_same_outputs(dtype, monkeypatch):
    """The trimmed units' outputs are the untrimmed units' (values equal, both launches'
    kernels, with a cached prefix and without)."""
    g = torch.Generator().manual_seed(7)
    hkv, grp, d, chunk = 2, 2, 64, 16
    for cached, new in ((0, 150), (37, 90)):
        q_pos, *items, kv_chunk, kv_lo, kv_hi, kv_pos = _prompt(cached, new, chunk)
        n_chunks = len(kv_chunk)
        k_cache, v_cache = (torch.randn(n_chunks, chunk, hkv, d, generator=g).to(dtype) for _ in "kv")
        q = torch.randn(new, hkv * grp, d, generator=g).to(dtype)
        idx = [torch.from_numpy(np.asarray(a)).int() for a in (q_pos, *items, kv_chunk, kv_lo, kv_hi, kv_pos)]
        args = to_dev(q, k_cache, v_cache, *idx)
        configs = (KernelConfig(16, 32, num_warps=2), KernelConfig(64, 32))
        o, lse = tops.attend_items(*args, d ** -0.5, new, sms=3, configs=configs)
        with monkeypatch.context() as m:
            m.setattr(worklist, "trim_causal", lambda units, *_: units)
            o_all, lse_all = tops.attend_items(*args, d ** -0.5, new, sms=3, configs=configs)
        assert torch.equal(o, o_all) and torch.equal(lse, lse_all), (cached, new)
        o_ref, _ = reference.attend_items(q, k_cache, v_cache, *idx, d ** -0.5, new)
        assert (o.cpu() - o_ref).abs().max() <= o_tol(dtype) * v_cache.abs().max().float()


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_worklist_covers_every_row_and_entry_once(seed, merge):
    rng = np.random.default_rng(seed)
    q_start, q_len, out_start, kv_indptr, num_rows, indptr, parts = _random_items(rng, merge)
    cfgs = tuple(KernelConfig(m, int(rng.choice([32, 64])))
                 for m in (16, int(rng.choice([32, 64, 128]))))
    wl = build_worklist(q_start, q_len, out_start, kv_indptr, num_rows, indptr, parts, cfgs,
                        group=int(rng.integers(1, 5)), num_kv_heads=2,
                        chunk_size=int(rng.choice([16, 48, 64])), itemsize=2,
                        num_sms=int(rng.integers(1, 8)))
    # every (item row, entry) pair exactly once; a unit's rows/entries within one item
    seen = {}
    for qs, n, e0, e1, out, store in np.concatenate([wl.narrow, wl.wide]).tolist():
        item = int(np.searchsorted(kv_indptr, e0, side="right")) - 1
        assert e1 <= kv_indptr[item + 1] and e0 < e1 and 0 < n and store == -1 and not wl.stores
        k0 = qs - q_start[item]
        assert 0 <= k0 and k0 + n <= q_len[item]
        for k in range(k0, k0 + n):
            for e in range(e0, e1):
                assert (item, k, e) not in seen
                seen[item, k, e] = out + k - k0  # the row this pair's partial is written to
    assert len(seen) == int((q_len * np.diff(kv_indptr)).sum())
    # each final row merges exactly the written rows of its partials
    partial_of_written = {w: out_start[i] + k for (i, k, _), w in seen.items()}
    assert sorted(partial_of_written) == list(range(wl.num_partials))
    final_of_partial = (np.arange(num_rows) if indptr is None
                        else np.repeat(np.arange(num_rows), np.diff(indptr))[np.argsort(parts)])
    if wl.direct:
        assert all(w == p for w, p in partial_of_written.items())
        return
    m_indptr, m_parts = wl.merge_indptr, wl.merge_parts
    for r in range(num_rows):
        got = sorted(m_parts[m_indptr[r]:m_indptr[r + 1]].tolist())
        want = sorted(w for w, p in partial_of_written.items() if final_of_partial[p] == r)
        assert got == want


def test_a_lone_shared_item_is_split_to_fill_the_sms():
    # Table 3's all-shared row: 32 sequences' rows (G = 1) x 1,024 keys, 32 KV heads, 132 SMs:
    # split until every SM has a program (the partials' floor alone gave 64 programs)
    configs = choose_configs(32, 128, 2)
    wl = build_worklist([0], [32], [0], [0, 16], 32, None, None, configs, group=1,
                        num_kv_heads=32, chunk_size=64, itemsize=2, num_sms=132)
    assert len(wl.wide) * 32 >= 128 and not wl.direct
    # and not where the partials' floor leaves enough programs (64 sequences x 2 heads)
    wl = build_worklist([0], [64], [0], [0, 16], 64, None, None, choose_configs(64, 128, 2),
                        group=1, num_kv_heads=2, chunk_size=64, itemsize=2, num_sms=1)
    assert len(wl.wide) == 1 and wl.direct


def test_splits_only_where_they_end_the_launch_sooner():
    # one shared item (1,024 sequences x G 4, 256 chunks) + 1,024 one-chunk tails, 8 KV heads,
    # 132 SMs: the 32 row blocks x 8 heads already fill the wide grid (Triton's 264 programs,
    # Gluon's 132 CTAs) once; splitting would only add partials. At 256 sequences (8 row
    # blocks) the item is split into as many splits as fill one wave: 4 on Triton's grid, 2 on
    # Gluon's (3, the balanced share's rounding, or 8, would take two waves or add partials)
    for gluon, n, wide_units in ((False, 1024, 32), (False, 256, 32), (True, 1024, 32), (True, 256, 16)):
        configs = choose_configs(4096, 128, 2, gluon=gluon)
        q_len = np.r_[n, np.ones(n, int)]
        kv_indptr = np.r_[0, np.cumsum(np.r_[256, np.ones(n, int)])]
        wl = build_worklist(np.r_[0, np.arange(n)], q_len, np.r_[0, n + np.arange(n)], kv_indptr,
                            n, None, None, configs, group=4, num_kv_heads=8, chunk_size=64,
                            itemsize=2, num_sms=132)
        assert len(wl.wide) == wide_units and len(wl.narrow) == n


def test_the_wide_launch_leaves_sms_to_tails_that_outlast_it():
    # Gluon's 128-row CTAs beside the narrow launch, 132 SMs, G 4, 8 KV heads: a shared item of
    # n sequences x 128 or 256 chunks and a tail of t chunks each. Where the tails' bytes
    # outlast the products, the wide units are balanced over fewer SMs (whole waves of their
    # row blocks), the rest streaming tails at full width; where they do not, or on Triton's
    # grid (2 programs an SM, no narrow program beside them), over all
    for gluon, n, shared, tail, sms, blocks in ((True, 256, 128, 8, 64, 8), (True, 1024, 256, 8, 86, 32),
                                                 (True, 256, 128, 2, 132, 16), (True, 1024, 256, 2, 132, 32),
                                                 (False, 256, 128, 8, 132, 32)):
        configs = choose_configs(4096, 128, 2, gluon=gluon)
        q_len = np.r_[n, np.ones(n, int)]
        kv_indptr = np.r_[0, np.cumsum(np.r_[shared, np.full(n, tail)])]
        wl = build_worklist(np.r_[0, np.arange(n)], q_len, np.r_[0, n + np.arange(n)], kv_indptr,
                            n, None, None, configs, group=4, num_kv_heads=8, chunk_size=64,
                            itemsize=2, num_sms=132)
        assert (wl.wide_sms, len(wl.wide)) == (sms, blocks), (gluon, n, shared, tail)
        # every row block (32 sequences x G 4) takes the shared entries once, whatever the splits
        assert (wl.wide[:, 3] - wl.wide[:, 2]).sum() == shared * n // 32, (gluon, n)


def test_the_wide_launch_takes_chunk_pairs_where_the_products_bound_the_step(monkeypatch):
    """Where the Gluon wide kernel runs (made to seem so: the CPU has none), a decode step's
    128-row wide units (64 sequences x G 4 under 4,096 shared keys, 16 SMs) take 128-key tiles
    of two chunks (`hopper_pairs`) where their items walk 32x a tail's entries and hold every
    SM: with 64-key tails, not with 512-key ones, nor over 128-slot chunks or an fp8 cache. A
    graph's plan is captured again when the choice flips, not between two plans alike."""
    from prefixserve.bench.kernels.rows import Workload, build

    monkeypatch.setattr("prefixserve.attention.ops.triton.kernels._gluon_wide", lambda shape, chunk: True)
    cases = [(4159, 64, "", True), (4607, 64, "", False), (4159, 128, "", False), (4159, 64, "fp8", False)]
    for context, chunk, kv_dtype, pairs in cases:
        row = build(Workload("test", 64, 8, 2, 64, context, (4096,), chunk, "float16", kv_dtype=kv_dtype), DEVICE)
        backend = RelayBackend(row.shape, kernels=tops.TritonKernels(row.shape, sms=16))
        backend.plan(row.batch)
        x = backend.current.extra
        assert x["wide_block_m"] == 128 and x["wide_hopper"] and x["wide_pairs"] == pairs, (context, chunk, kv_dtype)
    rows = [build(Workload("test", 64, 8, 2, 64, context, (4096,), 64, "float16"), DEVICE)
            for context in (4159, 4159, 4607)]
    assert graph_plans(rows, "wide_pairs") == [(True, 0), (True, 0), (False, 1)]


def test_narrow_launch_shapes_beside_the_gluon_kernel_and_over_fp8():
    # 128-row wide launches on the Gluon kernel: the narrow launch fits beside its CTA (capped
    # registers, units from a counter); at 32 rows (Table 3, one row warpgroup) it keeps its
    # shape; the wide launch's splits target the kernel's one CTA an SM at either size
    narrow, wide = choose_configs(4096, 128, 2, gluon=True)
    assert wide.block_m == 128 and narrow.dynamic and narrow.maxnreg == NARROW_REGS_BESIDE_GLUON
    assert wide.programs_per_sm == 1
    (narrow, wide), (narrow_triton, wide_triton) = (choose_configs(32, 128, 2, gluon=g) for g in (True, False))
    assert narrow == narrow_triton and wide.block_m == wide_triton.block_m == 32
    assert (wide.programs_per_sm, wide_triton.programs_per_sm) == (1, 4)
    assert choose_configs(4096, 128, 2, gluon=False)[0] == choose_configs(32, 128, 2)[0]
    # an fp8 cache (never the Gluon kernel's): two half-size tiles in flight
    fp8 = choose_configs(4096, 128, 2, fp8=True)[0]
    assert fp8.num_stages == 5 and fp8.block_n == 32 and not fp8.dynamic


def test_decode_units_store_their_rows_new_keys():
    # rows 0 and 1 under one shared item (entries 0-1), each with a tail of four 16-slot
    # entries whose last key is at the row's own position (83, 88)
    q_start, q_len, out_start = np.r_[0, 0, 1], np.r_[2, 1, 1], np.r_[0, 2, 3]
    kv_indptr = np.r_[0, 2, 6, 10]
    chunks = np.r_[7, 3, 5, 9, 10, 11, 6, 8, 12, 13]
    kv_pos = np.r_[0, 16, 32, 48, 64, 80, 32, 48, 64, 80]
    kv_lo, kv_hi = np.zeros(10, int), np.r_[16, 16, 16, 16, 16, 4, 16, 16, 16, 9]
    configs = (KernelConfig(16, 16), KernelConfig(32, 16))

    def build(q_pos, kv_chunk=chunks, num_sms=1, kv_hi=kv_hi):
        return build_worklist(q_start, q_len, out_start, kv_indptr, 2, np.r_[0, 2, 4],
                              np.r_[0, 2, 1, 3], configs, group=1, num_kv_heads=1,
                              chunk_size=16, itemsize=2, num_sms=num_sms,
                              positions=(q_pos, kv_pos, kv_lo, kv_hi), kv_chunk=kv_chunk)

    for sms, tail_units in ((1, 2), (8, 4)):  # 8 SMs: split tails, and only the last split stores
        wl = build(np.r_[83, 88], num_sms=sms)
        units = np.concatenate([wl.narrow, wl.wide])
        assert wl.stores and (units[:, 1] == 1).sum() == tail_units
        stores = units[units[:, 5] != -1]
        assert sorted(stores[:, 5].tolist()) == [0, 1] and (stores[:, 0] == stores[:, 5]).all()
        assert (stores[:, 3] == kv_indptr[stores[:, 0] + 2]).all()
    # row 0's new key alone in its last entry (a fresh chunk): the unit leaves that entry out
    wl = build(np.r_[80, 88], kv_hi=np.r_[16, 16, 16, 16, 16, 1, 16, 16, 16, 9])
    assert wl.stores and wl.narrow[wl.narrow[:, 5] == -2, 3].tolist() == [5]
    assert wl.narrow[wl.narrow[:, 5] == 1, 3].tolist() == [10]
    # row 1's last entry reads row 0's new key (chunk 11, slot 3): it recomputes a cached token
    assert not build(np.r_[83, 88], kv_chunk=np.r_[7, 3, 5, 9, 10, 11, 6, 8, 12, 11]).stores
    # a row's newest key is not at its own position (prefill: a later row reads it, causal)
    assert not build(np.r_[84, 88]).stores and not build(np.r_[82, 88]).stores
    # no kv_chunk: a store launch
    assert not build_worklist(q_start, q_len, out_start, kv_indptr, 2, np.r_[0, 2, 4],
                              np.r_[0, 2, 1, 3], configs, group=1, num_kv_heads=1, chunk_size=16,
                              itemsize=2, num_sms=1,
                              positions=(np.r_[83, 88], kv_pos, kv_lo, kv_hi)).stores


def test_imports_and_runs_on_cpu_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import prefixserve.attention.ops.triton as t, prefixserve.attention.ops.triton.worklist\n"
            "from prefixserve.attention import create_backend, backend_names\n"
            "from prefixserve.attention.base import AttentionShape\n"
            "import torch\n"
            "s = AttentionShape(4, 2, 8, 0.3, torch.float32, torch.device('cpu'))\n"
            "[create_backend(n, s) for n in backend_names()]\n"
            "import prefixserve.bench.kernels\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("version,tested", [("3.6.0", True), ("3.6.1", True), ("3.5.1", False),
                                            ("3.9.0", False), ("4.6.0", False)])
def test_gluon_kernel_only_on_the_triton_it_is_tested_on(version, tested):
    """Gluon's API moves between Triton releases: the Hopper kernel (`ops.triton.hopper`) is
    taken on the version it is tested on only, every other launch runs the Triton kernel."""
    from prefixserve.attention.ops.triton.launch import gluon_tested
    assert gluon_tested(version) == tested
