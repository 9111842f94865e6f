"""`prefixserve bench moe`: the fused MoE op's time per decode/prefill step against a per-expert loop and its limit.

    prefixserve bench moe --config benchmarks/configs/qwen3-30b-a3b.json --tokens 64,256,1024,4096
    (or from Python: moe_step_timing("benchmarks/configs/qwen3-30b-a3b.json", tokens=(64, 256)))

For each token count: one sparse layer's experts (random routing from a random router, the
config's E, top-k, I and H, bf16), timed as `fused.moe.fused_moe` (the Triton grouped GEMMs,
CUDA-graph replay) and as HF transformers' loop over the experts hit (eager: it reads the
routing back to the host). Each time is reported with its limit, the larger of
    bytes / copy bandwidth:  every expert hit reads its 3 I H weights once, plus x, the
                             intermediate h (written, read), the pair outputs and out
    FLOPs / matrix rate:     6 I H per (token, slot) pair (gate, up, down)
(bandwidth and rate measured here, `kernels.timing.ceilings`). Multiply by the layer count for
a step's MoE time. Writes moe-<config>-<hardware>.json (results.publish).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..model.fused import moe
from . import results as R
from .kernels.timing import ceilings, time_call

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def register(sub) -> None:
    p = sub.add_parser("moe", help="fused MoE op vs a per-expert loop, against its bytes/FLOPs limit",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="benchmarks/configs/qwen3-30b-a3b.json", help="an HF config.json with experts")
    p.add_argument("--tokens", type=R.int_list, default=[1, 16, 64, 256, 1024, 4096], help="tokens per step, list")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, inputs and router")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--out-dir", type=Path, default=R.DEFAULT_OUT_DIR, help="where the JSON goes")
    p.add_argument("--tag", default="", help="appended to the file name")
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = moe_step_timing(args.config, args.tokens, args.seed, device, _DTYPES[args.dtype])
    hw, model = R.hardware(), Path(args.config).stem
    name = "-".join(["moe", model, R.hardware_slug(hw)] + ([args.tag] if args.tag else []))
    doc = {"benchmark": f"fused MoE op vs transformers' per-expert loop, one sparse layer ({args.dtype})",
           "hardware": hw, "model": model, "rows": rows}
    R.publish(doc, Path(args.out_dir) / f"{name}.json", args, "prefixserve bench moe")
    return 0


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
    assert m is not None, "a config with experts (moe_step_timing checks)"
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
        fused = time_call(functools.partial(moe.fused_moe, x, w13, w2, weights, ids), dev)
        loop = time_call(functools.partial(hf_expert_loop, x, w13, w2, weights, ids), dev)
        hit = int(torch.unique(ids).numel())
        lim = limits(t, cfg, hit, x.element_size(), ceil)
        rows.append({"tokens": t, "experts_hit": hit, "fused_us": fused["us"],
                     "fused_timing": fused["timing"], "loop_us": loop["eager_us"], **lim,
                     "fused_over_limit": fused["us"] / lim["limit_us"],
                     "loop_over_limit": loop["eager_us"] / lim["limit_us"], **ceil})
        print(f"T={t:5d} hit {hit:3d}  fused {fused['us']:9.1f} us  loop {loop['eager_us']:9.1f} us"
              f"  limit {lim['limit_us']:8.1f} us  ({fused['us'] / lim['limit_us']:.2f}x)")
    return rows
