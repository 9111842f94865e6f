"""The shared plan/run of the exact backends: a backend is a schedule (see `schedule.py`).

plan(): schedule the batch and bring its index tensors up to date on `shape.device`
(`plan.PlanCache`, plus the executor's extras). run(): write the new K/V, run every work item,
merge the partials of each query row if the schedule needs it, in q's dtype. The ops come
from an executor picked by device (`ops.kernels_for`: Triton kernels on CUDA, the PyTorch
reference elsewhere); tests pass one explicitly. Since every backend runs the same executor on
a plan, a CUDA graph captured with one schedule replays correctly with any other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base import AttentionBackend, AttentionBatch, AttentionShape
from ..ops import kernels_for
from ..plan import DevicePlan, PlanCache
from ..schedule import Schedule


class ScheduledBackend(AttentionBackend):
    schedule: Callable[[AttentionBatch], Schedule]  # set by each subclass (a staticmethod)

    def __init__(self, shape: AttentionShape, kernels=None):
        super().__init__(shape)
        self.kernels = kernels or kernels_for(shape)
        self.cache = PlanCache(shape.device, self.kernels.plan_extra)
        self.current: DevicePlan | None = None

    def make_schedule(self, batch: AttentionBatch) -> Schedule:
        return self.schedule(batch)

    def plan(self, batch: AttentionBatch) -> None:
        self.current = self.cache.get(batch, lambda: self.make_schedule(batch))

    @property
    def generation(self) -> int:
        return self.cache.generation + self.kernels.generation

    def can_advance(self) -> bool:
        return self.cache.can_advance

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        p, s = self.current, self.shape
        assert p is not None, "plan() before run()"
        assert q.shape == (p.slots.numel(), s.num_heads, s.head_dim), q.shape
        return self.kernels.run(q, k, v, k_cache, v_cache, p, s.scale)
