"""`prefixserve bench kernels`: one decode step's attention, every backend against its limit and peers.

A row is a batch of decoding sequences over a prefix tree (rows.py): `--shared 2048,512`
puts a 2048-token prefix under all of them, then `--groups` 512-token prefixes, one per group of
sequences below it; each sequence then holds its own `context - sum(shared)` prompt tokens and
its decoded token (the query).

    limit    max(bytes / copy bandwidth, FLOPs / matrix rate), both measured in this run
             (a device-to-device copy, bytes read + written; an 8192^3 matmul in --dtype on
             random data); bytes = shared K/V once + private K/V + q + o; FLOPs = 4 D Hq keys
             per query. Also measured: `graph_launch_us`, the replay of a one-kernel CUDA
             graph (the floor of any step; the all-shared rows' bar adds it to the limit)
    timing   each backend's run() (new K/V + attend + merge) and each peer's call, captured in
             a CUDA graph where it can be and replayed as triton.testing.do_bench would (median),
             L2 flushed clean before every replay (timing.py); `timing` says graph or eager,
             `eager_us` is kept
    peers    sdpa (PyTorch FlashAttention on dense per-sequence K/V), hydragen-pub (Hydragen as
             published: FlashAttention-2 with LSE, merged in PyTorch), flashinfer-decode and
             flashinfer-cascade (FlashInfer 0.2.14 over the same chunk pool, where importable;
             benchmarks/flashinfer-setup.sh); and beside them hydragen-cudnn / -efficient
             (Hydragen on cuDNN's / the memory-efficient LSE op). peers.py says how.
    checks   every backend's and peer's output against the paged backend's: max error over
             max |v|; a peer with a wrong output is not compared
    fp8      --kv-cache-dtype fp8 / both: the rows over an e4m3 cache (rows.py); the peers there
             are FlashInfer's (fp8 pages, one scale per tensor); the others read 16-bit K/V only

Default grids: ChunkAttention's Table 3 (b 32, 32 heads, d 128, chunk 64; n_p 1024/2048/4096 x
n_s 0, n_p/2, 3n_p/4, n_p) and a Hydragen-scale grid (b 256/1024, shared 2K/8K/16K, private
128/512, 32 query / 8 KV heads). Prints a table and the summary; writes
<out>/kernels-<gpu>.json and .png (report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
from typing import Any

import torch

from ..results import publish
from .peers import measure_peers
from .report import BACKENDS, finish_row, plot, print_table, summarize
from .rows import DTYPES, Row, Workload, build, hydragen_grid, limit, table3
from .sweep import sweep
from .timing import ceilings, max_err, time_call

PROG = "prefixserve bench kernels"


def measure_backends(row: Row, device: torch.device) -> tuple[dict[str, dict[str, Any]], torch.Tensor]:
    """Every backend's planned run() timed, its error vs paged (the first), and for the exact
    schedules the cost model's prediction; returns the entries and paged's output."""
    from ...attention import create_backend
    from ...attention.backends.auto import AutoBackend
    from ...attention.cost import CostModel, schedule_cost
    from ...attention.schedule import SCHEDULES
    model = CostModel.for_device(device)
    entries: dict[str, dict[str, Any]] = {}
    ref: torch.Tensor | None = None
    for name in BACKENDS:
        be = create_backend(name, row.shape)
        be.plan(row.batch)
        fn = functools.partial(be.run, row.q, row.k, row.v, row.k_cache, row.v_cache, kv_scale=row.kv_scale)
        out = fn()
        ref = out if ref is None else ref
        entry = {**time_call(fn, device), "max_err_vs_paged": max_err(out, ref, row.vmax)}
        extra = getattr(getattr(be, "current", None), "extra", None)
        if isinstance(extra, dict) and extra.get("wide_pairs"):  # `ops.triton.hopper_pairs` ran the products
            entry["wide_pairs"] = True
        if name == "auto":
            assert isinstance(be, AutoBackend), "the registry's `auto` is AutoBackend"
            entry["chose"] = be.chosen
        else:
            cost = schedule_cost(SCHEDULES[name](row.batch), row.shape)
            entry["cost"] = dataclasses.asdict(cost)
            entry["model_us"] = 1e6 * model.time(cost)
        entries[name] = entry
        del be, fn, out  # this backend's buffers go before the next one is built
    assert ref is not None, "BACKENDS is not empty"
    return entries, ref


def measure_row(row: Row, ceil: dict[str, float], device: torch.device) -> dict[str, Any]:
    res = {"grid": row.w.grid, "label": row.w.label, **dataclasses.asdict(row.w),
           **limit(row.w, ceil["copy_bandwidth"], ceil["matrix_rate"])}
    res["backends"], ref = measure_backends(row, device)
    res["peers"] = measure_peers(row, device, ref)
    finish_row(res)
    return res


def workloads(args) -> list[Workload]:
    """The rows asked for; with --kv-cache-dtype both, each 16-bit row then its fp8 twin (grid
    `<grid>-fp8`)."""
    if args.grid == "custom" or any(x is not None for x in (args.batch, args.context, args.shared)):
        shared = tuple(int(s) for s in (args.shared or "0").split(",") if int(s) > 0)
        rows = [Workload("custom", args.batch or 32, args.heads, args.kv_heads or args.heads,
                         args.head_dim, args.context or 2048, shared, args.chunk_size, args.dtype,
                         args.groups)]
    else:
        rows = ((table3(args.dtype) if args.grid in ("table3", "all") else [])
                + (hydragen_grid(args.dtype) if args.grid in ("hydragen", "all") else []))
    fp8 = lambda w: dataclasses.replace(w, grid=f"{w.grid}-fp8", kv_dtype="fp8")  # noqa: E731
    kinds = {"auto": lambda w: [w], "fp8": lambda w: [fp8(w)], "both": lambda w: [w, fp8(w)]}[args.kv_cache_dtype]
    return [x for w in rows for x in kinds(w)]


def wide_kernel(device: torch.device) -> str:
    """Which kernel runs the 128-row wide launches of 16-bit decode steps here."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        from ...attention.ops.triton.launch import hopper_module
        if hopper_module() is not None:
            return "gluon (ops.triton.hopper; hopper_pairs on rows whose backends say wide_pairs)"
    return "triton (ops.triton.attend)"


def device_slug(device: torch.device) -> tuple[str, str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return name, "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def main(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows_w = workloads(args)
    name, slug = device_slug(device)
    json_path = pathlib.Path(args.out) / f"kernels-{slug}.json"
    ceil = ceilings(device, DTYPES[args.dtype])
    print(f"{name}: copy {ceil['copy_bandwidth'] / 1e12:.2f} TB/s, {args.dtype} matmul "
          f"{ceil['matrix_rate'] / 1e12:.0f} TFLOP/s, one-kernel graph {ceil['graph_launch_us']:.1f} us", flush=True)
    result: dict[str, Any] = {"device": name, "torch": torch.__version__, "ceilings": ceil, "rows": [],
                              "wide_kernel": wide_kernel(device)}
    for w in rows_w:
        row = build(w, device)
        result["rows"].append(measure_row(row, ceil, device))
        del row
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = result["rows"][-1]
        print(f"  {w.grid} {w.label}: best {r['best_backend']} {r['best_us']:.1f} us = "
              f"{r['ratio_to_limit']:.2f} x limit; auto {r['backends']['auto']['chose']}", flush=True)
        result["summary"] = summarize(result["rows"], ceil)
        publish(result, json_path, args, PROG, partial=True)  # the rows so far, should a later one fail
    if args.sweep and device.type == "cuda":
        result["sweep"] = sweep(args.dtype, device)
    print_table(result["rows"])
    print(json.dumps(result["summary"], indent=1))
    publish(result, json_path, args, PROG, lambda doc, png: plot(doc["rows"], png, name))
    return 0


def add_row_arguments(p: argparse.ArgumentParser) -> None:
    """The options that choose the rows (`workloads`); `kernels-ab` takes them too."""
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
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float16")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "both"), default="auto",
                   help="the cache's type: --dtype (auto), e4m3 (fp8), or every row in both (the fp8 "
                        "twin's grid is <grid>-fp8)")


def register(sub) -> None:
    p = sub.add_parser("kernels", help="attention kernels: every backend vs the bytes/FLOPs limit and peers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_row_arguments(p)
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG")
    p.add_argument("--sweep", action="store_true", help="also time launch shapes of the attend kernel")
    p.set_defaults(func=main, _parser=p)

