"""The fp8 KV cache in the Triton kernels against their reference twins: every stored byte the
same (the store launch and the decode units that store), and attention over an e4m3 cache with
per-head power-of-two scales within the 16-bit tolerances of the dequantized values, through
the attend launch, the backends (split-K, merge, padded graph steps) and the cell executor.

Interpreted (TRITON_INTERPRET=1) or, with PREFIXSERVE_TRITON_TEST_DEVICE=cuda, compiled.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton
pytest.importorskip("triton")

from prefixserve.attention import ops  # noqa: E402
from prefixserve.attention.base import PaddedRows  # noqa: E402
from prefixserve.attention.ops import reference  # noqa: E402
from prefixserve.attention.ops import triton as tops  # noqa: E402
from prefixserve.attention.ops.reference import FP8  # noqa: E402
from prefixserve.attention.ops.triton.cells import CellKernels  # noqa: E402
from prefixserve.attention.plan import index_arrays  # noqa: E402
from prefixserve.attention.schedule import SCHEDULES  # noqa: E402

from test_triton_ops import BACKENDS, U, folds, o_tol, to_dev, tree_case  # noqa: E402


def scales(hkv: int, seed: int) -> torch.Tensor:
    """[4, Hkv]: random powers of two 2^-8 .. 2^-5 (randn values reach 448 x scale at most
    sometimes: saturation is exercised too) and their inverses."""
    g = torch.Generator().manual_seed(seed)
    s = torch.exp2(-torch.randint(5, 9, (2, hkv), generator=g).float())
    return torch.cat([s, 1 / s])


def fp8_case(seed, dtype, head_dim, group, chunk, prefill):
    """A tree case whose cache holds e4m3 (NaN slots stay NaN), and its kv_scale."""
    case = tree_case(seed, dtype, head_dim, group, chunk, prefill)
    kv_scale = scales(case.k_cache.shape[2], seed)
    k8, v8 = (reference.quantize(c.view(-1, *c.shape[2:]), kv_scale[i]).view(c.shape)
              for c, i in ((case.k_cache, reference.K_INV), (case.v_cache, reference.V_INV)))
    shape = dataclasses.replace(case.shape, kv_dtype=FP8)
    return dataclasses.replace(case, shape=shape, k_cache=k8, v_cache=v8), kv_scale


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_quantizes_as_the_reference(dtype):
    # bf16 inputs x 30 land on e4m3 ties often (8 bits into 4): ties go to even in both
    g = torch.Generator().manual_seed(3)
    caches = [torch.zeros(5, 16, 3, 64, dtype=FP8) for _ in "kv"]
    k, v = (torch.randn(7, 3, 64, generator=g).to(dtype) * 30 for _ in "kv")
    kv_scale = torch.tensor([[0.25, 0.5, 0.125], [0.0625, 1.0, 2.0], [4, 2, 8], [16, 1, 0.5]])
    slots = torch.randperm(80, generator=g)[:7]
    expect = [c.clone() for c in caches]
    reference.store_kv(*expect, k, v, slots, kv_scale)
    got = to_dev(*caches)
    tops.store_kv(*got, *to_dev(k, v, slots, kv_scale))
    assert all(same_bytes(x, y) for x, y in zip(got, expect, strict=True))
    assert expect[0].float().abs().max() == reference.FP8_MAX  # some values saturated


@pytest.mark.parametrize("seed,dtype,head_dim,group,chunk,prefill",
                         [(0, torch.bfloat16, 128, 1, 64, False), (1, torch.float16, 64, 8, 16, True),
                          (2, torch.float32, 64, 3, 16, False), (3, torch.bfloat16, 64, 4, 64, True),
                          (4, torch.float16, 64, 1, 64, False)])
def test_attend_items_over_fp8_matches_reference(seed, dtype, head_dim, group, chunk, prefill):
    case, kv_scale = fp8_case(seed, dtype, head_dim, group, chunk, prefill)
    reference.store_kv(case.k_cache, case.v_cache, case.k, case.v, case.batch.slots, kv_scale)
    a = index_arrays(SCHEDULES[list(SCHEDULES)[seed % 4]](case.batch), case.batch)
    idx = [torch.from_numpy(a[f]).int() for f in ("q_pos", "item_q_start", "item_q_len",
           "item_out_start", "item_kv_indptr", "kv_chunk", "kv_lo", "kv_hi", "kv_pos")]
    rows = int(a["item_q_len"].sum())
    args = (case.q, case.k_cache, case.v_cache, *idx)
    o_ref, lse_ref = reference.attend_items(*args, case.shape.scale, rows, None, kv_scale)
    o, lse = tops.attend_items(*to_dev(*args), case.shape.scale, rows, None, kv_scale.to(DEVICE), sms=3)
    vmax = reference.dequantize(case.v_cache.view(-1, *case.v_cache.shape[2:]).float().nan_to_num(0),
                                kv_scale[reference.V_SCALE]).abs().max()
    assert (o.cpu() - o_ref).abs().max() <= o_tol(dtype) * vmax
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse.cpu()))
    assert ((lse.cpu() - lse_ref)[fin].abs() <= 2e-4 * (1 + lse_ref[fin].abs())).all()


def run_backend(cls, case, kv_scale, kernels, padded=0):
    """o [T, Hq, D] and the caches after one step of `case` through `cls` on `kernels`."""
    batch, q, k, v = case.batch, case.q, case.k, case.v
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    if padded:
        pad_slot = k_cache.shape[0] * k_cache.shape[1]
        k_cache, v_cache = (torch.cat([c, torch.zeros_like(c[:1])]) for c in (k_cache, v_cache))
        batch = dataclasses.replace(batch, padded=PaddedRows(batch.num_tokens + padded, pad_slot))
        q, k, v = (torch.cat([x, torch.randn(padded, *x.shape[1:]).to(x.dtype)]) for x in (q, k, v))
    backend = cls(case.shape, kernels=kernels)
    backend.plan(batch)
    k_cache, v_cache = to_dev(k_cache, v_cache)
    o = backend.run(*to_dev(q, k, v), k_cache, v_cache, kv_scale=kv_scale.to(k_cache.device))
    return o.cpu()[:case.batch.num_tokens], k_cache.cpu(), v_cache.cpu(), backend


DECODE = [(104, torch.bfloat16, 128, 4, 64, False), (108, torch.float16, 64, 20, 16, False),
          (101, torch.float16, 128, 8, 64, False), (105, torch.float16, 128, 1, 64, False)]
# graph (padded) steps are decode steps
BACKEND_CASES = [(*c, 0) for c in DECODE] + [(*c, 3) for c in DECODE] + [(102, torch.bfloat16, 64, 1, 16, True, 0)]


@pytest.mark.parametrize("seed,dtype,head_dim,group,chunk,prefill,padded", BACKEND_CASES)
def test_backends_over_fp8_match_the_reference_executor(seed, dtype, head_dim, group, chunk, prefill, padded):
    """The decode units that store their row's new key quantize it as the store launch does
    (same bytes in the cache) and attend with it so; every output within the 16-bit tolerance
    of the reference executor's over the same fp8 cache."""
    case, kv_scale = fp8_case(seed, dtype, head_dim, group, chunk, prefill)
    o_ref, k_ref, v_ref, _ = run_backend(BACKENDS["paged"], case, kv_scale, ops.ReferenceKernels(case.shape))
    vmax = reference.dequantize(v_ref.view(-1, *v_ref.shape[2:]).float().nan_to_num(0),
                                kv_scale[reference.V_SCALE]).abs().max()
    for name, cls in BACKENDS.items():
        o, k_cache, v_cache, backend = run_backend(cls, case, kv_scale, tops.TritonKernels(case.shape, sms=3), padded)
        assert backend.current.extra["stores"] == folds(case, prefill), name
        bound = U[dtype] * o_ref.double().abs() + o_tol(dtype) * vmax
        assert ((o.double() - o_ref.double()).abs() <= bound).all(), name
        n = k_ref.shape[0]  # the padded step's pad chunk aside
        assert same_bytes(k_cache[:n], k_ref) and same_bytes(v_cache[:n], v_ref), name


@pytest.mark.parametrize("seed,dtype,head_dim,group,chunk,prefill",
                         [(0, torch.bfloat16, 64, 3, 16, False), (1, torch.float16, 128, 8, 64, True)])
def test_cell_executor_over_fp8_matches_the_reference(seed, dtype, head_dim, group, chunk, prefill):
    case, kv_scale = fp8_case(seed, dtype, head_dim, group, chunk, prefill)
    case = dataclasses.replace(case, shape=dataclasses.replace(case.shape, cell=128))
    o_ref, k_ref, v_ref, _ = run_backend(BACKENDS["hydragen"], case, kv_scale, ops.ReferenceKernels(case.shape))
    o, k_cache, v_cache, _ = run_backend(BACKENDS["hydragen"], case, kv_scale, CellKernels(case.shape, sms=3))
    vmax = reference.dequantize(v_ref.view(-1, *v_ref.shape[2:]).float().nan_to_num(0),
                                kv_scale[reference.V_SCALE]).abs().max()
    bound = U[dtype] * o_ref.double().abs() + o_tol(dtype) * vmax
    assert ((o.double() - o_ref.double()).abs() <= bound).all()
    assert same_bytes(k_cache, k_ref) and same_bytes(v_cache, v_ref)
