"""Rows of `prefixserve bench kernels`: the workloads, the tree and batch built for one, its limit.

A row is a batch of decoding sequences over a prefix tree: `shared = (2048, 512)` puts a
2048-token prefix under all of them, then `groups` 512-token prefixes, one per group of
sequences below it; each sequence then holds its own `context - sum(shared)` prompt tokens
and its decoded token (the query). The tree and the `AttentionBatch` are built directly (no
model); chunk ids are shuffled, as in a used pool. Every node starts a new chunk (offset 0).

An fp8 row (`kv_dtype="fp8"`) holds the same random K/V quantized to e4m3 under one power-of-
two scale for every head (`kvcache.scales` from the cache's |max|): the engine's scales are
per head, but FlashInfer's fp8 decode takes one scale per tensor, and a shared one lets its
output be checked against ours.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # at run time the attention package is imported by build() only
    from ...attention.base import AttentionBatch, AttentionShape

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Workload:
    grid: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int  # prompt tokens per sequence (shared levels + its own); +1 decoded token
    shared: tuple[int, ...]
    chunk_size: int
    dtype: str
    groups: int = 4  # fan-out of every shared level below the first
    kv_dtype: str = ""  # "": the cache holds `dtype`; "fp8": e4m3 with scales

    @property
    def label(self) -> str:
        sh = "+".join(map(str, self.shared)) or "0"
        return f"b{self.batch} ctx{self.context} sh{sh}" + (f" {self.kv_dtype}" if self.kv_dtype else "")

    @property
    def kv_itemsize(self) -> int:
        return 1 if self.kv_dtype == "fp8" else DTYPES[self.dtype].itemsize

    @property
    def private(self) -> int:  # own keys of a sequence, its decoded token included
        return self.context - sum(self.shared) + 1

    def nodes(self, level: int) -> int:
        return min(self.batch, self.groups ** level)


def table3(dtype: str) -> list[Workload]:
    """ChunkAttention's Table 3: b 32, 32 heads, d 128, chunk 64; n_p x n_s."""
    return [Workload("table3", 32, 32, 32, 128, n, (s,) if s else (), 64, dtype)
            for n in (1024, 2048, 4096) for s in (0, n // 2, 3 * n // 4, n)]


def hydragen_grid(dtype: str) -> list[Workload]:
    """Hydragen scale: b 256/1024, shared 2K/8K/16K, private 128/512, 32 query / 8 KV heads."""
    return [Workload("hydragen", b, 32, 8, 128, s + p, (s,), 64, dtype)
            for b in (256, 1024) for s in (2048, 8192, 16384) for p in (128, 512)]


@dataclasses.dataclass
class Row:
    w: Workload
    shape: AttentionShape
    batch: AttentionBatch  # depth-first order, every path = shared levels + private tail
    q: torch.Tensor  # [b, Hq, D]
    k: torch.Tensor  # [b, Hkv, D]: the decoded token's key, written by the backends' run()
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_chunks, C, Hkv, D]
    v_cache: torch.Tensor
    level_slots: list[list[torch.Tensor]]  # [level][node]: flat slots of that node's keys
    private_slots: torch.Tensor  # [b, private] flat slots
    vmax: float  # max |v| of the cache (before an fp8 row's quantization): outputs' error scale
    kv_scale: torch.Tensor | None = None  # [4, Hkv] fp32 (an fp8 row), every head's the same


def build(w: Workload, device: torch.device, seed: int = 0) -> Row:
    from ...attention.base import AttentionBatch, AttentionShape, Segment, SeqQueries
    b, c, dtype = w.batch, w.chunk_size, DTYPES[w.dtype]
    for lvl in range(len(w.shared)):
        assert b % w.nodes(lvl) == 0, "sequences must split evenly into groups"
    need = [w.nodes(lvl) * -(-s // c) for lvl, s in enumerate(w.shared)] + [b * -(-w.private // c)]
    gen = torch.Generator().manual_seed(seed)
    chunk_ids = iter(torch.randperm(sum(need), generator=gen).tolist())
    node_id, pos = 0, 0
    levels: list[list[Segment]] = []
    for lvl, s in enumerate(w.shared):
        levels.append([Segment(node_id + j, pos, s, tuple(next(chunk_ids) for _ in range(-(-s // c))), 0)
                       for j in range(w.nodes(lvl))])
        node_id, pos = node_id + w.nodes(lvl), pos + s
    seqs, own = [], []
    for i in range(b):
        mine = Segment(node_id + i, pos, w.private, tuple(next(chunk_ids) for _ in range(need[-1] // b)), 0)
        path = tuple(lv[i * len(lv) // b] for lv in levels) + (mine,)
        seqs.append(SeqQueries(i, 1, pos + w.private - 1, path))
        own.append(mine.slots(c))
    private_slots = torch.stack(own)
    shape = AttentionShape(w.heads, w.kv_heads, w.head_dim, 1 / math.sqrt(w.head_dim), dtype, device)
    batch = AttentionBatch(tuple(seqs), c, private_slots[:, -1].clone())
    tg = torch.Generator(device).manual_seed(seed)
    cache = (sum(need), c, w.kv_heads, w.head_dim)
    rnd = lambda *s: torch.randn(*s, generator=tg, device=device, dtype=dtype)  # noqa: E731
    q, k, v, k_cache, v_cache = (rnd(b, w.heads, w.head_dim), rnd(b, w.kv_heads, w.head_dim),
                                 rnd(b, w.kv_heads, w.head_dim), rnd(*cache), rnd(*cache))
    kv_scale, vmax = None, float(v_cache.abs().max())
    if w.kv_dtype == "fp8":
        k_cache, v_cache, kv_scale = _quantized(k_cache, v_cache)
        shape = dataclasses.replace(shape, kv_dtype=k_cache.dtype)
    return Row(w, shape, batch, q, k, v, k_cache, v_cache,
               [[seg.slots(c) for seg in lv] for lv in levels], private_slots, vmax, kv_scale)


def _quantized(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The caches in e4m3 and their kv_scale [4, Hkv]: one scale per tensor, for every head."""
    from ...attention.ops.reference import K_INV, V_INV, quantize
    from ...kvcache.scales import scales_from_amax
    hkv = k_cache.shape[2]
    amax = torch.stack([x.abs().amax().float().expand(hkv) for x in (k_cache, v_cache)])  # [2, Hkv]
    kv_scale = scales_from_amax(amax[None])[0]
    flat = lambda x: x.view(-1, *x.shape[2:])  # noqa: E731
    k8 = quantize(flat(k_cache), kv_scale[K_INV]).view(k_cache.shape)
    v8 = quantize(flat(v_cache), kv_scale[V_INV]).view(v_cache.shape)
    return k8, v8, kv_scale


def limit(w: Workload, bandwidth: float, rate: float) -> dict:
    """The fewest bytes (shared K/V once + private K/V, in the cache's type, + q + o) over the
    copy bandwidth, and the FLOPs (4 D Hq per key per query) over the matrix rate; the larger is the limit."""
    e = DTYPES[w.dtype].itemsize
    kv_token = 2 * w.kv_heads * w.head_dim * w.kv_itemsize
    keys = sum(w.nodes(lvl) * s for lvl, s in enumerate(w.shared)) + w.batch * w.private
    nbytes = keys * kv_token + 2 * w.batch * w.heads * w.head_dim * e
    flops = 4 * w.head_dim * w.heads * w.batch * (w.context + 1)
    t_bytes, t_flops = nbytes / bandwidth, flops / rate
    return {"bytes": nbytes, "flops": flops, "limit_us": 1e6 * max(t_bytes, t_flops),
            "bound": "bytes" if t_bytes >= t_flops else "flops"}
