"""Triton twin of `race.seeded_race`: one program a row walks its probabilities in blocks,
hashes each token's noise in registers and keeps the running (largest ratio, its first token).

Bit for bit the twin's values: the hash in uint32 (wrapping products and sums are the twin's
`& M32`), u in fp64 (exact: a 32-bit word + 0.5, times 2^-32), -ln u in fp64 rounded to fp32,
and the ratio divided correctly rounded (`div_rn`). ln is libdevice's when compiled, the one
torch's CUDA log calls; numpy's in the interpreter (torch's CPU log is SLEEF's: the two may
differ in the last bit of fp64, which the fp32 rounding hides but at a rounding boundary).
Ties go to the lowest token, within a block (`tie_break_left`) and across blocks (a later
block must be strictly larger). Compiled with enable_fp_fusion=False: no multiply-add may
round once where the twin rounds twice.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))
_BLOCK = 2048


@triton.jit
def _pcg(x):
    """The PCG output hash of uint32 words (`race.pcg_`)."""
    state = x * 747796405 + 2891336453
    word = ((state >> ((state >> 28) + 4)) ^ state) * 277803737
    return (word >> 22) ^ word


@triton.jit
def _neg_log(u):
    if _INTERPRETED:
        return -tl.log(u)
    else:
        return -libdevice.log(u)


@triton.jit
def _race_kernel(winners, probs, keys, stride_p, vocab, BLOCK: tl.constexpr):
    # One program per row r: winners[r] = the first t of max_t probs[r, t] / E(keys[r], t).
    r = tl.program_id(0).to(tl.int64)
    key = tl.load(keys + r).to(tl.uint32)
    best = tl.full([], -1.0, tl.float32)  # every ratio is >= 0: the first block wins
    best_t = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        t = start + tl.arange(0, BLOCK)
        ok = t < vocab
        p = tl.load(probs + r * stride_p + t, mask=ok, other=0.0)
        u = (_pcg(key + t.to(tl.uint32)).to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2^-32
        e = tl.maximum(_neg_log(u).to(tl.float32), 1.1754943508222875e-38)  # fp32's tiny
        ratio = tl.where(ok, tl.math.div_rn(p, e), -1.0)
        top = tl.max(ratio, axis=0)
        at = tl.argmax(ratio, axis=0, tie_break_left=True)
        take = top > best
        best_t = tl.where(take, start + at, best_t)
        best = tl.where(take, top, best)
    tl.store(winners + r, best_t.to(tl.int64))


def seeded_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Twin of `race.seeded_race`: probs [R, V] fp32 (last dim contiguous), keys [R] -> [R]."""
    assert probs.stride(-1) == 1 and keys.is_contiguous() and probs.device == keys.device
    winners = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    if probs.shape[0]:
        _race_kernel[(probs.shape[0],)](winners, probs, keys, probs.stride(0), probs.shape[1],
                                        BLOCK=_BLOCK, num_warps=8, enable_fp_fusion=False)
    return winners
