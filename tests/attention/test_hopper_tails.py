"""The Gluon swapped walk (`ops.triton.hopper_tails`, sm_90 only) against its twin,
`ops.reference.attend_items`, and against the Triton kernel it replaces.

Gluon does not run in Triton's interpreter, so these tests run only on a Hopper GPU
(PREFIXSERVE_TRITON_TEST_DEVICE=cuda on the lent H100 / H200); CI runs the twin's and the
Triton kernel's tests, and the plan's choice of the walk (test_triton_ops).

The problems are narrow units of G 2-8 over 16-bit caches (q_len x G <= 16 rows), entries that
start and end inside chunks, NaN in every slot no entry covers; then whole decode steps, whose
units write their rows' new keys, eagerly and from a CUDA graph's padded plan.
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
from prefixserve.attention.ops.triton.launch import GLUON_TRITON, hopper_module  # noqa: E402

tails = hopper_module("hopper_tails")
if tails is None:
    pytest.skip(f"the Gluon kernels are tested on Triton {GLUON_TRITON} only", allow_module_level=True)
from test_hopper import U, check_partials, shared_items, with_padding  # noqa: E402  (skips with this module)

from prefixserve.attention.ops.triton.configs import KernelConfig, choose_configs  # noqa: E402

TRITON_NARROW = KernelConfig(16, 64, num_warps=2)
WIDE = KernelConfig(128, 64, num_stages=2, programs_per_sm=2)

CASES = [  # (dtype, Hkv, G, chunk, items: (query rows, first slot, keys, chunks skipped))
    (torch.float16, 4, 4, 64, [(1, 5, 1000, 0), (1, 0, 64 * 7, 2), (4, 60, 10, 1), (1, 63, 1, 0),
                               (2, 0, 200, 0), (1, 0, 64, 0)]),
    (torch.bfloat16, 2, 8, 128, [(1, 33, 4096, 0), (2, 0, 129, 3), (1, 127, 2, 0)]),
    (torch.float16, 3, 2, 64, [(1, 1, 333, 0), (8, 17, 64, 1), (1, 0, 2000, 0)]),
]


@pytest.mark.parametrize("dtype,hkv,g,chunk,items", CASES)
@pytest.mark.parametrize("sms", [None, 3], ids=["whole-items", "split-k"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["counter", "stride"])
def test_swapped_walk_matches_twin(dtype, hkv, g, chunk, items, sms, dynamic):
    seed = len(items) + g + chunk
    args, num_rows = shared_items(seed, dtype, hkv, g, 128, chunk, items)
    dev = [x.to(DEVICE) for x in args]
    walk = dataclasses.replace(choose_configs(4096, 128, dtype.itemsize, gluon=True, tails=True)[0], dynamic=dynamic)
    assert walk.tails and tails.applies(dev[0], dev[1], walk.block_n, False, None)
    o_ref, lse_ref = reference.attend_items(*args, 1.0 / 128**0.5, num_rows)
    vmax = args[2].float().nan_to_num(0).abs().max()
    results = []
    for narrow in (walk, TRITON_NARROW):  # the walk, then the Triton kernel it replaces
        o, lse = (x.cpu() for x in tops.attend_items(*dev, 1.0 / 128**0.5, num_rows, sms=sms,
                                                     configs=(narrow, WIDE)))
        check_partials(o, lse, o_ref, lse_ref, (1e-5 + 2 * U[dtype]) * vmax)
        results.append(o)
    # both round P to 16 bits for the tensor cores (other summation orders)
    assert (results[0] - results[1]).abs().max() <= 2 * U[dtype] * vmax


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,kv_heads,own", [(96, 8, 188), (64, 4, 700)], ids=["g4-short-tails", "g8-long-tails"])
def test_decode_step_with_the_swapped_walk(dtype, batch, kv_heads, own, monkeypatch):
    """A decode step of G 4 / 8 under 512 shared keys (128-row wide units): hydragen and relay
    run the narrow units in the swapped walk beside the Gluon wide launch on every SM (no chunk
    pairs: no room beside them), which writes the new keys. The same output as with the walk
    off (the Triton narrow kernel, within its 16-bit P), the same cache bytes, and a second run
    gives the same output (the walk's item counter is back at 0)."""
    from prefixserve.attention.backends.hydragen import HydragenBackend
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.attention.ops.triton import kernels as tk
    from prefixserve.bench.kernels.rows import Workload, build

    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    row = build(Workload("test", batch, 32, kv_heads, 128, 512 + own, (512,), 64, name), DEVICE)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    gluon_tails = tk._gluon_tails
    for cls in (HydragenBackend, RelayBackend):
        outs, caches = [], []
        for on in (True, False):
            monkeypatch.setattr(tk, "_gluon_tails", gluon_tails if on else lambda shape: False)
            be = cls(row.shape, kernels=tops.TritonKernels(row.shape))
            be.plan(row.batch)
            x = be.current.extra
            assert x["stores"] and x["narrow_programs"] > 0 and x["narrow_tails"] == on, cls.name
            if on:
                assert not x["wide_pairs"] and int(x["unit_counts"][3]) == min(sms, int(x["unit_counts"][2]) * kv_heads)
            k_cache, v_cache = row.k_cache.clone(), row.v_cache.clone()
            o = be.run(row.q, row.k, row.v, k_cache, v_cache).float()
            again = be.run(row.q, row.k, row.v, row.k_cache.clone(), row.v_cache.clone())
            assert torch.equal(again.float(), o) and not o.isnan().any(), cls.name
            assert not be.kernels.queues.any(), cls.name  # the counters back at 0
            outs.append(o)
            caches.append((k_cache, v_cache))
        assert (outs[0] - outs[1]).abs().max() <= 4 * U[dtype] * row.vmax, cls.name
        for a, b in zip(*caches, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), cls.name


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_swapped_walk_in_a_padded_plan(graph):
    """A graph's plan (5 padding rows) of a G 4 step whose tails run in the swapped walk: run
    eagerly and replayed from a CUDA graph (twice, over a cache restored), its rows equal the
    unpadded plan's within the merge's rounding, the padding rows are zero, and the cache
    bytes are the same (but the padding rows' slot)."""
    from prefixserve.attention.backends.relay import RelayBackend
    from prefixserve.bench.kernels.rows import Workload, build

    row = build(Workload("test", 64, 32, 8, 128, 1024, (768,), 64, "float16"), DEVICE)
    t = row.batch.num_tokens
    outs, caches = [], []
    for pad in (0, 5):
        batch, q, k, v, k_cache, v_cache = with_padding(row, pad)
        be = RelayBackend(row.shape, kernels=tops.TritonKernels(row.shape))
        be.plan(batch)
        assert be.current.extra["narrow_tails"]
        kc, vc = k_cache.clone(), v_cache.clone()
        run = functools.partial(be.run, q, k, v, kc, vc)
        if graph and pad:
            run()  # compiled and planned before the capture
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
    assert (outs[0] - outs[1][:t]).abs().max() <= 4 * U[torch.float16] * row.vmax
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a[:-1].view(torch.uint8), b[:-1].view(torch.uint8))
