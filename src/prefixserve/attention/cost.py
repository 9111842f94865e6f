"""Cost of a step under each schedule: bytes moved and FLOPs, and a time model to pick one.

Bytes (what the ideal kernel for the schedule moves through DRAM; e = bytes per element of
the model dtype, e_kv of the cache's (1 for fp8), Hq*D the query width, Hkv*D the key width):
    kv_bytes  each item reads its keys and values once for all its query rows:
              sum over items of keys * 2 * Hkv * D * e_kv (shared KV once per batch under relay /
              hydragen / chunk, once per sequence under paged)
    io_bytes  each item reads its query rows (q_len * Hq * D * e); then either
              - no merge: the output is written once (T * Hq * D * e), or
              - merge: each item writes fp32 partials o and lse (q_len * Hq * (D + 1) * 4),
                the merge reads them back and writes the output (T * Hq * D * e).
    Writing the step's new K/V is the same for every schedule and is not counted.
FLOPs: 4 * D * Hq * keys per query row of each item (QK^T and PV, 2 flops per multiply-add),
over the full item rectangle that a batched product computes, masked keys included.

For RelayAttention's single shared prefix (system prompt s, context c, batch b, d = Hq * D,
Hkv = Hq, fp32) this is the paper's Eq. 8 (paged) and Eq. 9 (relay), except that the paper
counts one d-wide vector per cached token where K and V are two, and omits the LSE scalars.

Time model (`CostModel.time`): max(bytes / bandwidth, flops / matrix_rate)
+ items * item_overhead_s + launches * launch_overhead_s, where launches = 1 attention launch
+ 1 merge launch if the schedule merges. The defaults are starting points, to be calibrated
against measurements (bench/kernels/); `for_device` picks them by device type.

Sliding-window layers plan the batch cut to their window (`window.windowed`): their costs,
and `auto`'s choice for them, count only the keys some query of the step can see (at most
about the window per sequence), not the whole shared prefix.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import AttentionBatch, AttentionShape
from .schedule import SCHEDULES, Schedule

_LSE_BYTES = 4  # partials are fp32
_PARTIAL_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Cost:
    kv_bytes: int  # K and V read
    io_bytes: int  # queries read, partials written and read back, outputs written
    flops: int
    items: int  # work items (kernel programs' units of work)
    launches: int

    @property
    def bytes(self) -> int:
        return self.kv_bytes + self.io_bytes


@dataclasses.dataclass(frozen=True)
class CostModel:
    bandwidth: float  # DRAM bytes per second
    matrix_rate: float  # FLOPs per second of the attention products
    item_overhead_s: float  # fixed cost of one work item (start-up, index loads)
    launch_overhead_s: float  # fixed cost of one kernel launch / op call

    def time(self, cost: Cost) -> float:
        roofline = max(cost.bytes / self.bandwidth, cost.flops / self.matrix_rate)
        return roofline + cost.items * self.item_overhead_s + cost.launches * self.launch_overhead_s

    @staticmethod
    def for_device(device: torch.device) -> CostModel:
        return GPU_COST_MODEL if torch.device(device).type == "cuda" else CPU_COST_MODEL


# Fitted to `prefixserve bench kernels` on an H200 (run 9 in benchmarks/kernels-notes.md, the
# Triton kernels; the Gluon wide launch, later, runs shared products ~13% faster and left auto's
# pick the measured best on every Hydragen-grid row; least squares on log time over 96 backend x
# row timings, the launch cost held at the ~3 us an extra kernel adds to a CUDA graph): decode
# tails stream K/V at ~4.4 TB/s (a read-mostly stream beats the 4.2 TB/s copy), shared items'
# products run at ~350 TFLOP/s, an item costs ~0.3 us (its units' start-up, partials and merge
# inputs). With these, auto's pick is the measured best on all 24 rows (relay == hydragen on one-
# level trees).
GPU_COST_MODEL = CostModel(bandwidth=4.4e12, matrix_rate=3.5e14,
                           item_overhead_s=3.0e-7, launch_overhead_s=3.0e-6)
# The PyTorch reference ops, one thread of a shared 2-core VM (measured: paged decode runs at
# ~0.5-0.7 GB/s of K/V and ~180 us per item; prefill products at 11-15 GFLOP/s).
CPU_COST_MODEL = CostModel(bandwidth=1.0e9, matrix_rate=1.5e10,
                           item_overhead_s=1.5e-4, launch_overhead_s=5.0e-5)


def schedule_cost(sched: Schedule, shape: AttentionShape) -> Cost:
    e = shape.dtype.itemsize
    d, hq, hkv = shape.head_dim, shape.num_heads, shape.num_kv_heads
    item_rows = sum(it.q_len for it in sched.items)
    keys = sum(it.num_keys for it in sched.items)
    out = sched.num_rows * hq * d * e
    io = item_rows * hq * d * e + out
    if sched.needs_merge:
        io += 2 * item_rows * hq * (d * _PARTIAL_BYTES + _LSE_BYTES)
    return Cost(kv_bytes=keys * 2 * hkv * d * shape.kv_itemsize, io_bytes=io,
                flops=sum(4 * d * hq * it.q_len * it.num_keys for it in sched.items),
                items=len(sched.items), launches=1 + sched.needs_merge)


def no_attention_cost(batch: AttentionBatch, shape: AttentionShape) -> Cost:
    """The ceiling mode: only zeros written for the output."""
    out = batch.num_tokens * shape.num_heads * shape.head_dim * shape.dtype.itemsize
    return Cost(kv_bytes=0, io_bytes=out, flops=0, items=0, launches=1)


def cost_report(batch: AttentionBatch, shape: AttentionShape) -> dict[str, Cost]:
    """Cost of `batch` under every exact schedule, plus the `no-attention` ceiling."""
    report = {name: schedule_cost(fn(batch), shape) for name, fn in SCHEDULES.items()}
    report["no-attention"] = no_attention_cost(batch, shape)
    return report
