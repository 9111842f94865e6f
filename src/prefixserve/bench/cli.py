"""`prefixserve bench kernels | kernels-ab | gemm | moe | throughput | serve | side-channel | eviction |
determinism | kv-accuracy`: each a module with `register(subparsers)`."""

from __future__ import annotations

import importlib

BENCHMARKS = ("prefixserve.bench.kernels", "prefixserve.bench.kernels.ab", "prefixserve.bench.gemm",
              "prefixserve.bench.moe", "prefixserve.bench.throughput", "prefixserve.bench.serving",
              "prefixserve.bench.side_channel", "prefixserve.bench.eviction", "prefixserve.bench.determinism",
              "prefixserve.bench.kv_accuracy")


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: attention kernels (and an A/B of source trees), "
                                          "deterministic GEMM, MoE op, offline throughput, online serving, "
                                          "side channel, eviction, determinism, fp8 KV accuracy",
                           description="Benchmarks. Each prints a short table and writes JSON + PNG "
                                       "under benchmarks/results/, named by workload, model and hardware "
                                       "(kernels-ab, an A/B for developers, prints its table only).")
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for mod in BENCHMARKS:
        importlib.import_module(mod).register(bsub)
