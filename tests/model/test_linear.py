"""Deterministic mode's GEMM (`fused.linear`): every row's bits independent of how many rows are
computed with it and where it sits -- the CPU twin (fixed row blocks) and the Triton kernel, in
the interpreter (PREFIXSERVE_TRITON_TEST_DEVICE=cuda: compiled on a GPU, where launch shapes
follow M and cuBLAS is used where it was checked to agree)."""

from __future__ import annotations

import os

import pytest
import torch

from prefixserve.model.fused import linear_reference

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton
ROWS = [1, 2, 3, 15, 16, 17, 33, 64, 100, 257, 300]


def check_invariant(linear, x, w, b):
    full = linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert ((full.double() - ref).norm() / ref.norm()) < (1e-6 if x.dtype == torch.float32 else 1e-2)
    for m in ROWS:
        for start in (0, 7):
            if start + m <= len(x):
                assert torch.equal(linear(x[start:start + m], w, b), full[start:start + m]), (m, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (1536, 576, True), (100, 70, False)])
def test_twin_rows_do_not_depend_on_the_batch(dtype, k, n, bias):
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(310, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    check_invariant(linear_reference.linear, x, w, b)


def test_a_plain_blas_product_is_not_invariant():
    """What the twin is for: torch's CPU product changes a row's bits with the row count."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 1536, generator=g), torch.randn(576, 1536, generator=g)
    full = torch.nn.functional.linear(x, w)
    assert any(not torch.equal(torch.nn.functional.linear(x[:m], w), full[:m]) for m in ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,bias", [(576, 960, True), (256, 130, False)])
def test_kernel_rows_do_not_depend_on_the_batch(dtype, k, n, bias):
    pytest.importorskip("triton")
    from prefixserve.model.fused import linear_triton
    g = torch.Generator().manual_seed(k)
    x, w = (torch.randn(310, k, generator=g).to(dtype).to(DEVICE), torch.randn(n, k, generator=g).to(dtype).to(DEVICE))
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    check_invariant(linear_triton.linear, x, w, b)


def test_block_k_follows_k_alone_where_k_leaves_a_tail():
    pytest.importorskip("triton")
    from prefixserve.model.fused import linear_triton
    x = torch.empty(1, device="cpu")
    assert linear_triton.config(1, 576, x) == linear_triton.config(5000, 576, x)  # one shape off sm_90
