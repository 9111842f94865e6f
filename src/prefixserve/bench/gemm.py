"""`prefixserve bench gemm`: deterministic mode's batch-invariant GEMM against cuBLAS and its limit.

    prefixserve bench gemm --config benchmarks/configs/llama-2-7b.json --rows 1,64,256,1024,4096,16384

For each linear layer of the config (fused qkv, o, fused gate/up, down, the LM head) and each
row count M: y = x W^T (bf16) through `fused.linear.invariant_linear` (the Triton kernel on CUDA,
its fixed-block twin elsewhere) and through torch's F.linear (cuBLAS), each timed as a CUDA
graph replay, with the limit: the larger of (W + x + y bytes) / copy bandwidth and 2 M N K /
matrix rate, both measured here (`kernels.timing.ceilings`).

Invariance: every row count's output must equal, bit for bit, the same rows of the largest
row count's; on sm_90 so must every launch shape the kernel may pick (`linear_triton.config`)
and, with --sweep, every candidate shape (the matrix instructions' sum order does not depend on
the tile; mma.sync shapes, BLOCK_M < 64, are reported apart). --sweep also times every
candidate at every M: the data `linear_triton`'s shape table is read from.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..model.fused import linear as invariant
from . import results as R
from .kernels.timing import ceilings, time_call

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def register(sub) -> None:
    p = sub.add_parser("gemm", help="deterministic mode's batch-invariant GEMM vs cuBLAS and its limit",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="benchmarks/configs/llama-2-7b.json", help="an HF config.json (its layer shapes)")
    p.add_argument("--rows", type=R.int_list, default=[1, 16, 64, 128, 256, 1024, 4096, 16384], help="M, list")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--sweep", action="store_true", help="time every candidate launch shape (CUDA)")
    p.add_argument("--cublas-rows", type=R.int_list, default=[*range(1, 64), *range(64, 1025, 16), 1536, 2048, 4096],
                   help="M at which to compare cuBLAS's bits with the invariant kernel's (no timing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=R.DEFAULT_OUT_DIR, help="where the JSON goes")
    p.add_argument("--tag", default="", help="appended to the file name")
    p.set_defaults(func=run, _parser=p)


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Layer name -> (N, K) of its weight."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o": (h, cfg.num_heads * d),
            "gate_up": (2 * cfg.intermediate_size, h), "down": (h, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, h)}


def run(args: argparse.Namespace) -> int:
    import json
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype]
    cfg = ModelConfig.from_hf(json.loads(Path(args.config).read_text()))
    ceil = ceilings(device, dtype)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows, invariance = [], []
    for name, (n, k) in shapes(cfg).items():
        w = torch.randn(n, k, generator=gen, device=device, dtype=dtype) / k ** 0.5
        x = torch.randn(max(args.rows), k, generator=gen, device=device, dtype=dtype)
        invariance.append({"layer": name, **check_invariance(x, w, args.rows, args.sweep),
                           **same_as_cublas(x, w, [m for m in args.cublas_rows if m <= len(x)])})
        for m in args.rows:
            rows.append({"layer": name, "n": n, "k": k, "m": m,
                         **time_layer(x[:m], w, ceil, args.sweep and device.type == "cuda")})
        del w, x
        R.free_device_memory()
    R.print_table(rows, [("layer", "layer", ""), ("M", "m", "d"), ("cuBLAS us", "cublas_us", ".1f"),
                         ("invariant us", "invariant_us", ".1f"), ("vs cuBLAS", "vs_cublas", ".2f"),
                         ("x limit", "invariant_vs_limit", ".2f"), ("best shape", "best_shape", "")])
    for inv in invariance:
        print(f"{inv['layer']}: rows identical across M: {inv['rows_identical']}; "
              f"shapes identical: {inv['shapes_identical']}; mma.sync identical: {inv.get('mma_sync_identical')}; "
              f"cuBLAS differs at M = {_ranges(inv['cublas_differing_rows'])}")
    hw = R.hardware()
    doc = {"benchmark": f"batch-invariant GEMM vs cuBLAS, {Path(args.config).stem} layers ({args.dtype})",
           "hardware": hw, "ceilings": ceil, "rows": rows, "invariance": invariance,
           "geomean_vs_cublas": _geomean([r["vs_cublas"] for r in rows])}
    name = "-".join(["gemm", Path(args.config).stem, R.hardware_slug(hw)] + ([args.tag] if args.tag else []))
    R.publish(doc, Path(args.out_dir) / f"{name}.json", args, "prefixserve bench gemm")
    ok = all(i["rows_identical"] and i["shapes_identical"] for i in invariance)
    return 0 if ok else 1


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[list[int]] = []
    for x in xs:
        if out and x == out[-1][-1] + 1:
            out[-1].append(x)
        else:
            out.append([x])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out) or "none"


def _geomean(xs: list[float]) -> float:
    import math
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 4)


def _candidates(x: torch.Tensor) -> list[Any]:
    from ..model.fused import linear_triton as lt
    if not x.is_cuda:
        return []
    wgmma = [lt.GemmConfig(*s) for s in ((64, 64, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4),
                                         (64, 128, 128, 4, 3), (64, 256, 64, 4, 3), (128, 64, 64, 4, 4),
                                         (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                                         (64, 32, 128, 4, 4))]
    return wgmma + [c for _, c in lt._SM90_SHAPES if c not in wgmma]


def _mma_sync(x: torch.Tensor) -> list[Any]:
    from ..model.fused import linear_triton as lt
    return [lt.GemmConfig(16, 64, 128, 4, 4), lt.GemmConfig(32, 64, 64, 2, 4)] if x.is_cuda else []


def check_invariance(x: torch.Tensor, w: torch.Tensor, row_counts: list[int], sweep: bool) -> dict[str, Any]:
    """Bits of every row count against the largest; of every shape (on CUDA) against the default."""
    full = invariant.invariant_linear(x, w)
    bad_rows = [m for m in row_counts if not torch.equal(invariant.invariant_linear(x[:m], w), full[:m])]
    out: dict[str, Any] = {"rows_identical": not bad_rows, "rows_differing": bad_rows}
    if not x.is_cuda:
        out["shapes_identical"] = True
        return out
    from ..model.fused import linear_triton as lt
    shapes_ = _candidates(x) if sweep else [lt.config(rows, x.shape[1], x) for rows, _ in lt._SM90_SHAPES]
    differ = [c.__dict__ for c in shapes_ if not torch.equal(lt.linear(x, w, cfg=c), full)]
    out.update(shapes_identical=not differ, shapes_differing=differ)
    if sweep:
        out["mma_sync_identical"] = all(torch.equal(lt.linear(x, w, cfg=c), full) for c in _mma_sync(x))
    return out


def same_as_cublas(x: torch.Tensor, w: torch.Tensor, row_counts: list[int]) -> dict[str, Any]:
    """The row counts at which F.linear (cuBLAS) gives the invariant kernel's bits: where it
    does, it runs the same sums (no split-K); where not, it does not."""
    same = [m for m in row_counts if torch.equal(nn.functional.linear(x[:m], w), invariant.invariant_linear(x[:m], w))]
    return {"cublas_identical_rows": same, "cublas_differing_rows": sorted(set(row_counts) - set(same))}


def time_layer(x: torch.Tensor, w: torch.Tensor, ceil: dict[str, float], sweep: bool) -> dict[str, Any]:
    m, k = x.shape
    n = w.shape[0]
    limit = max((n * k + m * k + m * n) * x.element_size() / ceil["copy_bandwidth"],
                2 * m * n * k / ceil["matrix_rate"]) * 1e6
    cublas = time_call(functools.partial(nn.functional.linear, x, w), x.device)["us"]
    ours = time_call(functools.partial(invariant.invariant_linear, x, w), x.device)["us"]
    row: dict[str, Any] = {"limit_us": round(limit, 2), "cublas_us": round(cublas, 2), "invariant_us": round(ours, 2),
                           "vs_cublas": round(ours / cublas, 4), "invariant_vs_limit": round(ours / limit, 4),
                           "cublas_vs_limit": round(cublas / limit, 4)}
    if sweep:
        from ..model.fused import linear_triton as lt
        times = {c: time_call(functools.partial(lt.linear, x, w, None, c), x.device)["us"] for c in _candidates(x)}
        best = min(times, key=times.__getitem__)
        row.update(best_shape="x".join(map(str, (best.block_m, best.block_n, best.block_k, best.num_warps,
                                                 best.num_stages))),
                   best_us=round(times[best], 2), sweep_us={str(tuple(c.__dict__.values())): round(t, 2)
                                                            for c, t in times.items()})
    return row
