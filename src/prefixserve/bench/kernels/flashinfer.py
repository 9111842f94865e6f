"""FlashInfer 0.2.14 as peers of `prefixserve bench kernels`, over the very same chunk pool.

Our per-layer cache `[num_chunks, C, Hkv, D]` is FlashInfer's "NHD" paged layout with
page_size = C, so FlashInfer reads the same tensors our backends read (no copy): a request's
page table is the chunk ids along its path, and a shared chunk is physically shared.

    flashinfer-decode    BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=...):
                         one request per sequence, pages = its whole path (shared levels, then
                         its own chunks). Both kernels FlashInfer offers are measured (CUDA
                         cores, and tensor cores -- the prefill kernel, which FlashInfer advises
                         for GQA groups of 4 and more); the faster correct one is the peer.
    flashinfer-cascade   MultiLevelCascadeAttentionWrapper(levels, ws, "NHD"): one level per tree
                         depth -- each shared level (its nodes are requests whose queries are the
                         sequences below them) and the private level (one request per sequence).

plan() builds FlashInfer's metadata (and JIT-compiles its kernels on first use: minutes) and
is not timed; run(q, (k_cache, v_cache)) is what is timed, like our backends' run(). FlashInfer's
page table needs every page of a request full except its last: a decode path whose shared
level ends inside a chunk cannot be expressed (the entry says so); each cascade level can.
FlashInfer is optional: imported here only, and set up by benchmarks/flashinfer-setup.sh.

fp8 rows: the pages are e4m3 (`kv_data_type`), and run() takes the row's one K and one V
scale (`k_scale`, `v_scale`; rows.py gives every head the same); the cascade wrapper takes
none, so its output there is checked like any other and not counted if wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .rows import Row
from .timing import measure_call

if TYPE_CHECKING:
    from ...attention.base import AttentionBatch, Segment

WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-K partials); 128 MB advised
NAMES = ("flashinfer-decode", "flashinfer-cascade")


def nodes_by_depth(batch: AttentionBatch) -> list[list[tuple[int, int, Segment]]]:
    """[depth][node]: (first sequence, end sequence, Segment) of each tree node at that depth,
    in batch order. The batch is depth-first, so a node's sequences are contiguous:

        depth 0   [0 ............................ b)     the prefix shared by all
        depth 1   [0 ...... b/4) [b/4 ... b/2) ...       one per group
        depth 2   [0,1) [1,2) ...                        each sequence's own tail
    """
    depth = len(batch.seqs[0].segments)
    assert all(len(s.segments) == depth for s in batch.seqs), "every path of a row has one depth"
    levels = []
    for d in range(depth):
        nodes: list[tuple[int, int, Segment]] = []
        for i, s in enumerate(batch.seqs):
            seg = s.segments[d]
            if nodes and nodes[-1][2].node_id == seg.node_id:
                nodes[-1] = (nodes[-1][0], i + 1, seg)
            else:
                nodes.append((i, i + 1, seg))
        levels.append(nodes)
    return levels


def page_table(paths: Sequence[Sequence[Segment]], chunk_size: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV arrays (int32) for requests whose keys are the concatenated
    segments of each path: indptr [n + 1], indices [pages], last_page_len [n] in 1..C."""
    indptr: list[int] = [0]
    indices: list[int] = []
    last: list[int] = []
    for path in paths:
        for j, seg in enumerate(path):
            pages = -(-seg.length // chunk_size)
            if seg.offset != 0 or pages == 0 or len(seg.chunks) < pages:
                raise ValueError(f"node {seg.node_id} does not start a chunk: not a page table")
            if j < len(path) - 1 and seg.length % chunk_size:
                raise ValueError(f"a {seg.length}-key node ends inside a {chunk_size}-key page before "
                                 "the end of its path: FlashInfer pages are full but the last")
            indices.extend(seg.chunks[:pages])
        indptr.append(len(indices))
        last.append(path[-1].length - (pages - 1) * chunk_size)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return as_i32(indptr), as_i32(indices), as_i32(last)


def decode_tables(batch: AttentionBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request per sequence, its pages the chunks of its whole path."""
    return page_table([s.segments for s in batch.seqs], batch.chunk_size, device)


def cascade_tables(batch: AttentionBatch, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per tree depth: (qo_indptr, indptr, indices, last_page_len); a node's queries are the
    rows of the sequences below it."""
    levels: list[tuple[torch.Tensor, ...]] = []
    for nodes in nodes_by_depth(batch):
        qo = torch.tensor([0] + [end for _, end, _ in nodes], dtype=torch.int32, device=device)
        levels.append((qo, *page_table([(seg,) for _, _, seg in nodes], batch.chunk_size, device)))
    return levels


def _plan_args(row: Row) -> dict[str, Any]:
    return {"sm_scale": row.shape.scale, "q_data_type": row.q.dtype, "kv_data_type": row.k_cache.dtype}


def decode_peer(fi, row: Row, ws: torch.Tensor, use_tensor_cores: bool):
    """BatchDecodeWithPagedKVCacheWrapper, planned; returns the run() to time."""
    w, c = row.w, row.batch.chunk_size
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=use_tensor_cores)
    wrapper.plan(*decode_tables(row.batch, row.q.device), w.heads, w.kv_heads, w.head_dim, c,
                 **_plan_args(row))
    kv, scales = (row.k_cache, row.v_cache), _fp8_scales(row)
    return lambda: wrapper.run(row.q, kv, **scales)


def _fp8_scales(row: Row) -> dict[str, float]:
    """run()'s k_scale and v_scale of an fp8 row (one per tensor), else none."""
    if row.kv_scale is None:
        return {}
    from ...attention.ops.reference import K_SCALE, V_SCALE
    k, v = row.kv_scale[K_SCALE], row.kv_scale[V_SCALE]
    assert (k == k[0]).all() and (v == v[0]).all(), "an fp8 row's heads share their scales"
    return {"k_scale": float(k[0]), "v_scale": float(v[0])}


def cascade_peer(fi, row: Row, ws: torch.Tensor):
    """MultiLevelCascadeAttentionWrapper, one level per tree depth, planned; returns run()."""
    w, c = row.w, row.batch.chunk_size
    levels = cascade_tables(row.batch, row.q.device)
    wrapper = fi.MultiLevelCascadeAttentionWrapper(len(levels), ws, "NHD")
    qo, indptr, indices, last = (list(x) for x in zip(*levels, strict=True))
    wrapper.plan(qo, indptr, indices, last, w.heads, w.kv_heads, w.head_dim, c, **_plan_args(row))
    kv = (row.k_cache, row.v_cache)
    return lambda: wrapper.run(row.q, kv)


def _attempt(make: Callable[[], Callable[[], torch.Tensor]], device: torch.device, ref: torch.Tensor,
             vmax: float) -> dict[str, Any]:
    """Plan (make()) and measure one FlashInfer call; any failure -- a JIT build, an unsupported
    dtype, a page table FlashInfer cannot express -- is recorded, not raised."""
    try:
        return measure_call(make(), device, ref, vmax)
    except Exception as e:  # an optional library's failures are many: recorded
        return {"error": f"{type(e).__name__}: " + str(e).split("\n")[0][:200]}


def _fastest(variants: dict) -> dict:
    """The fastest counted variant (else the first that ran, else an error), naming all."""
    ran = {k: v for k, v in variants.items() if "us" in v}
    ok = {k: v for k, v in ran.items() if v["counted"]} or ran
    if not ok:
        return {"error": "no variant ran", "variants": variants}
    best = min(ok, key=lambda k: ok[k]["us"])
    return {**ok[best], "variant": best, "variants": variants}


def flashinfer_peers(row: Row, device: torch.device, ref: torch.Tensor) -> dict:
    """flashinfer-decode and flashinfer-cascade entries (each an error where it cannot run)."""
    if device.type != "cuda":
        return {n: {"error": f"FlashInfer runs on CUDA only (device {device.type})"} for n in NAMES}
    try:
        import flashinfer as fi
    except Exception as e:  # ImportError, or a failure inside its imports
        why = f"import flashinfer failed ({type(e).__name__}: {str(e)[:160]}); see benchmarks/flashinfer-setup.sh"
        return {n: {"error": why} for n in NAMES}
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    attempt = lambda make: _attempt(make, device, ref, row.vmax)  # noqa: E731
    decode = _fastest({"cuda-cores": attempt(lambda: decode_peer(fi, row, ws, False)),
                       "tensor-cores": attempt(lambda: decode_peer(fi, row, ws, True))})
    cascade = attempt(lambda: cascade_peer(fi, row, ws))
    return {"flashinfer-decode": {**decode, "version": fi.__version__},
            "flashinfer-cascade": {**cascade, "version": fi.__version__}}
