"""The fused MoE op's time per decode/prefill step against a per-expert loop and its limit.

    from prefixserve.bench.moe import moe_step_timing
    moe_step_timing("benchmarks/configs/qwen3-30b-a3b.json", tokens=(64, 256, 2048))

For each token count: one sparse layer's experts (random routing from a random router, the
config's E, top-k, I and H, bf16), timed as `fused.moe.fused_moe` (the Triton grouped GEMMs,
CUDA-graph replay) and as HF transformers' loop over the experts hit (eager: it reads the
routing back to the host). Each time is reported with its limit, the larger of
    bytes / copy bandwidth:  every expert hit reads its 3 I H weights once, plus x, the
                             intermediate h (written, read), the pair outputs and out
    FLOPs / matrix rate:     6 I H per (token, slot) pair (gate, up, down)
(bandwidth and rate measured here, `kernel_timing.ceilings`). Multiply by the layer count for
a step's MoE time. Returns rows of plain numbers (JSON-ready).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..model.fused import moe
from .kernel_timing import ceilings, time_call


def hf_expert_loop(x, w13, w2, weights, ids) -> torch.Tensor:
    """transformers' Qwen3MoeExperts.forward: one pair of products per expert hit."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        slot, tok = torch.where((ids == e).T)
        gate, up = nn.functional.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = nn.functional.linear(nn.functional.silu(gate) * up, w2[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out


def limits(tokens: int, cfg: ModelConfig, experts_hit: int, itemsize: int, ceil: dict) -> dict:
    m, h = cfg.moe, cfg.hidden_size
    pairs = tokens * m.top_k
    weight_bytes = experts_hit * 3 * m.intermediate_size * h * itemsize
    act_bytes = (2 * tokens * h + 2 * pairs * m.intermediate_size + 2 * pairs * h) * itemsize
    flops = 6 * pairs * m.intermediate_size * h
    return {"bytes": weight_bytes + act_bytes, "flops": flops,
            "limit_us": 1e6 * max((weight_bytes + act_bytes) / ceil["copy_bandwidth"],
                                  flops / ceil["matrix_rate"])}


def moe_step_timing(config: str | Path, tokens=(1, 16, 64, 256, 1024, 4096), seed: int = 0,
                    device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    cfg = ModelConfig.from_hf(json.loads(Path(config).read_text()))
    if cfg.moe is None:
        raise ValueError(f"{config} has no experts (num_experts)")
    dev, m, h = torch.device(device), cfg.moe, cfg.hidden_size
    gen = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype)  # noqa: E731
    w13 = rnd(m.num_experts, 2 * m.intermediate_size, h) * h ** -0.5
    w2 = rnd(m.num_experts, h, m.intermediate_size) * m.intermediate_size ** -0.5
    router = rnd(m.num_experts, h) * h ** -0.5
    ceil = ceilings(dev, dtype)
    rows = []
    for t in tokens:
        x = rnd(t, h)
        weights, ids = moe.route(x @ router.T, m.top_k, m.norm_topk_prob)
        fused = time_call(lambda: moe.fused_moe(x, w13, w2, weights, ids), dev)
        loop = time_call(lambda: hf_expert_loop(x, w13, w2, weights, ids), dev)
        hit = int(torch.unique(ids).numel())
        lim = limits(t, cfg, hit, x.element_size(), ceil)
        rows.append({"tokens": t, "experts_hit": hit, "fused_us": fused["us"],
                     "fused_timing": fused["timing"], "loop_us": loop["eager_us"], **lim,
                     "fused_over_limit": fused["us"] / lim["limit_us"],
                     "loop_over_limit": loop["eager_us"] / lim["limit_us"], **ceil})
        print(f"T={t:5d} hit {hit:3d}  fused {fused['us']:9.1f} us  loop {loop['eager_us']:9.1f} us"
              f"  limit {lim['limit_us']:8.1f} us  ({fused['us'] / lim['limit_us']:.2f}x)")
    return rows
