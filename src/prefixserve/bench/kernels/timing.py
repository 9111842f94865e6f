"""How `prefixserve bench kernels` (and `bench gemm`, `bench moe`) times a call, checks its
output, and measures the two ceilings.

Every timed call -- our backends' run() and every peer's -- goes through `time_call`: a CUDA
graph of one call, replayed as triton.testing.do_bench replays a call (median of as many runs
as fit 100 ms, after 25 ms of warm-up), with the L2 flushed before every run (`flush_l2`), or,
when the call cannot be captured, the eager call timed the same way; the JSON's `timing` says
which, and names the flush (results before it say only "cuda-graph replay": do_bench's).
Planning (index tensors, page tables, FlashInfer's plan()) happens before and is never timed.
On a CPU the time is a wall clock.

The flush reads a buffer of 5x the L2 rather than writing one, as do_bench does: a write
leaves the L2 full of dirty lines (~50 MB on an H100 / H200), which the timed call then writes
back to memory as its own reads evict them. That cost is the harness's, not the call's (in a
decode step the kernels before attention leave few dirty lines: they read weights and write
activations of a few MB), and it was 7-10 us of every Table 3 row on an H100 -- sh768's step
71.2 -> 63.9 us, the all-shared sh1024 20.3 -> 18.2 (with the L2 left warm instead: 15.3, so
the read flush leaves the inputs as cold as the write did; kernels-notes.md, issue 25 part
thirteen).
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
    """Median seconds of fn(): CUDA-graph replays (or eager calls) after a clean L2 flush each
    (`_bench_ms`) on CUDA; a wall clock on the CPU."""
    if device.type != "cuda":
        fn()
        times: list[float] = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
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
    return _bench_ms(call, device) * 1e-3


def _bench_ms(call: Callable[[], object], device: torch.device, warmup_ms: float = 25,
              rep_ms: float = 100) -> float:
    """Median ms of call() on CUDA, L2 flushed clean before each timed run: do_bench's loop
    (runs estimated from 5, warm-up, then one event pair per run) with `flush_l2`."""
    flush = functools.partial(flush_l2, device)
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        call()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5
    for _ in range(max(1, int(warmup_ms / estimate))):
        call()
    runs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(max(1, int(rep_ms / estimate)))]
    for start, end in runs:
        flush()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in runs)


_FLUSH_BYTES = 256 << 20  # 5x the L2 of an H100 / H200 (50 MB)
_FLUSHED = ", L2 flushed by a read"  # what `time_call`'s JSON says of the flush


@functools.cache
def _flush_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, 0-d sum) for `flush_l2`: the buffer written once, here."""
    return (torch.zeros(_FLUSH_BYTES // 8, dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.int64, device=device))


def flush_l2(device: torch.device) -> None:
    """Evict the L2 and leave it clean: sum a buffer of 5x its size (reads only; see the
    module docstring for why not a write)."""
    buf, total = _flush_buffers(device)
    torch.sum(buf, dim=0, out=total)


def time_call(fn: Callable[[], object], device: torch.device) -> dict[str, Any]:
    """us (graph replay where fn can be captured, else eager), eager_us, and which of the two."""
    if device.type != "cuda":
        us = 1e6 * timed(fn, device)
        return {"us": us, "eager_us": us, "timing": "cpu wall clock (median of 3)"}
    eager = 1e6 * timed(fn, device, graph=False)
    try:
        return {"us": 1e6 * timed(fn, device), "eager_us": eager, "timing": "cuda-graph replay" + _FLUSHED}
    except RuntimeError as e:  # not capturable (a host sync, an allocation it forbids): eager
        torch.cuda.synchronize()
        return {"us": eager, "eager_us": eager,
                "timing": "eager" + _FLUSHED + " (graph capture failed: " + str(e).split("\n")[0][:160] + ")"}


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
