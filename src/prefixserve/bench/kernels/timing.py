"""How `prefixserve bench kernels` times a call, checks its output, and measures the two ceilings.

Every timed call -- our backends' run() and every peer's -- goes through `time_call`: a CUDA
graph of one call, replayed under triton.testing.do_bench (median; do_bench writes a 256 MB
buffer between replays, which flushes L2), or, when the call cannot be captured, the eager
call under the same do_bench; the JSON says which. Planning (index tensors, page tables,
FlashInfer's plan()) happens before and is never timed. On a CPU the time is a wall clock.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

ERR_TOL = 1e-2  # max |o - o_paged| / max |v| above which an output is wrong and not counted


def timed(fn: Callable[[], object], device: torch.device, graph: bool = True) -> float:
    """Median seconds of fn(): CUDA-graph replays (or eager calls) under do_bench on CUDA;
    a wall clock on the CPU."""
    if device.type != "cuda":
        fn()
        times: list[float] = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    import triton.testing
    fn()
    torch.cuda.synchronize()
    call: Callable[[], object] = fn
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


def time_call(fn: Callable[[], object], device: torch.device) -> dict[str, Any]:
    """us (graph replay where fn can be captured, else eager), eager_us, and which of the two."""
    if device.type != "cuda":
        us = 1e6 * timed(fn, device)
        return {"us": us, "eager_us": us, "timing": "cpu wall clock (median of 3)"}
    eager = 1e6 * timed(fn, device, graph=False)
    try:
        return {"us": 1e6 * timed(fn, device), "eager_us": eager, "timing": "cuda-graph replay"}
    except RuntimeError as e:  # not capturable (a host sync, an allocation it forbids): eager
        torch.cuda.synchronize()
        return {"us": eager, "eager_us": eager,
                "timing": "eager (graph capture failed: " + str(e).split("\n")[0][:160] + ")"}


def max_err(o: torch.Tensor, ref: torch.Tensor, vmax: float) -> float:
    """max |o - ref| / max |v| (`Row.vmax`): the error scale of an attention output is that of the values."""
    return float((o.float() - ref.float()).abs().max()) / vmax


def measure_call(fn: Callable[[], torch.Tensor], device: torch.device, ref: torch.Tensor, vmax: float,
                 factor: float = 1.0) -> dict[str, Any]:
    """Run fn once and check it against the paged backend's output `ref` (fn may compute a
    prefix of the batch's rows), then time it; times are multiplied by `factor` (a peer run on
    a fraction of the batch). `counted`: the output is right, so its time may be compared."""
    out = fn()
    err = max_err(out, ref[:out.shape[0]], vmax)
    t = time_call(fn, device)
    return {"us": t["us"] * factor, "eager_us": t["eager_us"] * factor, "timing": t["timing"],
            "max_err_vs_paged": err, "counted": err <= ERR_TOL}


def ceilings(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and matrix rate, measured here on random data, and
    the replay time of a CUDA graph of one tiny kernel (on a CPU: one tiny op's wall clock)."""
    n_copy, n_mm = (1 << 30, 8192) if device.type == "cuda" else (1 << 24, 1024)
    src = torch.randn(n_copy // 2, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    t_copy = timed(functools.partial(dst.copy_, src), device, graph=False)
    a, b = (torch.randn(n_mm, n_mm, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty_like(a)
    t_mm = timed(functools.partial(torch.mm, a, b, out=c), device, graph=False)
    del src, dst, a, b, c
    x = torch.zeros(256, device=device)
    t_graph = timed(functools.partial(x.add_, 1.0), device)  # CUDA: the replay of a one-kernel graph
    return {"copy_bandwidth": 2 * n_copy / t_copy, "matrix_rate": 2 * n_mm ** 3 / t_mm,
            "copy_bytes": n_copy, "matmul_n": n_mm, "graph_launch_us": 1e6 * t_graph}
