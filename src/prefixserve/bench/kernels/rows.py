"""Rows of `prefixserve bench kernels`: the workloads, the tree and batch built for one, its limit.

A row is a batch of decoding sequences over a prefix tree: `shared = (2048, 512)` puts a
2048-token prefix under all of them, then `groups` 512-token prefixes, one per group of
sequences below it; each sequence then holds its own `context - sum(shared)` prompt tokens
and its decoded token (the query). The tree and the `AttentionBatch` are built directly (no
model); chunk ids are shuffled, as in a used pool. Every node starts a new chunk (offset 0).
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

    @property
    def label(self) -> str:
        sh = "+".join(map(str, self.shared)) or "0"
        return f"b{self.batch} ctx{self.context} sh{sh}"

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
    return Row(w, shape, batch, rnd(b, w.heads, w.head_dim), rnd(b, w.kv_heads, w.head_dim),
               rnd(b, w.kv_heads, w.head_dim), rnd(*cache), rnd(*cache),
               [[seg.slots(c) for seg in lv] for lv in levels], private_slots)


def limit(w: Workload, bandwidth: float, rate: float) -> dict:
    """The fewest bytes (shared K/V once + private K/V + q + o) over the copy bandwidth, and the
    FLOPs (4 D Hq per key per query) over the matrix rate; the larger is the limit."""
    e = DTYPES[w.dtype].itemsize
    kv_token = 2 * w.kv_heads * w.head_dim * e
    keys = sum(w.nodes(lvl) * s for lvl, s in enumerate(w.shared)) + w.batch * w.private
    nbytes = keys * kv_token + 2 * w.batch * w.heads * w.head_dim * e
    flops = 4 * w.head_dim * w.heads * w.batch * (w.context + 1)
    t_bytes, t_flops = nbytes / bandwidth, flops / rate
    return {"bytes": nbytes, "flops": flops, "limit_us": 1e6 * max(t_bytes, t_flops),
            "bound": "bytes" if t_bytes >= t_flops else "flops"}
