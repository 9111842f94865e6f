"""`prefixserve bench kernels`: one decode step's attention, every backend against its limit.

A row is a batch of decoding sequences over a prefix tree: `--shared 2048,512` puts a
2048-token prefix under all of them, then `--groups` 512-token prefixes, one per group of
sequences below it; each sequence then holds its own `context - sum(shared)` prompt tokens
and its decoded token (the query). The tree and the `AttentionBatch` are built directly (no
model); chunk ids are shuffled, as in a used pool.

    limit    max(bytes / copy bandwidth, FLOPs / matrix rate), both measured in this run
             (a device-to-device copy, bytes read + written; an 8192^3 matmul in --dtype on
             random data); bytes = shared K/V once + private K/V + q + o; FLOPs = 4 D Hq keys
             per query
    timing   each backend's run() (store_kv + attend + merge), captured in a CUDA graph and
             replayed under triton.testing.do_bench (median, L2 flushed before every replay);
             the eager time is kept in the JSON too
    peers    `sdpa`: torch SDPA (FlashAttention) over dense per-sequence K/V (rows whose dense
             K/V exceed a cap run on fewer sequences, scaled up linearly: marked `scaled`);
             `hydragen-pub`: Hydragen as published -- each shared level attended by the queries
             of all sequences below it (heads folded into rows) through an aten attention op
             that returns the LSE, the suffix per sequence, merged in PyTorch (the fastest of
             the flash / cuDNN / efficient ops that run); `flashinfer` when importable

Default grids: ChunkAttention's Table 3 (b 32, 32 heads, d 128, chunk 64; n_p 1024/2048/4096 x
n_s 0, n_p/2, 3n_p/4, n_p) and a Hydragen-scale grid (b 256/1024, shared 2K/8K/16K, private
128/512, 32 query / 8 KV heads). Writes benchmarks/results/kernels-<gpu>.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import time

import torch

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
BACKENDS = ("paged", "relay", "hydragen", "chunk", "auto")
DENSE_CAP_BYTES = 12 << 30  # dense per-sequence K+V of the sdpa peer


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
    return [Workload("table3", 32, 32, 32, 128, n, (s,) if s else (), 64, dtype)
            for n in (1024, 2048, 4096) for s in (0, n // 2, 3 * n // 4, n)]


def hydragen_grid(dtype: str) -> list[Workload]:
    return [Workload("hydragen", b, 32, 8, 128, s + p, (s,), 64, dtype)
            for b in (256, 1024) for s in (2048, 8192, 16384) for p in (128, 512)]


# ---------------------------------------------------------------- the tree and the batch

@dataclasses.dataclass
class Row:
    w: Workload
    shape: object  # AttentionShape
    batch: object  # AttentionBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    level_slots: list[list[torch.Tensor]]  # [level][node]: flat slots of that node's keys
    private_slots: torch.Tensor  # [b, private] flat slots


def build(w: Workload, device: torch.device, seed: int = 0) -> Row:
    from ..attention.base import AttentionBatch, AttentionShape, Segment, SeqQueries
    b, c, dtype = w.batch, w.chunk_size, _DTYPES[w.dtype]
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
    e = _DTYPES[w.dtype].itemsize
    kv_token = 2 * w.kv_heads * w.head_dim * e
    keys = sum(w.nodes(lvl) * s for lvl, s in enumerate(w.shared)) + w.batch * w.private
    nbytes = keys * kv_token + 2 * w.batch * w.heads * w.head_dim * e
    flops = 4 * w.head_dim * w.heads * w.batch * (w.context + 1)
    t_bytes, t_flops = nbytes / bandwidth, flops / rate
    return {"bytes": nbytes, "flops": flops, "limit_us": 1e6 * max(t_bytes, t_flops),
            "bound": "bytes" if t_bytes >= t_flops else "flops"}


# ---------------------------------------------------------------- timing

def timed(fn, device: torch.device, graph: bool = True) -> float:
    """Median seconds of fn(): CUDA-graph replays (or eager calls) under do_bench on CUDA;
    a wall clock on the CPU."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    import triton.testing
    fn()
    torch.cuda.synchronize()
    call = fn
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        call = g.replay
    ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
    return ms * 1e-3


def ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    """Copy bandwidth (bytes read + written) and matrix rate, measured here on random data."""
    n_copy, n_mm = (1 << 30, 8192) if device.type == "cuda" else (1 << 24, 1024)
    src = torch.randn(n_copy // 2, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), device, graph=False)
    a, b = (torch.randn(n_mm, n_mm, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty_like(a)
    t_mm = timed(lambda: torch.mm(a, b, out=c), device, graph=False)
    del src, dst, a, b, c
    return {"copy_bandwidth": 2 * n_copy / t_copy, "matrix_rate": 2 * n_mm ** 3 / t_mm,
            "copy_bytes": n_copy, "matmul_n": n_mm}


# ---------------------------------------------------------------- peers

def _lse_ops() -> dict:
    """aten attention ops that return (out [B,H,M,D], lse [B,H,M] fp32), by name."""
    aten = torch.ops.aten

    def flash(q, k, v, scale):
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]

    def cudnn(q, k, v, scale):
        o, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False,
                                                          scale=scale)[:2]
        return o, lse.reshape(q.shape[:3])

    def efficient(q, k, v, scale):
        o, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                              scale=scale)[:2]
        return o, lse[..., :q.shape[2]]
    def math_op(q, k, v, scale):  # CPU only: lets the peer's code run without a GPU
        s = torch.einsum("bhmd,bhld->bhml", q.float(), k.float()) * scale
        lse = torch.logsumexp(s, -1)
        return torch.einsum("bhml,bhld->bhmd", torch.exp(s - lse[..., None]), v.float()), lse
    ops = {"flash": flash, "cudnn": cudnn, "efficient": efficient}
    return ops if torch.cuda.is_available() else {"math": math_op}


def _dense(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Gather [..., L] slots of a [N, C, Hkv, D] cache into contiguous [..., Hkv, L, D]."""
    flat = cache.view(-1, *cache.shape[2:])[slots.reshape(-1).to(cache.device)]
    x = flat.view(*slots.shape, *cache.shape[2:])  # [..., L, Hkv, D]
    return x.transpose(-3, -2).contiguous()


def sdpa_peer(row: Row):
    """(fn, scale factor): torch SDPA per sequence on dense K/V (a batch prefix if too big)."""
    w, b = row.w, row.w.batch
    per_seq = 2 * (w.context + 1) * w.kv_heads * w.head_dim * row.q.element_size()
    b_run = max(1, min(b, DENSE_CAP_BYTES // per_seq))
    slots = torch.cat([*(torch.stack([lv[i * len(lv) // b] for i in range(b_run)])
                         for lv in row.level_slots), row.private_slots[:b_run]], dim=1)
    kd, vd = _dense(row.k_cache, slots), _dense(row.v_cache, slots)
    g = w.heads // w.kv_heads
    q = row.q[:b_run].view(b_run, w.kv_heads, g, w.head_dim)  # GQA: heads folded into rows
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return (lambda: sdpa(q, kd, vd, scale=row.shape.scale).view(b_run, w.heads, w.head_dim)), b / b_run


def hydragen_peer(row: Row, attn):
    """Hydragen as published: per shared level one batched attention (with LSE) of the queries
    below each node; the suffix per sequence; an LSE merge in PyTorch."""
    w, b = row.w, row.w.batch
    g, d, hkv = w.heads // w.kv_heads, w.head_dim, w.kv_heads
    levels = [(len(lv), _dense(row.k_cache, torch.stack(lv)), _dense(row.v_cache, torch.stack(lv)))
              for lv in row.level_slots]
    kp, vp = _dense(row.k_cache, row.private_slots), _dense(row.v_cache, row.private_slots)
    scale, q = row.shape.scale, row.q

    def run():
        outs, lses = [], []
        for n, kd, vd in levels:  # queries of node j's b/n sequences x G heads as rows
            ql = q.view(n, b // n, hkv, g, d).transpose(1, 2).reshape(n, hkv, b // n * g, d)
            o, lse = attn(ql, kd, vd, scale)
            outs.append(o.view(n, hkv, b // n, g, d).transpose(1, 2).reshape(b, w.heads, d))
            lses.append(lse.view(n, hkv, b // n, g).transpose(1, 2).reshape(b, w.heads))
        o, lse = attn(q.view(b, hkv, g, d), kp, vp, scale)
        outs.append(o.reshape(b, w.heads, d))
        lses.append(lse.reshape(b, w.heads))
        lse_all = torch.stack(lses)  # [levels + 1, b, Hq]
        wts = torch.exp(lse_all - lse_all.amax(0))
        return ((torch.stack(outs).float() * wts[..., None]).sum(0)
                / wts.sum(0)[..., None]).to(q.dtype)
    return run


# ---------------------------------------------------------------- one row

def _err(o: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> float:
    return float((o.float() - ref.float()).abs().max() / v.float().abs().max())


def measure_row(row: Row, ceil: dict, device: torch.device) -> dict:
    from ..attention import create_backend
    from ..attention.cost import CostModel, schedule_cost
    from ..attention.schedule import SCHEDULES
    res = {"grid": row.w.grid, "label": row.w.label, **dataclasses.asdict(row.w),
           **limit(row.w, ceil["copy_bandwidth"], ceil["matrix_rate"]), "backends": {}, "peers": {}}
    model = CostModel.for_device(device)
    ref = None
    for name in BACKENDS:
        be = create_backend(name, row.shape)
        be.plan(row.batch)
        fn = lambda: be.run(row.q, row.k, row.v, row.k_cache, row.v_cache)  # noqa: E731
        out = fn()
        ref = out if ref is None else ref
        entry = {"us": 1e6 * timed(fn, device), "eager_us": 1e6 * timed(fn, device, graph=False),
                 "max_err_vs_paged": _err(out, ref, row.v_cache)}
        if name == "auto":
            entry["chose"] = be.chosen
        else:
            cost = schedule_cost(SCHEDULES[name](row.batch), row.shape)
            entry["cost"] = dataclasses.asdict(cost)
            entry["model_us"] = 1e6 * model.time(cost)
        res["backends"][name] = entry
        del be, out
    res["peers"] = measure_peers(row, device, ref)
    finish_row(res)
    return res


def measure_peers(row: Row, device: torch.device, ref: torch.Tensor) -> dict:
    peers = {}
    try:
        fn, factor = sdpa_peer(row)
        out = fn()
        n = out.shape[0]
        peers["sdpa"] = {"us": 1e6 * timed(fn, device) * factor, "scaled": factor != 1,
                         "max_err_vs_paged": _err(out, ref[:n], row.v_cache)}
        del fn, out
    except (RuntimeError, torch.OutOfMemoryError) as e:
        peers["sdpa"] = {"error": str(e)[:200]}
    variants = {}
    for op_name, op in _lse_ops().items():
        try:
            fn = hydragen_peer(row, op)
            out = fn()
            variants[op_name] = {"us": 1e6 * timed(fn, device),
                                 "max_err_vs_paged": _err(out, ref, row.v_cache)}
        except (RuntimeError, NotImplementedError, torch.OutOfMemoryError) as e:
            variants[op_name] = {"error": str(e).split("\n")[0][:200]}
        fn = out = None
    ok = {k: v for k, v in variants.items() if "us" in v and v["max_err_vs_paged"] < 0.05}
    best = min(ok, key=lambda k: ok[k]["us"]) if ok else None
    peers["hydragen-pub"] = ({**ok[best], "op": best, "variants": variants} if best
                             else {"error": "no aten LSE attention op ran", "variants": variants})
    try:
        import flashinfer  # noqa: F401
        peers["flashinfer"] = {"error": "importable, but not wired into this benchmark"}
    except ImportError:
        peers["flashinfer"] = {"error": "not installed"}
    return peers


def finish_row(res: dict) -> None:
    lim = res["limit_us"]
    exact = {k: v["us"] for k, v in res["backends"].items() if k != "auto"}
    best = min(exact, key=exact.get)
    peers = {k: v["us"] for k, v in res["peers"].items() if "us" in v}
    for v in res["backends"].values():
        v["ratio_to_limit"] = v["us"] / lim
    res["best_backend"], res["best_us"] = best, exact[best]
    res["ratio_to_limit"] = exact[best] / lim
    res["auto_over_best"] = res["backends"]["auto"]["us"] / exact[best]
    if peers:
        res["best_peer"] = min(peers, key=peers.get)
        res["best_peer_us"] = peers[res["best_peer"]]
        res["speedup_vs_best_peer"] = res["best_peer_us"] / exact[best]


# ---------------------------------------------------------------- report

def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def summarize(rows: list[dict]) -> dict:
    t3 = [r for r in rows if r["grid"] == "table3"]
    hy = [r for r in rows if r["grid"] == "hydragen"]
    s = {"table3_geomean_ratio_to_limit": _geomean([r["ratio_to_limit"] for r in t3]),
         "table3_rows_worse_than_best_peer": [r["label"] for r in t3
                                              if r.get("speedup_vs_best_peer", 2) < 1],
         "hydragen_geomean_ratio_to_limit": _geomean([r["ratio_to_limit"] for r in hy]),
         "hydragen_min_speedup_vs_best_peer": min((r["speedup_vs_best_peer"] for r in hy
                                                   if "speedup_vs_best_peer" in r), default=None),
         "auto_max_over_best": max((r["auto_over_best"] for r in rows), default=None)}
    s["bars"] = {
        "table3_within_1.15x": bool(t3) and s["table3_geomean_ratio_to_limit"] <= 1.15,
        "table3_no_row_slower_than_best_peer": bool(t3) and not s["table3_rows_worse_than_best_peer"],
        "hydragen_within_1.5x": bool(hy) and s["hydragen_geomean_ratio_to_limit"] <= 1.5,
        "hydragen_2x_vs_best_peer": bool(hy) and (s["hydragen_min_speedup_vs_best_peer"] or 0) >= 2,
        "auto_within_5pct": bool(rows) and s["auto_max_over_best"] <= 1.05}
    return s


def print_table(rows: list[dict]) -> None:
    head = f"{'grid':8} {'row':24} {'limit':>8} {'bd':>2} " + " ".join(
        f"{b:>8}" for b in BACKENDS) + f" {'best/lim':>8} {'sdpa':>8} {'hyd-pub':>8} {'vs peer':>7}"
    print(head)
    for r in rows:
        us = " ".join(f"{r['backends'][b]['us']:8.1f}" for b in BACKENDS)
        peer = lambda k: r["peers"].get(k, {}).get("us")  # noqa: E731
        fmt = lambda x: f"{x:8.1f}" if x else f"{'-':>8}"  # noqa: E731
        print(f"{r['grid']:8} {r['label']:24} {r['limit_us']:8.1f} {r['bound'][0]:>2} {us} "
              f"{r['ratio_to_limit']:8.2f} {fmt(peer('sdpa'))} {fmt(peer('hydragen-pub'))} "
              f"{r.get('speedup_vs_best_peer', float('nan')):7.2f}")


def plot(rows: list[dict], path: pathlib.Path, device_name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grids = [g for g in ("table3", "hydragen", "custom") if any(r["grid"] == g for r in rows)]
    fig, axes = plt.subplots(len(grids), 1, figsize=(14, 4.5 * len(grids)), squeeze=False)
    names = [*BACKENDS, "sdpa", "hydragen-pub"]
    for ax, grid in zip(axes[:, 0], grids):
        rs = [r for r in rows if r["grid"] == grid]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            vals = [(r["backends"].get(name) or r["peers"].get(name) or {}).get("us", float("nan"))
                    / r["limit_us"] for r in rs]
            ax.bar([i + j * width for i in range(len(rs))], vals, width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks([i + 0.4 for i in range(len(rs))], [r["label"] for r in rs], rotation=30,
                      ha="right", fontsize=7)
        ax.set_ylabel("time / limit")
        ax.set_title(f"{grid}: decode attention, time over max(bytes/BW, FLOPs/rate) -- {device_name}")
        ax.legend(fontsize=7, ncol=len(names))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- launch-shape sweep

# launch shapes tried per unit class: (block_m, block_n, num_warps, num_stages, programs_per_sm)
SWEEP_NARROW = [(16, 64, 2, 2, 4), (16, 64, 2, 3, 4), (16, 128, 2, 2, 4), (16, 32, 2, 2, 4),
                (16, 64, 4, 2, 4), (16, 64, 1, 2, 4), (16, 64, 2, 2, 2), (16, 64, 2, 2, 8)]
SWEEP_WIDE = [(64, 64, 4, 2, 4), (64, 64, 4, 3, 4), (64, 32, 4, 2, 4), (128, 64, 8, 2, 4),
              (64, 64, 4, 2, 2), (64, 64, 4, 2, 8)]


def sweep(dtype: str, device: torch.device) -> list[dict]:
    """Time launch shapes of each attend launch (narrow, wide) on a few telling rows, one
    schedule each, and split the default's time into its launches."""
    from ..attention.backends.hydragen import HydragenBackend
    from ..attention.backends.paged import PagedBackend
    from ..attention.ops.triton.kernels import TritonKernels
    from ..attention.ops.triton.worklist import KernelConfig
    t3, hy = table3(dtype), hydragen_grid(dtype)
    picks = [(t3[8], PagedBackend, "narrow"), (t3[10], HydragenBackend, "both"),
             (hy[10], HydragenBackend, "both"), (hy[7], HydragenBackend, "both"),
             (hy[3], HydragenBackend, "wide")]
    out = []
    for w, cls, vary in picks:
        row = build(w, device)
        default = cls(row.shape, kernels=TritonKernels(row.shape))
        default.plan(row.batch)
        x = default.current.extra
        base = [KernelConfig(*(x[f"{c}_{k}"] for k in ("block_m", "block_n", "num_warps",
                                                     "num_stages"))) for c in ("narrow", "wide")]
        res = {"label": w.label, "grid": w.grid, "schedule": cls.name, "configs": [],
               "split_us": _split_times(default, row, device)}
        tries = ([(c, 0) for c in SWEEP_NARROW] if vary in ("narrow", "both") else []) + (
            [(c, 1) for c in SWEEP_WIDE] if vary in ("wide", "both") else [])
        for c, which in tries:
            cfgs = list(base)
            cfgs[which] = KernelConfig(*c)
            try:
                be = cls(row.shape, kernels=TritonKernels(row.shape, configs=tuple(cfgs)))
                be.plan(row.batch)
                t = timed(lambda: be.run(row.q, row.k, row.v, row.k_cache, row.v_cache), device)
                res["configs"].append({"class": ("narrow", "wide")[which], "config": c, "us": 1e6 * t})
            except Exception as e:  # noqa: BLE001  (out of shared memory, ...): recorded
                res["configs"].append({"class": ("narrow", "wide")[which], "config": c,
                                       "error": str(e)[:160]})
        out.append(res)
        for cls_name in ("narrow", "wide"):
            ok = [c for c in res["configs"] if c["class"] == cls_name and "us" in c]
            if ok:
                best = min(ok, key=lambda c: c["us"])
                print(f"  sweep {w.label} {cls.name} {cls_name}: first {ok[0]['us']:.1f} us, best "
                      f"{best['us']:.1f} us {best['config']}", flush=True)
        print(f"  split {w.label}: {res['split_us']}", flush=True)
        del row
    return out


def _split_times(be, row: Row, device: torch.device) -> dict:
    """The default run's parts alone: store_kv, each attend launch, both (forked), the merge."""
    from ..attention.ops.triton.attend import launch_units, launch_worklist
    from ..attention.ops.triton.merge import merge_rows
    from ..attention.ops.triton.worklist import KernelConfig
    p, x, kern = be.current, be.current.extra, be.kernels
    cfgs = [KernelConfig(*(x[f"{c}_{k}"] for k in ("block_m", "block_n", "num_warps",
                                                    "num_stages"))) for c in ("narrow", "wide")]
    hq, d = row.q.shape[1:]
    rows = x["num_partials"]
    o_s = torch.empty((rows, hq, d), dtype=torch.float32, device=device)
    lse_s = torch.empty((rows, hq), dtype=torch.float32, device=device)
    out = torch.empty_like(row.q)
    idx = (p.kv_chunk, p.kv_lo, p.kv_hi, p.kv_pos)
    causal = (bool(x["causal_narrow"]), bool(x["causal_wide"]))
    times = {"store_kv": timed(lambda: kern.store_kv(row.k_cache, row.v_cache, row.k, row.v,
                                                     p.slots), device)}
    for i, name in enumerate(("narrow", "wide")):
        if x[name] is not None:
            times[name] = timed(lambda: launch_units(row.q, row.k_cache, row.v_cache, p.q_pos,
                                                     x[name], *idx, row.shape.scale, o_s, lse_s,
                                                     cfgs[i], causal[i]), device)
            times[name + "_units"] = int(x[name].shape[0])
    times["both"] = timed(lambda: launch_worklist(row.q, row.k_cache, row.v_cache, p.q_pos,
                                                  (x["narrow"], x["wide"]), *idx, row.shape.scale,
                                                  o_s, lse_s, cfgs, causal, kern.side), device)
    if not x["direct"]:
        times["merge"] = timed(lambda: merge_rows(o_s, lse_s, x["merge_indptr"],
                                                  x["merge_parts"], out, None), device)
    return {k: v if k.endswith("units") else round(1e6 * v, 2) for k, v in times.items()}


# ---------------------------------------------------------------- command line

def workloads(args) -> list[Workload]:
    if args.grid == "custom" or any(x is not None for x in (args.batch, args.context, args.shared)):
        shared = tuple(int(s) for s in (args.shared or "0").split(",") if int(s) > 0)
        return [Workload("custom", args.batch or 32, args.heads, args.kv_heads or args.heads,
                         args.head_dim, args.context or 2048, shared, args.chunk_size, args.dtype,
                         args.groups)]
    return ((table3(args.dtype) if args.grid in ("table3", "all") else [])
            + (hydragen_grid(args.dtype) if args.grid in ("hydragen", "all") else []))


def device_slug(device: torch.device) -> tuple[str, str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return name, "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def main(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows_w = workloads(args)
    name, slug = device_slug(device)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ceil = ceilings(device, _DTYPES[args.dtype])
    print(f"{name}: copy {ceil['copy_bandwidth'] / 1e12:.2f} TB/s, {args.dtype} matmul "
          f"{ceil['matrix_rate'] / 1e12:.0f} TFLOP/s", flush=True)
    result = {"device": name, "torch": torch.__version__, "ceilings": ceil, "rows": []}
    for w in rows_w:
        row = build(w, device)
        result["rows"].append(measure_row(row, ceil, device))
        del row
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = result["rows"][-1]
        print(f"  {w.grid} {w.label}: best {r['best_backend']} {r['best_us']:.1f} us = "
              f"{r['ratio_to_limit']:.2f} x limit; auto {r['backends']['auto']['chose']}", flush=True)
        result["summary"] = summarize(result["rows"])
        (out_dir / f"kernels-{slug}.json").write_text(json.dumps(result, indent=1))
    if args.sweep and device.type == "cuda":
        result["sweep"] = sweep(args.dtype, device)
        (out_dir / f"kernels-{slug}.json").write_text(json.dumps(result, indent=1))
    print_table(result["rows"])
    print(json.dumps(result["summary"], indent=1))
    plot(result["rows"], out_dir / f"kernels-{slug}.png", name)
    return 0


def register(sub) -> None:
    p = sub.add_parser("kernels", help="attention kernels: every backend vs the bytes/FLOPs limit and peers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=("table3", "hydragen", "all", "custom"), default="all",
                   help="default grids (a custom row if --batch, --context or --shared is given)")
    p.add_argument("--batch", type=int, default=None, help="sequences (custom row; default 32)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=None,
                   help="prompt tokens per sequence, shared included (custom row; default 2048)")
    p.add_argument("--shared", default=None,
                   help="shared prefix lengths by level, e.g. 2048,512 (custom row; default 0)")
    p.add_argument("--groups", type=int, default=4, help="fan-out of each shared level below the first")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="float16")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG")
    p.add_argument("--sweep", action="store_true", help="also time launch shapes of the attend kernel")
    p.set_defaults(func=main)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m prefixserve.bench.kernels")
    register(parser.add_subparsers(dest="cmd", required=True))
    ns = parser.parse_args()
    raise SystemExit(ns.func(ns))
