"""The report of `prefixserve bench kernels`: per-row comparisons, the summary, the table, the PNG.

Every comparison is made twice: against the issue's peers (PEERS: sdpa, hydragen-pub,
flashinfer-decode, flashinfer-cascade; the bars are judged on these) and against every peer
measured (ALL_PEERS, adding hydragen-cudnn and hydragen-efficient: keys `*_incl_cudnn`), so the
strongest peer's number is always in the report. Only peers whose output was right (`counted`)
are compared. A bar is null where its grid was not run or a row of it had no peer to compare.

The bars (issue 25), judged on the 16-bit rows; `table3-fp8` / `hydragen-fp8` rows are judged
against their 16-bit twins (`fp8_over_16bit`) and FlashInfer's fp8 decode:

    table3_limit30_within_1.10x        geomean over Table 3's rows whose limit is >= 30 us
    table3_all_shared_within_2x        rows with n_s = n_p: time <= 2 x (limit + graph_launch_us)
    table3_no_row_slower_than_best_peer
    hydragen_within_1.4x, hydragen_flop_rows_70pct_matrix (FLOP-bound rows' FLOPs / time >= 0.7 x
    the measured matrix rate), hydragen_2x_vs_best_peer
    fp8_bytes_rows_within_0.6x         every bytes-bound fp8 row <= 0.6 x its 16-bit twin
    fp8_ahead_of_flashinfer            no fp8 row slower than FlashInfer's fp8 (where counted)
    auto_within_5pct
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

from .peers import ALL_PEERS, PEERS

BACKENDS = ("paged", "relay", "hydragen", "chunk", "auto")
PEER_SETS = {"": PEERS, "_incl_cudnn": ALL_PEERS}  # key suffix -> peers compared


def finish_row(res: dict) -> None:
    """Ratios to the limit, the best exact backend, auto over it, and the speedup over the best
    counted peer of each peer set."""
    lim = res["limit_us"]
    exact = {k: v["us"] for k, v in res["backends"].items() if k != "auto"}
    best = min(exact, key=exact.__getitem__)
    for v in [*res["backends"].values(), *res["peers"].values()]:
        if "us" in v:
            v["ratio_to_limit"] = v["us"] / lim
    res["best_backend"], res["best_us"] = best, exact[best]
    res["ratio_to_limit"] = exact[best] / lim
    res["auto_over_best"] = res["backends"]["auto"]["us"] / exact[best]
    for suffix, names in PEER_SETS.items():
        peers = {k: res["peers"][k]["us"] for k in names if res["peers"].get(k, {}).get("counted")}
        if peers:
            p = min(peers, key=peers.__getitem__)
            res["best_peer" + suffix], res["best_peer_us" + suffix] = p, peers[p]
            res["speedup_vs_best_peer" + suffix] = peers[p] / exact[best]


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def grid_stats(rows: list[dict]) -> dict:
    """One grid's rows: geomean ratio to the limit, rows slower than the best peer, the smallest
    speedup over it, rows with no counted peer -- for each peer set."""
    s: dict[str, Any] = {"rows": len(rows), "geomean_ratio_to_limit": _geomean([r["ratio_to_limit"] for r in rows])}
    for suffix in PEER_SETS:
        key = "speedup_vs_best_peer" + suffix
        s["rows_worse_than_best_peer" + suffix] = [r["label"] for r in rows if r.get(key, 1) < 1]
        s["min_speedup_vs_best_peer" + suffix] = min((r[key] for r in rows if key in r), default=None)
        s["rows_without_peer" + suffix] = [r["label"] for r in rows if key not in r]
    return s


def _judged(g: dict[str, Any] | None, sfx: str) -> dict[str, Any] | None:
    """A grid's stats where its peer bars can be judged (it ran, every row had a peer), else None."""
    return g if g is not None and not g["rows_without_peer" + sfx] else None


def _all(xs: list[bool]) -> bool | None:
    return all(xs) if xs else None


def _rows_bars(rows: list[dict], ceil: dict[str, float] | None) -> dict[str, Any]:
    """The bars judged row by row (module docstring); None where no row or ceiling applies."""
    t3 = [r for r in rows if r["grid"] == "table3"]
    long = [r["ratio_to_limit"] for r in t3 if r["limit_us"] >= 30]
    launch = ceil.get("graph_launch_us") if ceil else None
    all_shared = [r["best_us"] <= 2 * (r["limit_us"] + launch) for r in t3
                  if launch is not None and sum(r["shared"]) == r["context"]]
    rate = ceil.get("matrix_rate") if ceil else None
    flop_rows = [r["flops"] / (r["best_us"] * 1e-6) >= 0.7 * rate for r in rows
                 if rate and r["grid"] == "hydragen" and r["bound"] == "flops"]
    fp8 = [r for r in rows if r["grid"].endswith("-fp8")]
    long_geomean = _geomean(long)
    return {"table3_limit30_geomean_ratio": long_geomean,
            "bars": {"table3_limit30_within_1.10x": None if long_geomean is None else long_geomean <= 1.10,
                     "table3_all_shared_within_2x": _all(all_shared),
                     "hydragen_flop_rows_70pct_matrix": _all(flop_rows),
                     "fp8_bytes_rows_within_0.6x": _all([r["fp8_over_16bit"] <= 0.6 for r in fp8
                                                         if r["bound"] == "bytes" and "fp8_over_16bit" in r]),
                     "fp8_ahead_of_flashinfer": _all([r["speedup_vs_best_peer"] >= 1 for r in fp8
                                                      if "speedup_vs_best_peer" in r])}}


def pair_fp8(rows: list[dict]) -> None:
    """Each fp8 row's best time over its 16-bit twin's (same grid and workload), where both ran."""
    wide = {(r["grid"], r["label"]): r for r in rows if not r["grid"].endswith("-fp8")}
    for r in rows:
        twin = wide.get((r["grid"].removesuffix("-fp8"), r["label"].removesuffix(" fp8")))
        if r["grid"].endswith("-fp8") and twin is not None:
            r["fp8_over_16bit"] = r["best_us"] / twin["best_us"]


def _bars(t3: dict[str, Any] | None, hy: dict[str, Any] | None, auto_max: float | None) -> dict[str, bool | None]:
    """The grid-level bars, and beside each peer bar the same bar against every peer."""
    bars: dict[str, Any] = {"hydragen_within_1.4x": hy and hy["geomean_ratio_to_limit"] <= 1.4,
                            "auto_within_5pct": None if auto_max is None else auto_max <= 1.05}
    for sfx in PEER_SETS:
        t3_j, hy_j = _judged(t3, sfx), _judged(hy, sfx)
        bars["table3_no_row_slower_than_best_peer" + sfx] = (
            None if t3_j is None else not t3_j["rows_worse_than_best_peer" + sfx])
        bars["hydragen_2x_vs_best_peer" + sfx] = (
            None if hy_j is None else hy_j["min_speedup_vs_best_peer" + sfx] >= 2)
    return {k: (None if v is None else bool(v)) for k, v in bars.items()}


def summarize(rows: list[dict], ceil: dict[str, float] | None = None) -> dict:
    """Per-grid stats and the bars; `ceil`: the run's ceilings (the launch and matrix-rate bars)."""
    pair_fp8(rows)
    grids = {g: grid_stats([r for r in rows if r["grid"] == g])
             for g in dict.fromkeys(r["grid"] for r in rows)}
    t3, hy = grids.get("table3"), grids.get("hydragen")
    get = lambda g, k: g[k] if g else None  # noqa: E731
    s: dict[str, Any] = {"peers": list(PEERS), "peers_incl_cudnn": list(ALL_PEERS),
                         "table3_geomean_ratio_to_limit": get(t3, "geomean_ratio_to_limit"),
                         "hydragen_geomean_ratio_to_limit": get(hy, "geomean_ratio_to_limit")}
    for sfx in PEER_SETS:
        s["table3_rows_worse_than_best_peer" + sfx] = get(t3, "rows_worse_than_best_peer" + sfx)
        s["hydragen_min_speedup_vs_best_peer" + sfx] = get(hy, "min_speedup_vs_best_peer" + sfx)
    s["auto_max_over_best"] = max((r["auto_over_best"] for r in rows), default=None)
    by_row = _rows_bars(rows, ceil)
    s["table3_limit30_geomean_ratio"] = by_row["table3_limit30_geomean_ratio"]
    s["fp8_over_16bit"] = {r["label"]: r["fp8_over_16bit"] for r in rows if "fp8_over_16bit" in r}
    s["bars"] = {**_bars(t3, hy, s["auto_max_over_best"]), **by_row["bars"]}
    s["grids"] = grids
    return s


TABLE_PEERS = {"sdpa": "sdpa", "hydragen-pub": "hyd-pub", "hydragen-cudnn": "hyd-cdnn",
               "flashinfer-decode": "fi-dec", "flashinfer-cascade": "fi-casc"}


def print_table(rows: list[dict]) -> None:
    """us per backend and peer ('-': did not run; '!': ran, wrong output), best backend over
    the limit, speedup over the best peer (issue's set) and over every peer."""
    print(f"{'grid':8} {'row':24} {'limit':>8} {'bd':>2} " + " ".join(f"{b:>8}" for b in BACKENDS)
          + f" {'best/lim':>8} " + " ".join(f"{p:>8}" for p in TABLE_PEERS.values())
          + f" {'vs peer':>7} {'vs all':>7}")
    for r in rows:
        us = " ".join(f"{r['backends'][b]['us']:8.1f}" for b in BACKENDS)
        peers = " ".join(_peer_cell(r["peers"].get(p, {})) for p in TABLE_PEERS)
        print(f"{r['grid']:8} {r['label']:24} {r['limit_us']:8.1f} {r['bound'][0]:>2} {us} "
              f"{r['ratio_to_limit']:8.2f} {peers} {r.get('speedup_vs_best_peer', math.nan):7.2f} "
              f"{r.get('speedup_vs_best_peer_incl_cudnn', math.nan):7.2f}")


def _peer_cell(p: dict) -> str:
    if "us" not in p:
        return f"{'-':>8}"
    return f"{p['us']:8.1f}" if p["counted"] else f"{p['us']:7.1f}!"


def plot(rows: list[dict], path: pathlib.Path, device_name: str) -> None:
    """Per grid, one bar per backend and counted peer per row: time over the limit (log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grids = list(dict.fromkeys(r["grid"] for r in rows))
    fig, axes = plt.subplots(len(grids), 1, figsize=(16, 4.5 * len(grids)), squeeze=False)
    names = [*BACKENDS, *ALL_PEERS]
    width = 0.8 / len(names)
    for ax, grid in zip(axes[:, 0], grids, strict=True):
        rs = [r for r in rows if r["grid"] == grid]
        for j, name in enumerate(names):
            entries = [r["backends"].get(name) or r["peers"].get(name) or {} for r in rs]
            vals = [e.get("ratio_to_limit", math.nan) if e.get("counted", True) else math.nan
                    for e in entries]
            ax.bar([i + j * width for i in range(len(rs))], vals, width, label=name,
                   hatch="//" if name in ALL_PEERS else None)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks([i + 0.4 for i in range(len(rs))], [r["label"] for r in rs], rotation=30,
                      ha="right", fontsize=7)
        ax.set_ylabel("time / limit")
        ax.set_title(f"{grid}: decode attention, time over max(bytes/BW, FLOPs/rate) -- {device_name}")
        ax.legend(fontsize=7, ncol=(len(names) + 1) // 2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
