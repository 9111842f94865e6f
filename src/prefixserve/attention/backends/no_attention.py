"""`no-attention`: Hydragen's "No Attention" ceiling, for throughput benchmarks only.

It writes the new K/V (so the cache traffic of a step is unchanged) and returns zeros instead
of attending: NOT exact, the model's outputs are meaningless. End-to-end throughput with it is
the upper bound that the exact backends are reported against.
"""

from __future__ import annotations

import torch

from ..base import AttentionBackend, AttentionBatch, register_backend
from ..ops.reference import store_kv


@register_backend("no-attention")
class NoAttentionBackend(AttentionBackend):
    slots: torch.Tensor | None = None  # [T] int64 on shape.device

    def plan(self, batch: AttentionBatch) -> None:
        self.slots = batch.slots.to(self.shape.device)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        store_kv(k_cache, v_cache, k, v, self.slots)
        return torch.zeros_like(q)
