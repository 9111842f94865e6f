"""`auto` (the default): per step, the exact schedule the cost model rates cheapest.

The model is `cost.CostModel.for_device(shape.device)` (bytes and FLOPs per schedule, roofline
time plus per-item and per-launch overheads; see cost.py). Ties go to the earlier candidate, so
with nothing shared it is `paged`. The choice is re-made only when the plan is rebuilt (the
batch's structure changed, `plan.PlanCache`); decode steps that advance the last plan keep it.
It is logged at debug level. Every candidate runs through the same executor and plan buffers.
"""

from __future__ import annotations

import logging

from ..base import AttentionBatch, AttentionShape
from ..cost import CostModel, schedule_cost
from ..ops import Executor
from ..registry import register_backend
from ..schedule import SCHEDULES, Schedule
from .scheduled import ScheduledBackend

logger = logging.getLogger(__name__)

CANDIDATES = ("paged", "relay", "hydragen", "chunk")


@register_backend("auto")
class AutoBackend(ScheduledBackend):
    def __init__(self, shape: AttentionShape, kernels: Executor | None = None,
                 model: CostModel | None = None, window_kernels: Executor | None = None) -> None:
        super().__init__(shape, kernels, window_kernels)
        self.model = model or CostModel.for_device(shape.device)
        self.chosen: str | None = None

    def make_schedule(self, batch: AttentionBatch) -> Schedule:
        scheds = {name: self.finish(SCHEDULES[name](batch), batch) for name in CANDIDATES}
        times = {name: self.model.time(schedule_cost(s, self.shape)) for name, s in scheds.items()}
        self.chosen = min(times, key=times.__getitem__)
        logger.debug("auto attention: %s (%s)", self.chosen,
                     ", ".join(f"{n} {t * 1e6:.1f}us" for n, t in times.items()))
        return scheds[self.chosen]
