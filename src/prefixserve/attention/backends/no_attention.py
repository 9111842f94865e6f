"""`no-attention`: Hydragen's "No Attention" ceiling, for throughput benchmarks only.

It writes the new K/V (so the cache traffic of a step is unchanged) and returns zeros instead
of attending: NOT exact, the model's outputs are meaningless. End-to-end throughput with it is
the upper bound that the exact backends are reported against.
"""

from __future__ import annotations

import numpy as np
import torch

from ...staging import Uploader
from ..base import AttentionBackend, AttentionBatch, AttentionShape
from ..ops.reference import store_kv
from ..registry import register_backend


@register_backend("no-attention")
class NoAttentionBackend(AttentionBackend):
    def __init__(self, shape: AttentionShape) -> None:
        super().__init__(shape)
        self.uploader = Uploader(shape.device)
        self._buf = torch.empty(0, dtype=torch.int64, device=shape.device)
        self._moves = 0
        self.slots: torch.Tensor | None = None  # [R] int64, a view of _buf (stable address)

    @property
    def generation(self) -> int:
        return self._moves

    def can_advance(self) -> bool:
        return True

    def plan(self, batch: AttentionBatch) -> None:
        slots = batch.slots.numpy()
        if batch.padded is not None:
            pad = batch.padded
            slots = np.concatenate([slots, np.full(pad.rows - len(slots), pad.pad_slot)])
        if self._buf.numel() < len(slots):
            self._buf = torch.empty(max(16, 2 * len(slots)), dtype=torch.int64, device=self.shape.device)
            self._moves += 1
        self.slots = self._buf[:len(slots)]
        self.uploader.copy(self.slots, slots)
        self.uploader.fence()

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None = None,
            kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        assert self.slots is not None, "plan() before run()"
        store_kv(k_cache, v_cache, k, v, self.slots, kv_scale)
        return torch.zeros_like(q)
