"""Host -> device copies that never make the host wait for the device.

On CUDA a copy from pageable host memory waits for the stream's earlier work before it starts,
so a step's uploads would stall the host until the previous step's kernels finish, and the
engine could not prepare step t+1 while step t runs. Every per-step upload therefore goes
through pinned memory: a ring of pinned staging buffers, each filled by one step and reused
only after an event recorded behind that step's copies has fired (normally long since).

    step t:    fill ring[t % R] --copy_(non_blocking)--> device buffers ; event[t % R]
    step t+R:  event[t % R].synchronize() (already done) ; fill ring[t % R] again

On the CPU a plain copy does the same job.
"""

from __future__ import annotations

import numpy as np
import torch

_RING = 4


class Uploader:
    def __init__(self, device: torch.device, slot_bytes: int = 1 << 20):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._slots: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None] * _RING
        self._slot, self._used = 0, 0
        if self.cuda:
            self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
                           for _ in range(_RING)]

    def copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """dst.view(-1)[:src.size] = src (cast to dst's dtype), enqueued on the current stream."""
        n = src.size
        flat = dst.view(-1)[:n]
        if not self.cuda:
            flat.copy_(torch.from_numpy(np.ascontiguousarray(src).reshape(-1)))
            return
        staged = self._stage(n * dst.element_size()).view(dst.dtype)
        staged.numpy()[:] = src.reshape(-1)  # numpy casts (int64 -> int32 etc.)
        flat.copy_(staged, non_blocking=True)

    def fence(self) -> None:
        """Close the current staging buffer: it is reused once the copies enqueued so far ran."""
        if not self.cuda or self._used == 0:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._events[self._slot] = event
        self._slot, self._used = (self._slot + 1) % _RING, 0
        pending = self._events[self._slot]
        if pending is not None:
            pending.synchronize()
            self._events[self._slot] = None

    def _stage(self, nbytes: int) -> torch.Tensor:
        start = -(-self._used // 16) * 16  # 16-byte aligned views
        if start + nbytes > self._slots[self._slot].numel():
            self._grow(start + nbytes)
        self._used = start + nbytes
        return self._slots[self._slot][start:start + nbytes]

    def _grow(self, need: int) -> None:
        """A step needs more than the slot holds: wait for everything staged, then enlarge."""
        torch.cuda.current_stream(self.device).synchronize()
        size = max(need, 2 * self._slots[self._slot].numel())
        self._slots[self._slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
