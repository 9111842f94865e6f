"""`prefixserve bench kernels --sweep`: launch shapes of the Triton attend kernel, and the split of
the default run's time into its launches (store_kv, each attend launch, both, the merge).

This code reaches into the Triton executor's internals (TritonKernels, KernelConfig, Launch,
launch_units, launch_worklist, merge_rows) and follows the executor when that changes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .rows import Row, build, hydragen_grid, table3
from .timing import timed

# launch shapes tried per unit class: (block_m, block_n, num_warps, num_stages, programs_per_sm);
# each wide shape also in Triton where the Gluon kernel (`hopper`) applies
SWEEP_NARROW = [(16, 64, 2, 2, 4), (16, 64, 2, 3, 4), (16, 128, 2, 2, 4), (16, 32, 2, 2, 4),
                (16, 64, 4, 2, 4), (16, 64, 1, 2, 4), (16, 64, 2, 2, 2), (16, 64, 2, 2, 8)]
SWEEP_WIDE = [(128, 64, 4, 2, 4), (128, 64, 4, 3, 4), (128, 64, 4, 2, 2), (64, 64, 4, 3, 4),
              (64, 64, 4, 2, 4), (64, 32, 4, 2, 4), (128, 64, 8, 2, 4), (128, 32, 4, 2, 4),
              (64, 64, 4, 2, 2), (128, 64, 8, 3, 2)]


def sweep(dtype: str, device: torch.device) -> list[dict[str, Any]]:
    """Time launch shapes of each attend launch (narrow, wide) on a few telling rows, one
    schedule each, and split the default's time into its launches."""
    from ...attention.backends.hydragen import HydragenBackend
    from ...attention.backends.paged import PagedBackend
    from ...attention.ops.triton.configs import KernelConfig
    from ...attention.ops.triton.kernels import TritonKernels
    t3, hy = table3(dtype), hydragen_grid(dtype)
    picks = [(t3[8], PagedBackend, "narrow"), (t3[10], HydragenBackend, "both"),
             (hy[10], HydragenBackend, "both"), (hy[7], HydragenBackend, "both"),
             (hy[3], HydragenBackend, "wide")]
    out = []
    for w, cls, vary in picks:
        row = build(w, device)
        default = cls(row.shape, kernels=TritonKernels(row.shape))
        default.plan(row.batch)
        assert default.current is not None, "plan() sets the current plan"
        x = default.current.extra
        narrow, wide = (TritonKernels.launch_config(x, c) for c in ("narrow", "wide"))
        res: dict[str, Any] = {"label": w.label, "grid": w.grid, "schedule": cls.name, "configs": [],
                               "split_us": _split_times(default, row, device)}
        wides = [(c, 1, h) for c in SWEEP_WIDE for h in ((True, False) if c[0] == 128 else (True,))]
        tries = ([(c, 0, True) for c in SWEEP_NARROW] if vary in ("narrow", "both") else []) + (
            wides if vary in ("wide", "both") else [])
        for c, which, hopper in tries:
            cfg = KernelConfig(*c, hopper=hopper)
            cfgs = (cfg, wide) if which == 0 else (narrow, cfg)
            try:
                be = cls(row.shape, kernels=TritonKernels(row.shape, configs=cfgs))
                be.plan(row.batch)
                t = timed(functools.partial(be.run, row.q, row.k, row.v, row.k_cache, row.v_cache), device)
                res["configs"].append({"class": ("narrow", "wide")[which], "config": c,
                                       "hopper": hopper, "us": 1e6 * t})
            except Exception as e:  # any failure (out of shared memory, ...) is recorded
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
    from ...attention.ops.triton.launch import Merge, launch_units, launch_worklist
    from ...attention.ops.triton.merge import merge_rows
    from ...attention.ops.triton.store import store_kv
    p, x, kern = be.current, be.current.extra, be.kernels
    launches = kern.launches(x)
    hq, d = row.q.shape[1:]
    rows = x["num_partials"]
    o_s = torch.empty((rows, hq, d), dtype=torch.float32, device=device)
    lse_s = torch.empty((rows, hq), dtype=torch.float32, device=device)
    out = torch.empty_like(row.q)
    idx = (p.kv_chunk, p.kv_lo, p.kv_hi, p.kv_pos)
    new_kv = (row.k, row.v, p.slots)
    # the store launch alone (which a decode step's attend units replace: `stores`)
    times = {"store_kv": timed(lambda: store_kv(row.k_cache, row.v_cache, row.k, row.v,
                                                p.slots), device)}
    for name, la in zip(("narrow", "wide"), launches, strict=True):
        if la.programs:  # (a merging narrow launch alone: its merge reads stale partials)
            merge = None if la.merge is None else Merge(la.merge[0], la.merge[1], o_s, lse_s, False)
            o, lse = (o_s, lse_s) if merge is None else (out, None)
            times[name] = timed(functools.partial(launch_units, row.q, row.k_cache, row.v_cache, p.q_pos,
                                                  la.units, la.count, *idx, row.shape.scale,
                                                  o, lse, la.cfg, la.causal, la.programs,
                                                  new_kv if la.stores else None, queue=la.queue,
                                                  merge=merge),
                                device)
            times[name + "_units"] = int(la.units.shape[0])
    times["both"] = timed(lambda: launch_worklist(row.q, row.k_cache, row.v_cache, p.q_pos,
                                                  launches, *idx, row.shape.scale, o_s, lse_s,
                                                  kern.side, new_kv, final=(out, None)), device)
    if not x["direct"] and not x["fused"]:
        times["merge"] = timed(lambda: merge_rows(o_s, lse_s, x["merge_indptr"],
                                                  x["merge_parts"], out, None), device)
    return {k: v if k.endswith("units") else round(1e6 * v, 2) for k, v in times.items()}
