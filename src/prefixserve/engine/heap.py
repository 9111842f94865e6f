"""The start-up heap kept out of the cyclic garbage collector's way.

A full (generation 2) collection walks every tracked object, and after start-up most of them
are the modules' and the model's: torch, transformers, Triton's compiled kernels -- 316K
objects with the embedded model on the CPU (a full collection 52-69 ms). On an H200, in the
end-to-end benchmark's runs (Llama-2-7B dims, 1,024 samples of a 16K prompt), each of a run's
1-2 full collections made one step take 245-340 ms against a median of 26-54 (the first
config of a process collected twice and read 5% slower than its second run); with the
start-up heap frozen, the steps past 1.5x the median were the first three and the graph
captures only (kernels-notes.md, issue 25 part thirty-four). So each process that steps the model
freezes its heap once it is built, as vLLM does after its start-up: the frozen objects stay
out of later collections. Reference counting still frees them; only cycles among them wait
for `unfreeze`, which a closing engine calls, so that the cycles of what it held are
collected (a process may build several engines in turn: the benchmarks do).
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect what start-up left, then freeze every object still tracked."""
    gc.collect()
    gc.freeze()


def unfreeze() -> None:
    """Give the frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()
