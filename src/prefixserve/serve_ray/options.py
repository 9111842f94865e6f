"""`prefixserve serve --replicas N ...`: the scale-out flags and their frozen, validated config.
Importing this module imports no Ray: the single-process server reads these flags too."""

from __future__ import annotations

import argparse
import dataclasses

ROUTERS = ("prefix", "pow2")  # routers.py maps each to Ray's class


@dataclasses.dataclass(frozen=True)
class ScaleOutConfig:
    replicas: int
    router: str = "prefix"
    ray_address: str | None = None   # None: start a local Ray cluster, and stop it on exit
    cpus_per_replica: float = 1.0    # Ray's num_cpus for each replica; also its torch threads (at least 1)
    gpus_per_replica: float = 0.0    # Ray's num_gpus: a fraction shares a GPU, tensor-parallel takes several

    def __post_init__(self):
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"--replicas must be a positive integer, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if not self.cpus_per_replica >= 0:
            raise ValueError(f"--cpus-per-replica must be >= 0, got {self.cpus_per_replica!r}")
        if not self.gpus_per_replica >= 0:
            raise ValueError(f"--gpus-per-replica must be >= 0, got {self.gpus_per_replica!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ScaleOutConfig:
        gpus = args.gpus_per_replica
        if gpus is None:  # by default each replica reserves the GPUs its tensor-parallel ranks use
            gpus = float(args.tensor_parallel_size) if args.device == "cuda" else 0.0
        if 0 < gpus < 1 and args.kv_cache_memory is None:  # else the first takes 90% of the GPU
            raise ValueError(f"--gpus-per-replica {gpus:g} shares a GPU between replicas: give each its KV "
                             f"cache with --kv-cache-memory BYTES")
        return cls(args.replicas, args.router, args.ray_address, args.cpus_per_replica, gpus)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale out (Ray Serve; needs `pip install 'prefixserve[ray]'`)")
    g.add_argument("--replicas", type=int, default=None,
                   help="run N engine replicas as a Ray Serve application behind one endpoint "
                        "(default: one process, no Ray)")
    g.add_argument("--router", choices=ROUTERS, default="prefix",
                   help="prefix: Ray's PrefixCacheAffinityRouter (a request goes to the replica that saw "
                        "its prefix); pow2: Ray's default power of two choices")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or ray://HOST:10001) instead of starting a local one")
    g.add_argument("--cpus-per-replica", type=float, default=ScaleOutConfig.cpus_per_replica,
                   help="CPUs Ray reserves for each replica (fractions allowed); its torch threads")
    g.add_argument("--gpus-per-replica", type=float, default=None,
                   help="GPUs Ray reserves for each replica: 0.5 lets two share one GPU (give each "
                        "--kv-cache-memory), 2 for --tensor-parallel-size 2 (default: the tensor-parallel "
                        "size with --device cuda, else 0)")
