"""Tensor parallelism: which slice of each weight a rank holds, and the two collectives.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its heads / its
part of the intermediate size), o and down are row-parallel (partial sums all-reduced), the
embedding and LM head are split by vocabulary. So attention works on a rank's own KV heads
with no change to the math, and the prefix tree and attention plan are the same on every rank.

The group also says how this rank's products and sums are computed: `invariant` (deterministic
mode) makes every row's bits independent of the rows beside it -- linear layers go through
`fused.linear.invariant_linear`, and the all-reduce of 3+ ranks adds the partial sums in rank
order (NCCL's ring and tree orders follow the message size, so the batch; two ranks need
nothing: a + b == b + a exactly). The gather is a concatenation: exact either way.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

# HF weight-name fragment -> the dim split across ranks (0: rows / output, 1: columns / input)
_SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
              "o_proj": 1, "down_proj": 1, "embed_tokens": 0, "lm_head": 0}


def check_divides(cfg, size: int) -> None:
    """ValueError unless `size` ranks can split this model (a ModelConfig) evenly."""
    for what in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        if getattr(cfg, what) % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {what} ({getattr(cfg, what)})")


@dataclasses.dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    invariant: bool = False  # deterministic mode: batch-invariant products and rank-ordered sums

    def part(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, features, vocabulary rows)."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide {what} ({n})")
        return n // self.size

    def shard(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full HF-named weight (norms are replicated)."""
        if self.size == 1:
            return tensor
        for frag, dim in _SPLIT_DIM.items():
            if f"{frag}." in hf_name:
                if tensor.dim() == 1 and dim == 1:  # a row-parallel bias is added once, on rank 0
                    return tensor if self.rank == 0 else torch.zeros_like(tensor)
                return tensor.chunk(self.size, dim=dim)[self.rank]
        return tensor

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant and self.size > 2:  # rank 0's part + rank 1's + ..., in that order
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous())
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return x.copy_(total)
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank-major."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
