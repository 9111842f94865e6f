"""Decode steps whose new keys sit alone in their chunks under shared keys (a step after a
shared prompt; Table 3's all-shared rows): the wide units take the rows' new keys
(worklist's `_absorb_keys`), and the step has no narrow launch.

Runs in Triton's interpreter on CPU tensors, or compiled on a GPU with
PREFIXSERVE_TRITON_TEST_DEVICE=cuda (on Hopper the Gluon wide kernel takes the keys:
`hopper_products._own_keys`, and the merge launch starts beside the wide one by PDL). Tolerances as in
test_triton_merge.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

DEVICE = torch.device(os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton
pytest.importorskip("triton")

from decode_steps import padded_step, step  # noqa: E402

from prefixserve.attention.backends.hydragen import HydragenBackend  # noqa: E402
from prefixserve.attention.backends.paged import PagedBackend  # noqa: E402
from prefixserve.attention.backends.relay import RelayBackend  # noqa: E402
from prefixserve.attention.ops.triton import worklist  # noqa: E402
from prefixserve.attention.ops.triton.configs import KernelConfig  # noqa: E402
from prefixserve.attention.ops.triton.worklist import build_worklist  # noqa: E402
from prefixserve.bench.kernels.rows import Workload, build  # noqa: E402

U16 = 2.0**-11  # fp16 unit roundoff


def _items(n: int, tail_keys: int, under: int | None = None):
    """One shared item (rows [0, under), default all n, x 4 chunks of 16 slots) and n one-row
    tails of one chunk holding `tail_keys` keys, the last at the row's own position;
    build_worklist's arguments (relay's numbering: partial rows, then a merge per row)."""
    under = n if under is None else under
    q_start, q_len = np.r_[0, np.arange(n)], np.r_[under, np.ones(n, int)]
    out_start = np.r_[0, under + np.arange(n)]
    kv_indptr = np.r_[0, 4, 4 + np.arange(1, n + 1)]
    kv_pos = np.r_[np.arange(4) * 16, np.full(n, 64)]
    kv_lo, kv_hi = np.zeros(4 + n, int), np.r_[np.full(4, 16), np.full(n, tail_keys)]
    q_pos = np.full(n, 64 + tail_keys - 1)
    part_row = np.r_[np.arange(under), np.arange(n)]
    indptr = np.r_[0, np.cumsum(np.bincount(part_row, minlength=n))]
    return (q_start, q_len, out_start, kv_indptr, n, indptr, np.argsort(part_row, kind="stable"),
            (q_pos, kv_pos, kv_lo, kv_hi), np.random.default_rng(0).permutation(4 + n))


def _worklist(*items, sms=1):
    *args, positions, chunks = items
    configs = (KernelConfig(16, 16), KernelConfig(32, 16))
    return build_worklist(*args, configs, group=1, num_kv_heads=2, chunk_size=16, itemsize=2,
                          num_sms=sms, positions=positions, kv_chunk=chunks)


@pytest.mark.parametrize("sms", [1, 8])
def test_wide_units_take_the_keys_that_sit_alone(sms):
    """40 rows (two 32-row blocks) under a shared item, each row's new key alone in a fresh
    chunk: no narrow unit; one split of each block stores (-2 - its first row), its
    shortest; every row's merge lists the shared item's splits only."""
    n = 40
    wl = _worklist(*_items(n, 1), sms=sms)
    assert wl.stores and len(wl.narrow) == 0 and wl.fused is None
    mine = wl.wide[wl.wide[:, 5] != -1]
    assert sorted(mine[:, 0].tolist()) == [0, 32] and (mine[:, 5] == -2 - mine[:, 0]).all()
    for u in mine:
        block = wl.wide[(wl.wide[:, 0] == u[0]) & (wl.wide[:, 1] == u[1])]
        assert u[3] - u[2] == (block[:, 3] - block[:, 2]).min()
        assert (sms == 8) == (len(block) > 1)  # 8 SMs: the shared item is split
        chain = block[np.argsort(block[:, 2])]  # the splits still cover its entries, once
        assert chain[0, 2] == 0 and chain[-1, 3] == 4 and (chain[1:, 2] == chain[:-1, 3]).all()
    counts = np.diff(wl.merge_indptr)
    splits = len(wl.wide) // 2
    assert (counts == splits).all() and wl.merge_parts.max() < wl.num_partials
    # a split of a chain of 16 entries takes the keys: it gives OWN_KEYS_ENTRIES to the others
    wide = np.array([[0, 32, 4 * j, 4 * j + 4, 32 * j, -1] for j in range(4)])
    worklist._shorten(wide, 2)
    assert (wide[:, 3] - wide[:, 2]).tolist() == [5, 5, 2, 4] and wide[2, 2] == 0
    assert sorted(wide[:, 4].tolist()) == [0, 32, 64, 96]
    lengths = wl.wide[:, 3] - wl.wide[:, 2]
    assert (lengths[:-1] >= lengths[1:]).all()  # still longest first
    # the merge reads only what the wide units write
    written = {int(u[4]) + r for u in wl.wide for r in range(u[1])}
    assert set(wl.merge_parts.tolist()) <= written


def test_keys_stay_with_the_narrow_units_otherwise():
    """A tail of two keys (the new one not alone), or a row under no wide item: the narrow
    units keep every key (and merge the rows)."""
    for items in (_items(40, 2), _items(40, 1, under=32)):
        wl = _worklist(*items)
        assert wl.stores and len(wl.narrow) == 40 and (wl.wide[:, 5] == -1).all()


@pytest.mark.parametrize("kv_dtype", ["", "fp8"])
@pytest.mark.parametrize("backend, shared", [(RelayBackend, (64,)), (HydragenBackend, (64,)),
                                             (HydragenBackend, (32, 32))])
def test_decode_steps_whose_wide_units_take_the_keys(backend, shared, kv_dtype):
    """48 sequences x G 2 under a 64-key prefix (one level, or two under Hydragen: the second
    level's 24-row items take the keys; Relay shares the first level only, so its rows' own
    items hold the second's), every new key alone in its chunk: no narrow launch; the output is
    paged's within the tolerance, the new keys are in the cache as a store launch writes
    them; run twice. Padded (a graph's step): the same rows, and the padding rows 0."""
    row = build(Workload("test", 48, 4, 2, 64, 64, shared, 16, "float16", groups=2, kv_dtype=kv_dtype),
                DEVICE)
    out, flat, extra = step(row, backend, row.batch, row.q, row.k, row.v)
    for x in (extra, padded_step(row, backend, out)):  # unpadded and padded (a graph's) step
        assert x["stores_wide"] and not x["stores_narrow"] and x["unit_counts"][0] == 0
    paged, paged_flat, _ = step(row, PagedBackend, row.batch, row.q, row.k, row.v)
    assert torch.equal(flat[row.batch.slots], paged_flat[row.batch.slots])
    assert (out - paged).abs().max() <= (1e-5 + 2 * U16) * row.vmax
