"""`prefixserve bench kernels`: one decode step's attention, every backend against its limit and peers.

    command.py     the command: rows measured, JSON + PNG written (its docstring says what is measured)
    rows.py        a row: a batch of decoding sequences over a prefix tree, and the default grids
    timing.py      the ceilings (copy bandwidth, matrix rate) and timing a call (CUDA graph or eager)
    peers.py       sdpa, Hydragen as published and its variants; flashinfer.py: FlashInfer's kernels
    report.py      a row's verdicts, the summary, the printed table and the plot
    sweep.py       launch shapes of the attend kernel (--sweep)
    ab.py          `bench kernels-ab`: source trees' steps on the same rows, alternated on one
                   machine; ab_worker.py: one arm's process
"""

from .command import main, register

__all__ = ["main", "register"]
