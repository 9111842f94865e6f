"""`prefixserve bench eviction`: the prefix tree's cost per allocation step against the number
of cached nodes, with the LRU heap (now) and with a scan of every node (before, kept here).

For each size N: a pool of N chunks, filled by N distinct one-chunk prompts, each released once
computed (N cached leaves). Each step then admits `--batch` new one-chunk prompts (each evicts
the least recently used leaf) and releases them, so the tree keeps N nodes: a step of a warm
cache whose pool is full. Timed two ways, on the same stream:

    heap  PrefixTree: the heap of evictable leaves, one `evict(n)` per allocation
    scan  the rule before issue 19: for each chunk the empty pool needs, a scan of every node
          for the least recently used evictable leaf (`ScanTree` below)

Both must end with the same nodes on the same chunks (checked). A step's cost is the median of
the thread's CPU time over `--steps` steps (not wall time: on a shared machine that counts the
waits for a core). The ratio scan / heap is the speed-up; the heap's cost per step stays flat
in N, the scan's grows linearly.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from ..kvcache.chunk_pool import ChunkPool, OutOfChunks
from ..kvcache.prefix_tree import PrefixTree
from . import results as R

ROWS = (("nodes", "nodes", "d"), ("scan us/step", "scan_us", ".1f"), ("heap us/step", "heap_us", ".1f"),
        ("scan / heap", "ratio", ".1f"))


def register(sub) -> None:
    p = sub.add_parser("eviction", help="prefix tree: time per allocation step vs cached nodes, heap vs scan",
                       description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=R.int_list, default=[250, 500, 1000, 2000, 4000, 8000],
                   help="cached nodes (= pool chunks) per run")
    p.add_argument("--steps", type=int, default=200, help="timed steps per size and tree")
    p.add_argument("--batch", type=int, default=8, help="chunks allocated (leaves evicted) per step")
    p.add_argument("--chunk-size", type=int, default=16, help="tokens per chunk (and per prompt)")
    p.add_argument("--out-dir", type=Path, default=R.DEFAULT_OUT_DIR, help="where the JSON and PNG go")
    p.add_argument("--tag", default="", help="appended to the file names")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.batch < 1 or args.chunk_size < 1 or min(args.sizes) < args.batch:
        raise ValueError("--steps, --batch and --chunk-size must be >= 1, and every size >= --batch")
    hw, load_start = R.hardware(), R.load_average()
    rows = [_row(n, args) for n in args.sizes]
    heap = [r["heap_us"] for r in rows]
    doc = {"bench": "eviction", "hardware": hw, "load_average": [load_start, R.load_average()],
           "steps": args.steps, "batch": args.batch, "chunk_size": args.chunk_size,
           "heap_largest_over_smallest": R.ratio(heap[-1], heap[0]), "results": rows}
    path = Path(args.out_dir) / ("-".join(["eviction", R.hardware_slug(hw)] + ([args.tag] if args.tag else [])) + ".json")
    R.print_table(rows, ROWS)
    print(f"heap cost, largest / smallest size: {doc['heap_largest_over_smallest']}")
    R.publish(doc, path, args, "prefixserve bench eviction", _plot)
    return 0


def _row(n: int, args: argparse.Namespace) -> dict:
    times, layouts = {}, {}
    for name, cls in (("scan", ScanTree), ("heap", PrefixTree)):
        tree = _full_tree(cls, n, args.chunk_size)
        times[name] = _time_steps(tree, n, args)
        layouts[name] = [(node.id, node.chunk_tuple()) for node in tree.iter_nodes()]
        del tree
    if layouts["scan"] != layouts["heap"]:
        raise RuntimeError(f"{n} nodes: the heap evicted other nodes than the scan")
    scan, heap = statistics.median(times["scan"]), statistics.median(times["heap"])
    return {"nodes": n, "scan_us": round(scan * 1e6, 2), "heap_us": round(heap * 1e6, 2), "ratio": R.ratio(scan, heap),
            "scan_mean_us": round(statistics.fmean(times["scan"]) * 1e6, 2),
            "heap_mean_us": round(statistics.fmean(times["heap"]) * 1e6, 2)}


def _full_tree(cls, n: int, chunk_size: int):
    """A tree whose pool of n chunks holds n cached one-chunk leaves."""
    tree = cls(ChunkPool(1, n, chunk_size, 1, 1, torch.float32, torch.device("cpu")))
    for i in range(n):
        tree.release(_admit(tree, i, chunk_size))
    assert len(tree.nodes) == n and tree.pool.num_free == 0
    return tree


def _admit(tree, i: int, chunk_size: int):
    """Prompt i (distinct first token, one chunk) in and computed; returns its held leaf."""
    leaf, _ = tree.insert([i] + [0] * (chunk_size - 1), chunk_size - 1)
    tree.mark_computed(leaf, leaf.end)
    return leaf


def _time_steps(tree, n: int, args: argparse.Namespace) -> list[float]:
    """CPU seconds per step: `batch` admissions (one chunk and one eviction each), then their release."""
    out, prompt = [], n
    gc.collect()
    for _ in range(args.steps):
        t0 = time.thread_time()
        leaves = []
        for _ in range(args.batch):
            leaves.append(_admit(tree, prompt, args.chunk_size))
            prompt += 1
        for leaf in leaves:
            tree.release(leaf)
        out.append(time.thread_time() - t0)
    return out


class ScanTree(PrefixTree):
    """Eviction as before issue 19: whenever the pool is empty and a chunk is needed, scan every
    node for the unreferenced, unpinned, childless one with the least (last_use, id). Also the
    reference tests/kvcache/test_eviction_scale.py holds the heap to, node for node."""

    evicted = 0  # nodes removed for want of chunks

    def _alloc_many(self, n: int) -> list[int]:
        got = []
        try:
            for _ in range(n):
                while not self.pool.num_free:
                    victims = [v for v in self.nodes.values() if not (v.ref or v.pins or v.children)]
                    if not victims:
                        raise OutOfChunks
                    self._remove(min(victims, key=lambda v: (v.last_use, v.id)))
                    self.evicted += 1
                got.append(self.pool.allocate())
        except OutOfChunks:
            for c in reversed(got):
                self.pool.free(c)
            raise
        return got


def _plot(doc: dict, path: Path) -> None:
    from .plots import _pyplot
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    nodes = [r["nodes"] for r in doc["results"]]
    for key, label, color in (("scan_us", "scan every node per chunk (before)", "0.45"),
                              ("heap_us", "heap of evictable leaves (now)", "tab:blue")):
        ax.plot(nodes, [r[key] for r in doc["results"]], marker="o", color=color, label=label)
    ax.set(xscale="log", yscale="log", xlabel="cached nodes (pool full)",
           ylabel=f"us per step ({doc['batch']} chunks, {doc['batch']} evictions)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    hw = doc["hardware"]
    fig.suptitle(f"prefix tree eviction: median step cost - {hw['name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
