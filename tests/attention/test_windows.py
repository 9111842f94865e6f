"""Sliding-window attention: every backend (reference ops, and the Triton kernels in the
interpreter or compiled with PREFIXSERVE_TRITON_TEST_DEVICE=cuda) against dense float64
windowed attention on random prefix trees; the cut of a batch to the window (`window.py`);
the cost model reading at most the window.

The trees' unused slots hold NaN: a cut that pointed a segment at the wrong slots would read
them. Windows from 1 (each query sees only itself) to more than most sequences' lengths.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton

from prefixserve.attention import create_backend  # noqa: E402
from prefixserve.attention.backends.chunk import ChunkBackend  # noqa: E402
from prefixserve.attention.backends.hydragen import HydragenBackend  # noqa: E402
from prefixserve.attention.backends.paged import PagedBackend  # noqa: E402
from prefixserve.attention.base import AttentionBatch, Segment, SeqQueries  # noqa: E402
from prefixserve.attention.cost import schedule_cost  # noqa: E402
from prefixserve.attention.schedule import SCHEDULES  # noqa: E402
from prefixserve.attention.window import windowed  # noqa: E402

from attn_trees import dense_attention, make_case  # noqa: E402

EXACT = ["paged", "relay", "hydragen", "chunk", "auto"]
FP32_TOL = 1e-5  # relative to max|v| (see test_backends)
WINDOWS = [1, 5, 17, 40]


def case_for(seed: int, prefill: bool, window: int, size: int = 4, group: int = 2,
             dtype=torch.float32):
    rng = random.Random(seed)
    case = make_case(rng.randint, torch.Generator().manual_seed(seed), size, group, dtype, prefill)
    return dataclasses.replace(case, shape=dataclasses.replace(case.shape, sliding_window=window))


def check(o: torch.Tensor, case, ref: torch.Tensor, u: float = 0.0) -> None:
    """u: unit roundoff of 16-bit inputs (P is rounded to it for the PV product: 2u max|v|,
    as test_triton_ops), and of o's cast (u |ref|)."""
    vmax = max(v.double().abs().max() for _, v in case.seq_kv)
    bound = u * ref.abs() + (FP32_TOL + 2 * u) * vmax
    assert ((o.double().cpu() - ref).abs() <= bound).all()


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seed", range(4))
def test_reference_backends_match_dense_windowed(seed, window, prefill):
    """Both plans of one backend: full layers as dense causal, sliding ones as dense windowed."""
    case = case_for(seed, prefill, window)
    full, slid = dense_attention(case), dense_attention(case, window)
    for name in EXACT:
        backend = create_backend(name, case.shape)
        backend.plan(case.batch)
        for w, ref in ((None, full), (window, slid)):
            k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
            check(backend.run(case.q, case.k, case.v, k_cache, v_cache, window=w), case, ref)


TRITON_CASES = [(0, 5, False, torch.float32), (1, 17, True, torch.bfloat16),
                (2, 1, False, torch.float16), (3, 40, True, torch.float32)]


@pytest.mark.parametrize("seed,window,prefill,dtype", TRITON_CASES)
def test_triton_backends_match_dense_windowed(seed, window, prefill, dtype):
    pytest.importorskip("triton")
    from prefixserve.attention.ops.triton import TritonKernels
    case = case_for(seed, prefill, window, size=16, group=3, dtype=dtype)
    case = dataclasses.replace(case, shape=dataclasses.replace(case.shape, device=DEVICE))
    ref = dense_attention(case, window)
    u = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    for cls in (PagedBackend, HydragenBackend, ChunkBackend):  # sms=3: split-K units too
        backend = cls(case.shape, kernels=TritonKernels(case.shape, sms=3),
                      window_kernels=TritonKernels(case.shape, sms=3))
        backend.plan(case.batch)
        k_cache, v_cache = (x.clone().to(DEVICE) for x in (case.k_cache, case.v_cache))
        q, k, v = (x.to(DEVICE) for x in (case.q, case.k, case.v))
        o = backend.run(q, k, v, k_cache, v_cache, window=window)
        check(o, case, ref, u)


def test_cut_keeps_what_some_query_sees():
    """Two sequences share node 0 (positions 0-19, chunks 7, 3, 5 of 8 slots, from slot 2);
    sequence A (q_pos 30) sees from 30 - 6 + 1 = 25: nothing of node 0 but for B (q_pos 22,
    sees from 17), so node 0 keeps positions 17-19 -- slot 2 + 17 = 19: chunk 5, slot 3."""
    shared = Segment(0, 0, 20, (7, 3, 5), 2)
    a = SeqQueries(0, 1, 30, (shared, Segment(1, 20, 11, (9, 2), 0)))
    b = SeqQueries(1, 1, 22, (shared, Segment(2, 20, 3, (4,), 0)))
    cut = windowed(AttentionBatch((a, b), 8, torch.tensor([10, 35])), window=6)
    assert cut.windowed and cut.seqs[0].segments[0] == cut.seqs[1].segments[0] == Segment(0, 17, 3, (5,), 3)
    assert cut.seqs[0].segments[1] == Segment(1, 25, 6, (9, 2), 5)  # key 5: chunk 9, slot 5
    assert cut.seqs[1].segments[1] == b.segments[1]
    alone = windowed(AttentionBatch((a,), 8, torch.tensor([10])), window=6)
    assert alone.seqs[0].segments == (Segment(1, 25, 6, (9, 2), 5),)  # node 0 dropped


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_sliding_layer_reads_at_most_the_window(name):
    """Decode rows at one position: every schedule of the cut batch reads at most W keys per
    sequence (paged: exactly min(W, kv_len)); the shared prefix beyond the window is gone."""
    shared = Segment(0, 0, 1000, tuple(range(63)), 0)
    seqs = tuple(SeqQueries(i, 1, 1009, (shared, Segment(1 + i, 1000, 10, (100 + i,), 8)))
                 for i in range(8))
    batch = AttentionBatch(seqs, 16, torch.arange(8))
    shape = case_for(0, False, 64).shape
    cut = windowed(batch, 64)
    keys = sum(it.num_keys for it in SCHEDULES[name](cut).items)
    assert keys <= 8 * 64
    if name == "paged":
        assert keys == 8 * 64
        full = schedule_cost(SCHEDULES[name](batch), shape)
        assert schedule_cost(SCHEDULES[name](cut), shape).kv_bytes * 1010 == full.kv_bytes * 64
