"""The merge in the narrow units (worklist's `fused`): decode steps whose narrow units (each
row's tail, holding its new key) merge their rows with the wide launch's partials, instead of
a merge launch.

Runs in Triton's interpreter on CPU tensors (the launches one after the other), or compiled on
a GPU with PREFIXSERVE_TRITON_TEST_DEVICE=cuda, where the narrow launch starts beside the wide
one by programmatic dependent launch and waits for its partials. Tolerances as in
test_triton_ops.
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


def _decode_items(n: int, tail_chunks: int, padding: int = 0):
    """One shared item (n rows x 4 chunks) and n one-row tails of `tail_chunks` chunks of 16
    slots, each ending at its row's position; build_worklist's arguments, + `padding` rows
    that no item holds (a graph's)."""
    q_start, q_len = np.r_[0, np.arange(n)], np.r_[n, np.ones(n, int)]
    out_start = np.r_[0, n + np.arange(n)]
    entries = np.r_[4, np.full(n, tail_chunks)]
    kv_indptr = np.r_[0, np.cumsum(entries)]
    m = int(kv_indptr[-1])
    kv_pos = np.concatenate([np.arange(4) * 16] + [64 + np.arange(tail_chunks) * 16] * n)
    kv_lo, kv_hi = np.zeros(m, int), np.full(m, 16)
    kv_hi[kv_indptr[2:] - 1] = 5  # each tail's last chunk holds 5 keys, the last the new one
    q_pos = np.r_[np.full(n, 64 + (tail_chunks - 1) * 16 + 4), np.zeros(padding, int)]
    num_rows = n + padding
    part_row = np.r_[np.arange(n), np.arange(n)]  # partial rows -> final rows
    indptr = np.r_[0, np.cumsum(np.bincount(part_row, minlength=num_rows))]
    return (q_start, q_len, out_start, kv_indptr, num_rows, indptr, np.argsort(part_row, kind="stable"),
            (q_pos, kv_pos, kv_lo, kv_hi), np.random.default_rng(0).permutation(m))


def test_each_row_is_merged_by_its_tails_unit():
    n = 20  # > NARROW_ROWS: the shared item is wide
    configs = (KernelConfig(16, 16), KernelConfig(32, 16))

    def wl_of(cfgs=configs, sms=1, tail_chunks=2):
        *args, positions, chunks = _decode_items(n, tail_chunks, padding=3)
        return build_worklist(*args, cfgs, group=1, num_kv_heads=2, chunk_size=16, itemsize=2,
                              num_sms=sms, positions=positions, kv_chunk=chunks, force_merge=True)

    wl = wl_of()
    assert wl.stores and wl.fused is not None and wl.others is not None
    assert len(wl.narrow) == n + 3 and len(wl.fused) == n + 3
    indptr, parts = wl.merge_indptr, wl.merge_parts
    for u, (row, first, count) in zip(wl.narrow, wl.fused.tolist(), strict=True):
        if row >= n:  # a padding row: a unit with no keys, nothing to merge
            assert u[2] == u[3] and count == 0 and u[5] == -1
            continue
        assert u[0] == row and u[1] == 1  # the row's tail: its partial and the row's others
        want = [p for p in parts[indptr[row]:indptr[row + 1]].tolist() if p != u[4]]
        assert wl.others[first:first + count].tolist() == want and len(want) == 1
    # split tails (a row with two narrow partials), or units from a counter: the merge launch
    assert wl_of(sms=64, tail_chunks=8).fused is None and wl_of(sms=64, tail_chunks=8).stores
    dynamic = (KernelConfig(16, 16, dynamic=True), configs[1])
    assert wl_of(dynamic).fused is None and wl_of(dynamic).merge_indptr is not None


@pytest.mark.parametrize("kv_dtype", ["", "fp8"])
@pytest.mark.parametrize("backend", [RelayBackend, HydragenBackend])
def test_decode_steps_merge_in_the_narrow_units(backend, kv_dtype, monkeypatch):
    """24 sequences x G 2 under a 64-key prefix (48-row wide units), 36-key tails: the step's
    narrow units merge; the output is paged's (no merge) within the tolerance, the merge
    launch's within fp16 rounding (the same partials, merged in another order); the new keys
    are in the cache; run twice. Padded (a graph's step): the same rows, and the padding rows
    0."""
    row = build(Workload("test", 24, 4, 2, 64, 100, (64,), 16, "float16", kv_dtype=kv_dtype), DEVICE)
    fused, flat, x = step(row, backend, row.batch, row.q, row.k, row.v)
    assert x["fused"]
    paged, paged_flat, x = step(row, PagedBackend, row.batch, row.q, row.k, row.v)
    assert not x["fused"]
    with monkeypatch.context() as patch:
        patch.setattr(worklist, "_fused_merge", lambda *a: None)
        launch, _, x = step(row, backend, row.batch, row.q, row.k, row.v)
    assert not x["fused"]
    assert torch.equal(flat[row.batch.slots], paged_flat[row.batch.slots])  # the new keys, as stored
    assert (fused - paged).abs().max() <= (1e-5 + 2 * U16) * row.vmax
    assert (fused - launch).abs().max() <= 2 * U16 * launch.abs().max()
    assert padded_step(row, backend, fused)["fused"]
