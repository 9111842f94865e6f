"""The Gluon row walk (`ops.triton.hopper_rows`, sm_90 only) against its twin,
`ops.reference.attend_items`, and against the Triton kernel it replaces.

Gluon does not run in Triton's interpreter, so these tests run only on a Hopper GPU
(PREFIXSERVE_TRITON_TEST_DEVICE=cuda on the lent H100 / H200); CI runs the twin's and the
Triton kernel's tests, and the plan's choice of the walk (test_triton_ops).

The problems are narrow units of G 1 (one query head a KV head) over fp8 and 16-bit caches:
one-row units and units of up to 16 rows (each row walks the unit's tiles), entries that start
and end inside chunks, NaN in every slot no entry covers; then whole decode steps, whose units
write their rows' new keys.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type != "cuda" or torch.cuda.get_device_capability(DEVICE)[0] != 9:
    pytest.skip("the Gluon kernels run on a Hopper GPU only (PREFIXSERVE_TRITON_TEST_DEVICE=cuda)",
                allow_module_level=True)

from prefixserve.attention.ops import reference  # noqa: E402
from prefixserve.attention.ops import triton as tops  # noqa: E402
from prefixserve.attention.ops.triton.attend import MERGE_CHUNK  # noqa: E402
from prefixserve.attention.ops.triton.launch import GLUON_TRITON, hopper_module  # noqa: E402

rows_walk = hopper_module("hopper_rows")
if rows_walk is None:
    pytest.skip(f"the Gluon kernels are tested on Triton {GLUON_TRITON} only", allow_module_level=True)
from test_hopper import U, check_partials, shared_items, to_fp8  # noqa: E402  (skips with this module: the same GPU)

from prefixserve.attention.ops.triton.configs import KernelConfig, choose_configs  # noqa: E402

TRITON_NARROW = KernelConfig(16, 64, num_warps=2)
WIDE = KernelConfig(128, 64, num_stages=2, programs_per_sm=2)


def narrow_items(seed: int, dtype: torch.dtype, hkv: int, d: int, chunk: int,
                 items: list[tuple[int, int, int, int]]):
    """`test_hopper.shared_items` at G 1 over an fp8 cache (per-head powers of two, as the
    engine's scales; NaN slots stay NaN): (attend_items' arguments, rows, kv_scale)."""
    args, num_rows = shared_items(seed, dtype, hkv, 1, d, chunk, items)
    args, kv_scale = to_fp8(seed, args, hkv, d)
    return args, num_rows, kv_scale


CASES = [  # (dtype, Hkv, D, chunk, items)
    (torch.float16, 4, 128, 64, [(1, 5, 1000, 0), (1, 0, 64 * 7, 2), (3, 60, 10, 1), (1, 63, 1, 0),
                                 (16, 0, 200, 0), (1, 0, 64, 0)]),
    (torch.bfloat16, 2, 128, 128, [(1, 33, 4096, 0), (5, 0, 129, 3), (1, 127, 2, 0)]),
    (torch.float16, 3, 64, 64, [(1, 1, 333, 0), (2, 17, 64, 1), (1, 0, 2000, 0)]),
]


@pytest.mark.parametrize("dtype,hkv,d,chunk,items", CASES)
@pytest.mark.parametrize("sms", [None, 3], ids=["whole-items", "split-k"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["counter", "stride"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "16-bit"])
def test_row_walk_matches_twin(dtype, hkv, d, chunk, items, sms, dynamic, fp8):
    seed = len(items) + d + chunk
    if fp8:
        args, num_rows, kv_scale = narrow_items(seed, dtype, hkv, d, chunk, items)
        values = args[2].float() * kv_scale[reference.V_SCALE][None, None, :, None]
    else:
        (args, num_rows), kv_scale = shared_items(seed, dtype, hkv, 1, d, chunk, items), None
        values = args[2].float()
    dev = [x.to(DEVICE) for x in args]
    ks = None if kv_scale is None else kv_scale.to(DEVICE)
    walk = dataclasses.replace(choose_configs(0, d, dtype.itemsize, fp8=True, walk=True)[0], dynamic=dynamic,
                               block_n=4096 // (d * args[1].element_size()))  # 4 KB K tiles
    assert walk.walk and rows_walk.applies(dev[0], dev[1], walk.block_n, False, None)
    o_ref, lse_ref = reference.attend_items(*args, 1.0 / d**0.5, num_rows, kv_scale=kv_scale)
    vmax = values.nan_to_num(0).abs().max()
    results = []
    for narrow in (walk, TRITON_NARROW):  # the walk, then the Triton kernel it replaces
        o, lse = (x.cpu() for x in tops.attend_items(*dev, 1.0 / d**0.5, num_rows, kv_scale=ks, sms=sms,
                                                     configs=(narrow, WIDE)))
        check_partials(o, lse, o_ref, lse_ref, (1e-5 + 2 * U[dtype]) * vmax)
        results.append(o)
    # fp32 math on the same cache values: the two differ by the Triton kernel's 16-bit P
    assert (results[0] - results[1]).abs().max() <= 2 * U[dtype] * vmax


@pytest.mark.parametrize("kv", ["fp8", ""], ids=["fp8", "16-bit"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,shared,own,mode", [
    (96, 8, 512, 188, "beside"), (20, 8, 512, 188, "after"), (32, 32, 512, 188, "after-merging"),
    (40, 4, 4096, 40, "after-merging"), (32, 32, 768, 256, "merging-beside"), (40, 4, 4096, 40, "merging-beside")],
    ids=["beside-128-row-products", "after-32-row-products", "after-merging", "after-merging-many-partials",
         "merging-beside-32-row-products", "merging-beside-on-4-sms"])
def test_decode_step_with_the_row_walk(dtype, batch, heads, shared, own, mode, kv, monkeypatch):
    """A decode step of G 1 (fp8 cache here; 16-bit below): paged (narrow units only) and relay (96
    sequences under a shared prefix: 128-row wide units, the walk beside them; 20-40: 32- and
    64-row wide units, which the walk follows on their stream -- or, where their items walk at
    least twice a tail's keys, runs beside on the other SMs; kept after here by raising that
    bar for the after-merging cases) run the narrow units in the row walk, which writes the
    new keys (quantized). Where each row's tail is one unit (20 x 8 heads splits the tails)
    the walk merges its rows with the wide units' partials: after them, more than MERGE_CHUNK
    of them a row under 4,096 shared keys over 4 heads; beside them, once they end (PDL).
    Over a 16-bit cache only relay's steps beside the products on SMs of their own take the
    walk (it writes the new keys as they are); the others keep the Triton narrow launch. The
    same output as with the walk off (within the Triton kernel's 16-bit P), the same cache
    bytes, and a second run gives the same output (the walk's item counter is back at 0)."""
    from prefixserve.attention.backends.paged import PagedBackend
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.attention.ops.triton import kernels as tk
    from prefixserve.bench.kernels.rows import Workload, build

    gluon_rows = tk._gluon_rows
    if mode == "after-merging":
        monkeypatch.setattr("prefixserve.attention.ops.triton.grids._BESIDE_KEYS", float("inf"))
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    context = shared + own
    row16 = build(Workload("test", batch, heads, heads, 128, context, (shared,), 64, name), DEVICE)
    be = PagedBackend(row16.shape, kernels=tops.TritonKernels(row16.shape))
    be.plan(row16.batch)
    assert not be.current.extra["narrow_walk"]
    row = build(Workload("test", batch, heads, heads, 128, context, (shared,), 64, name, kv_dtype=kv), DEVICE)
    vmax = row.vmax
    for cls in (PagedBackend, RelayBackend):
        outs, caches = [], []
        for walk_on in (True, False):
            monkeypatch.setattr(tk, "_gluon_rows", gluon_rows if walk_on else lambda shape: False)
            be = cls(row.shape, kernels=tops.TritonKernels(row.shape))
            be.plan(row.batch)
            x = be.current.extra
            walks = walk_on and (kv == "fp8" or cls is RelayBackend and mode == "merging-beside")
            relay_walk = walks and cls is RelayBackend
            assert x["stores"] and x["narrow_programs"] > 0 and x["narrow_walk"] == walks, cls.name
            assert x["narrow_after_wide"] == (relay_walk and mode.startswith("after")), cls.name
            assert x["narrow_merge_beside"] == (relay_walk and mode == "merging-beside"), cls.name
            if relay_walk and mode != "beside":
                assert x["fused"] == (mode != "after"), cls.name
                assert mode != "merging-beside" or int(x["unit_counts"][3]) == heads  # an SM a head
                assert shared < 4096 or mode != "after-merging" or int(x["merge_rows"][:, 2].min()) > MERGE_CHUNK
            k_cache, v_cache = row.k_cache.clone(), row.v_cache.clone()
            o = be.run(row.q, row.k, row.v, k_cache, v_cache, kv_scale=row.kv_scale).float()
            again = be.run(row.q, row.k, row.v, row.k_cache.clone(), row.v_cache.clone(), kv_scale=row.kv_scale)
            assert torch.equal(again.float(), o) and not o.isnan().any(), cls.name
            assert not be.kernels.queues.any(), cls.name  # the counters back at 0
            outs.append(o)
            caches.append((k_cache, v_cache))
        assert (outs[0] - outs[1]).abs().max() <= 4 * U[dtype] * vmax, cls.name
        for a, b in zip(*caches, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), cls.name


@pytest.mark.parametrize("kv", ["fp8", ""], ids=["fp8", "16-bit"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_walk_beside_the_products_in_a_padded_plan(graph, kv):
    """A graph's plan (5 padding rows) of a step whose walk runs beside the wide units (32
    sequences x 32 heads under 768 shared keys, 256 of their own, fp8 or 16-bit): the wide grid stays one
    CTA an SM, 32 of them take units, the padding rows' walk units wait for the wide launch and
    write zeros. Run eagerly and replayed from a CUDA graph (twice, the second over a cache
    restored), its rows equal the unpadded plan's bit for bit, and the same cache bytes (but
    the padding rows' slot)."""
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.attention.base import PaddedRows
    from prefixserve.bench.kernels.rows import Workload, build

    row = build(Workload("test", 32, 32, 32, 128, 1024, (768,), 64, "float16", kv_dtype=kv), DEVICE)
    t = row.batch.num_tokens
    k_cache, v_cache = (torch.cat([c, torch.zeros_like(c[:1])]) for c in (row.k_cache, row.v_cache))
    pad_slot = row.k_cache.shape[0] * row.k_cache.shape[1]
    padded = dataclasses.replace(row.batch, padded=PaddedRows(t + 5, pad_slot))
    q, k, v = (torch.cat([x, torch.randn(5, *x.shape[1:], device=DEVICE).to(x.dtype)]) for x in (row.q, row.k, row.v))
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    outs, caches = [], []
    for batch in (row.batch, padded):
        be = RelayBackend(row.shape, kernels=tops.TritonKernels(row.shape))
        be.plan(batch)
        x = be.current.extra
        assert x["narrow_merge_beside"] and x["fused"] and int(x["unit_counts"][3]) == 32
        assert x["wide_programs"] == (sms if batch is padded else 32)
        kc, vc = k_cache.clone(), v_cache.clone()
        n = batch.padded.rows if batch.padded else t
        run = functools.partial(be.run, q[:n], k[:n], v[:n], kc, vc, kv_scale=row.kv_scale)
        if graph and batch is padded:
            run()  # compiled and planned before the capture
            kc.copy_(k_cache)
            vc.copy_(v_cache)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static = run()
            for _ in range(2):
                kc.copy_(k_cache)
                vc.copy_(v_cache)
                g.replay()
            o = static.clone()
        else:
            o = run()
        outs.append(o.float())
        caches.append((kc, vc))
    assert not outs[1][t:].any() and not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1][:t])
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a[:-1].view(torch.uint8), b[:-1].view(torch.uint8))
