"""The shared plan/run of the exact backends: a backend is a schedule (see `schedule.py`).

plan(): schedule the batch and bring its index tensors up to date on `shape.device`
(`plan.PlanCache`, plus the executor's extras). run(): write the new K/V, run every work item,
merge the partials of each query row if the schedule needs it, in q's dtype. The ops come
from an executor picked by device (`ops.kernels_for`: Triton kernels on CUDA, the PyTorch
reference elsewhere); tests pass one explicitly. Since every backend runs the same executor on
a plan, a CUDA graph captured with one schedule replays correctly with any other.

Deterministic mode (`shape.cell`): every schedule is re-cut into key cells (`cells.py`) and
the executor runs them with one inner loop, so all backends give a row the same bits. A decode
step whose new key opens a cell is rebuilt rather than advanced (its row needs a new partial).

A model with sliding layers (`shape.sliding_window`) gets a second plan per step, of the
batch cut to the window (`window.windowed`), with its own cache and executor (so that the
two plans' CUDA-graph state stays apart); `run(..., window=W)` runs that one. Without sliding
layers nothing of this exists: no second plan, no extra host work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base import AttentionBackend, AttentionBatch, AttentionShape
from ..cells import cells, crosses
from ..ops import Executor, kernels_for
from ..plan import DevicePlan, PlanCache
from ..schedule import Schedule
from ..window import windowed


class ScheduledBackend(AttentionBackend):
    schedule: Callable[[AttentionBatch], Schedule]  # set by each subclass (a staticmethod)

    def __init__(self, shape: AttentionShape, kernels: Executor | None = None,
                 window_kernels: Executor | None = None) -> None:
        """kernels, window_kernels: executors of the full and the windowed plans (default:
        `ops.kernels_for(shape)`; tests pass their own)."""
        super().__init__(shape)
        self.kernels = kernels or kernels_for(shape)
        self.cache = PlanCache(shape.device, self.kernels.plan_extra)
        self.current: DevicePlan | None = None
        self.window = shape.sliding_window
        if self.window is not None:
            self.window_kernels = window_kernels or kernels_for(shape)
            self.window_cache = PlanCache(shape.device, self.window_kernels.plan_extra)
            self.window_plan: DevicePlan | None = None

    def make_schedule(self, batch: AttentionBatch) -> Schedule:
        return self.finish(self.schedule(batch), batch)

    def finish(self, sched: Schedule, batch: AttentionBatch) -> Schedule:
        """A backend's schedule as it runs: cut into key cells in deterministic mode."""
        return sched if self.shape.cell is None else cells(sched, batch, self.shape.cell)

    def plan(self, batch: AttentionBatch) -> None:
        self.current = self.cache.get(batch, lambda: self.make_schedule(batch))
        if self.window is not None:
            cut = windowed(batch, self.window)
            self.window_plan = self.window_cache.get(cut, lambda: self.make_schedule(cut))

    @property
    def generation(self) -> int:
        gen = self.cache.generation + self.kernels.generation
        if self.window is not None:
            gen += self.window_cache.generation + self.window_kernels.generation
        return gen

    def can_advance(self) -> bool:
        ok = self.cache.can_advance and (self.window is None or self.window_cache.can_advance)
        if ok and self.shape.cell is not None:
            ok = not crosses(self.cache.next_positions(), self.shape.cell)
        return ok

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None = None,
            kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        s = self.shape
        assert window == s.sliding_window or window is None, (window, s.sliding_window)
        p, kernels = (self.current, self.kernels) if window is None else (
            self.window_plan, self.window_kernels)
        assert p is not None, "plan() before run()"
        assert q.shape == (p.slots.numel(), s.num_heads, s.head_dim), q.shape
        return kernels.run(q, k, v, k_cache, v_cache, p, s.scale, window, kv_scale)
