"""The start-up heap kept out of the cyclic garbage collector's way.

A full (generation 2) collection walks every tracked object, and after start-up most of them
are the modules' and the model's: torch, transformers, Triton's compiled kernels -- 316K
objects with the embedded model on the CPU (a full collection 52-69 ms). On an H200, in the
end-to-end benchmark's runs (Llama-2-7B dims, 1,024 samples of a 16K prompt), a run's 1-2
full collections took 204-297 ms each, and the step that waited for one 221-340 ms against a
median of 26-54; with the start-up heap frozen its 4 full collections took 6-14 ms each, and
the no-attention ceiling's run 9-11% less time (kernels-notes.md, issue 25 part
thirty-four). So each process that steps the model freezes its heap once it is built, as
vLLM does after its start-up: the frozen objects stay out of later collections. Reference
counting still frees them; only cycles among them wait until they are unfrozen: a closing
engine unfreezes (its cycles then go with the next full pass), and a starting one thaws
before it takes memory, so that the cycles that an engine dropped without `close` left frozen
(a notebook's first LLM, say) are collected before the next one allocates its KV pool (a
process may build several engines in turn: the benchmarks do).
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


def thaw() -> None:
    """`unfreeze`, then collect."""
    unfreeze()
    gc.collect()
