"""`auto` (the default): per step, the exact backend whose schedule the cost model rates cheapest.

The model is `cost.CostModel.for_device(shape.device)` (bytes and FLOPs per schedule, roofline
time plus per-item and per-launch overheads; see cost.py). Ties go to the earlier candidate, so
with nothing shared it is `paged`. The choice is re-made only when the batch's structure
changed (`plan.batch_key`), and logged at debug level.
"""

from __future__ import annotations

import logging

import torch

from ..base import AttentionBackend, AttentionBatch, AttentionShape, register_backend
from ..cost import CostModel, schedule_cost
from ..plan import batch_key
from ..schedule import SCHEDULES
from .chunk import ChunkBackend
from .hydragen import HydragenBackend
from .paged import PagedBackend
from .relay import RelayBackend

logger = logging.getLogger(__name__)


@register_backend("auto")
class AutoBackend(AttentionBackend):
    def __init__(self, shape: AttentionShape, model: CostModel | None = None):
        super().__init__(shape)
        self.model = model or CostModel.for_device(shape.device)
        self.candidates = {b.name: b(shape) for b in
                           (PagedBackend, RelayBackend, HydragenBackend, ChunkBackend)}
        self.chosen: str | None = None
        self._key: tuple | None = None

    def plan(self, batch: AttentionBatch) -> None:
        key = batch_key(batch)
        if key == self._key:
            self.candidates[self.chosen].plan(batch)  # exact reuse inside the plan cache
            return
        scheds = {name: SCHEDULES[name](batch) for name in self.candidates}
        times = {name: self.model.time(schedule_cost(s, self.shape)) for name, s in scheds.items()}
        self.chosen = min(times, key=times.get)
        self._key = key
        logger.debug("auto attention: %s (%s)", self.chosen,
                     ", ".join(f"{n} {t * 1e6:.1f}us" for n, t in times.items()))
        self.candidates[self.chosen].plan_schedule(batch, scheds[self.chosen])

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.candidates[self.chosen].run(q, k, v, k_cache, v_cache)
