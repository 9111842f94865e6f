"""Scales of an fp8 KV cache: one power of two per layer, KV head, and K or V, fixed at start-up.

An e4m3 value holds 3 mantissa bits over a range of 2^-9 .. 448, so K and V are stored as
x / scale and read back as q8 * scale (`attention.ops.reference`). The scales are:

- per layer and KV head: the granularity the kernels apply for free (the K scale joins the
  score scale, the V scale multiplies the output), where per-token scales would cost a load
  and a multiply per key;
- fixed for the engine's life, measured by the first store of every layer: a forward over a
  built-in calibration text at start-up, before any request. A scale that moved later would
  misread every value stored under the old one; one taken from the first request's K/V would
  make every later request's outputs depend on that request (what one tenant sent would
  show in another's tokens) and on arrival order (batched or alone would differ);
- powers of two, the smallest >= HEADROOM x the calibration's |max| / 448: multiplying by
  them is exact, so scaling keys, scores or outputs gives the same numbers, and the CPU twin
  and the kernels agree on every stored byte. Values above 448 x scale (HEADROOM x the
  calibration's largest, at least) saturate; the headroom costs nothing but the smallest
  values' precision (subnormal below 2^-6 x scale: under 2^-13 of the calibration's largest).
  Measured on the embedded model: over 40 ShareGPT prompts, the largest |K| or |V| of a layer
  and head reached 2.05x the calibration's (K 1.65x), under the headroom of 4.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from ..attention import create_backend
from ..attention.base import AttentionBatch, AttentionShape, Segment, SeqQueries
from ..attention.ops.reference import FP8_MAX
from .chunk_pool import ChunkPool

if TYPE_CHECKING:
    from ..model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
HEADROOM = 4.0
CALIBRATION_SEED = 0  # token ids drawn with it when the model has no tokenizer

# Prose, a list, code and numbers: the kinds of text a serving engine sees. Fixed: the scales
# (and so every output) must not depend on anything a request sends.
CALIBRATION_TEXT = """\
The river rose through the night, and by morning the lower town had become a lake. People \
carried what they could to the church on the hill: bread, blankets, a clock, the school's \
register. Nobody spoke much. "It has happened before," the old ferryman said, "and the water \
always goes back where it came from." By noon the rain had stopped.

Questions for discussion:
1. Why does the author open with the flood rather than with the characters?
2. What does the clock stand for, and why is it saved?
3. Compare the ferryman's view of the river with the mayor's in chapter 4.

def merge(intervals):
    intervals.sort(key=lambda x: x[0])
    out = [intervals[0]]
    for start, end in intervals[1:]:
        if start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out

User: What is 17% of 2,350, and how long does it take light to cross 1.5e11 meters?
Assistant: 17% of 2,350 is 399.5. Light travels about 299,792 km/s, so 1.5 x 10^11 m take \
about 500 seconds, a little over 8 minutes.
"""


def calibration_ids(tokenizer: Any, vocab_size: int, length: int = 512) -> torch.Tensor:
    """[n] int64: the calibration text's tokens (with the tokenizer's BOS if it adds one), taken
    into the model's vocabulary (a benchmark may pair a dummy model with another's tokenizer),
    else `length` ids drawn with CALIBRATION_SEED."""
    if tokenizer is not None:
        return torch.tensor(tokenizer.encode(CALIBRATION_TEXT), dtype=torch.int64) % vocab_size
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (length,), generator=gen)


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax [L, 2, Hkv] (K, V) -> kv scales [L, 4, Hkv] fp32: rows K_SCALE, V_SCALE, K_INV, V_INV
    (`ops.reference`), each scale the smallest power of two >= HEADROOM x amax / 448 (2^-20 for
    an all-zero head)."""
    need = (amax.double() * HEADROOM / FP8_MAX).clamp_min(2.0 ** -20)
    scale = torch.exp2(torch.ceil(torch.log2(need)))
    return torch.cat([scale, 1.0 / scale], dim=1).float()


@torch.inference_mode()
def measure_amax(model: torch.nn.Module, shape: AttentionShape, ids: torch.Tensor,
                 chunk_size: int, num_layers: int) -> torch.Tensor:
    """|max| of every layer's stored K and V per KV head over one forward of `ids` ([n]), in a
    16-bit scratch pool (the model's dtype) with the `paged` schedule: [L, 2, Hkv] fp32."""
    n = ids.numel()
    shape = dataclasses.replace(shape, kv_dtype=None)
    pool = ChunkPool(num_layers, math.ceil(n / chunk_size), chunk_size, shape.num_kv_heads,
                     shape.head_dim, shape.dtype, shape.device)
    seg = Segment(0, 0, n, tuple(range(math.ceil(n / chunk_size))), 0)
    batch = AttentionBatch((SeqQueries(0, n, 0, (seg,)),), chunk_size, seg.slots(chunk_size))
    backend = create_backend("paged", shape)
    backend.plan(batch)
    model(ids.to(shape.device), torch.arange(n, device=shape.device), backend, pool.k, pool.v)
    used = [x[:, :pool.num_chunks] for x in (pool.k, pool.v)]  # [L, N, C, Hkv, D], the pad chunk left out
    return torch.stack([x.float().abs().amax(dim=(1, 2, 4)) for x in used], dim=1)


def calibrate(pool: ChunkPool, model: LlamaForCausalLM, shape: AttentionShape, tokenizer: Any) -> None:
    """Set an fp8 pool's scales (`pool.scales`) from one forward of the calibration text (at
    start-up, on every rank: each measures its own KV heads)."""
    assert pool.scales is not None, "an fp8 pool"
    ids = calibration_ids(tokenizer, model.cfg.vocab_size)
    amax = measure_amax(model, shape, ids, pool.chunk_size, model.cfg.num_layers)
    pool.scales.copy_(scales_from_amax(amax))
    exps = torch.log2(pool.scales[:, :2]).int()
    log.info("fp8 KV cache: scales 2^%d .. 2^%d (K), 2^%d .. 2^%d (V), from %d calibration tokens",
             exps[:, 0].min(), exps[:, 0].max(), exps[:, 1].min(), exps[:, 1].max(), ids.numel())
