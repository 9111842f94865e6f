"""PyTorch twin of `linear_triton.linear`: y = x W^T (+ b) whose rows do not depend on how many
rows there are (deterministic mode's GEMM on the CPU, and the oracle of the kernel).

A CPU BLAS picks its blocking, its threads' split and sometimes its kernel by the shape, so
one row's bits change with the number of rows (fp32 and bf16 alike, measured with torch
2.13's CPU build: for K 576 to 11008 most row counts from 1 to 2,048 differ from the others).
The same product on a fixed shape is the same computation every time, and a row's result
does not depend on where in the block it sits (measured over offsets). So rows go through the
BLAS in blocks of ROWS, the last one padded with zero rows: every row of every call is row r
of some [ROWS, K] x [K, N] product. The bias is added after, elementwise: with it inside the
product (addmm) one CPU's BLAS (the lent GPU machine's) gave a row other bits at another place in
its block.

A 16-bit product runs as the fp32 product of its values (each exact in fp32), rounded once to the
16-bit type, as a 16-bit GEMM accumulates in fp32 and rounds its output: the same fixed
blocks, and on a CPU without bf16 instructions (an AVX2-only AMD EPYC) torch's own bf16 CPU
GEMM took 21x the fp32 one's time (16 x 576 x 1,536: 24.5 vs 1.1 ms), which made deterministic
mode's bf16 test run 20 minutes there.
"""

from __future__ import annotations

import torch
from torch import nn

ROWS = 16  # rows per product: small, so a decode step pads little


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype; weight: [N, K]; bias: [N] or None."""
    *lead, k = x.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    pad = -m % ROWS
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    if x2.dtype in (torch.bfloat16, torch.float16):  # (the weight widened once a call)
        x2, weight = x2.float(), weight.float()
    y = (torch.cat([nn.functional.linear(x2[i:i + ROWS], weight) for i in range(0, m + pad, ROWS)])
         if m else x2.new_empty(0, weight.shape[0])).to(x.dtype)
    y = y[:m] if bias is None else y[:m] + bias
    return y.reshape(*lead, weight.shape[0])
