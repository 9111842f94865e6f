"""Decode steps of a `bench.kernels.rows` row through a backend's Triton kernels: the shared
harness of the tests of a step's launch forms (test_triton_merge, test_own_keys).

Import after the test module has set TRITON_INTERPRET (a CPU run): this imports triton.
"""

from __future__ import annotations

import dataclasses

import torch

from prefixserve.attention.base import PaddedRows
from prefixserve.attention.ops import triton as tops
from prefixserve.bench.kernels.rows import Row

PAD_ROWS = 5  # a padded step's rows past the batch's (a CUDA graph's)


def step(row: Row, backend: type, batch, q: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """`backend` (on the Triton kernels of 3 SMs) planned for `batch`, then run twice on a copy
    of row's cache plus one chunk (the padding rows' slot); the two outputs must be equal.
    Returns (the output fp32, the copy's K cache [slots, Hkv, D], the plan's extras)."""
    be = backend(row.shape, kernels=tops.TritonKernels(row.shape, sms=3))
    be.plan(batch)
    pad = torch.zeros_like(row.k_cache[:1])
    k_cache, v_cache = (torch.cat([c, pad]) for c in (row.k_cache, row.v_cache))
    outs = [be.run(q, k, v, k_cache, v_cache, kv_scale=row.kv_scale).float() for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    return outs[0], k_cache.view(-1, *k_cache.shape[2:]), be.current.extra


def padded_step(row: Row, backend: type, out: torch.Tensor) -> dict:
    """The row's step padded with PAD_ROWS random rows (a graph's step): its first rows are
    `out` (the unpadded step's) and the padding rows 0. Returns the padded plan's extras."""
    t = row.batch.num_tokens
    pad_slot = row.k_cache.shape[0] * row.k_cache.shape[1]
    padded = dataclasses.replace(row.batch, padded=PaddedRows(t + PAD_ROWS, pad_slot))
    q, k, v = (torch.cat([x, torch.randn(PAD_ROWS, *x.shape[1:], device=x.device).to(x.dtype)])
               for x in (row.q, row.k, row.v))
    padded_out, _, x = step(row, backend, padded, q, k, v)
    assert torch.equal(padded_out[:t], out) and not padded_out[t:].any()
    return x
