"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention; feed-forward layers that are sparse
(`MoEConfig.is_sparse`: every `decoder_sparse_step`-th layer not in `mlp_only_layers`) route
each token to its top-k of E experts by softmax over a linear router (renormalized if
`norm_topk_prob`), and run the experts as one fused op (`fused.moe`); the others are dense.

Weights: HF's per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` land in two stacked
parameters, w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]. Tensor parallelism
splits every expert's intermediate dimension (its gate/up rows and down columns, as a dense
MLP's: `TPGroup.shard` by name), so each rank runs all experts on its slice and the down
products are all-reduced; the router is replicated.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

import torch
from torch import nn

from ..config import ModelConfig
from .fused import moe
from .layers import Linear, RotaryEmbedding
from .llama import MLP, DecoderLayer
from .parallel import TPGroup
from .qwen3 import Qwen3Attention, Qwen3ForCausalLM

_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        m = cfg.moe
        assert m is not None, "SparseMoE needs a ModelConfig with moe set"
        self.tp, self.top_k, self.renormalize = tp, m.top_k, m.norm_topk_prob
        self.size = tp.part(m.intermediate_size, "moe_intermediate_size")
        self.gate = Linear(cfg.hidden_size, m.num_experts, False, tp.invariant)  # the router
        self.w13 = nn.Parameter(torch.empty(m.num_experts, 2 * self.size, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size, self.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        weights, ids = moe.route(self.gate(x), self.top_k, self.renormalize)
        return self.tp.all_reduce(moe.fused_moe(x, self.w13, self.w2, weights, ids, self.tp.invariant))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        sparse = self.cfg.moe is not None and self.cfg.moe.is_sparse(layer)
        mlp = SparseMoE(self.cfg, self.tp) if sparse else MLP(self.cfg, self.tp)
        return DecoderLayer(Qwen3Attention(self.cfg, self.tp, rotary, layer), mlp, self.cfg)

    def layer_weight_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_weight_shapes(layer)
        m, h = self.cfg.moe, self.cfg.hidden_size
        if m is None or not m.is_sparse(layer):
            return shapes
        shapes = {k: v for k, v in shapes.items() if not k.startswith("mlp.")}
        shapes["mlp.gate.weight"] = (m.num_experts, h)
        for e in range(m.num_experts):
            p = f"mlp.experts.{e}."
            shapes.update({p + "gate_proj.weight": (m.intermediate_size, h),
                           p + "up_proj.weight": (m.intermediate_size, h),
                           p + "down_proj.weight": (h, m.intermediate_size)})
        return shapes

    def weight_target(self, hf_name: str) -> tuple[str, Hashable] | None:
        hit = _EXPERT.search(hf_name)
        if hit is None:
            return super().weight_target(hf_name)
        layer, expert, proj = int(hit[1]), int(hit[2]), hit[3]
        if proj == "down_proj":
            return f"layers.{layer}.mlp.w2", (expert,)
        return f"layers.{layer}.mlp.w13", (expert, proj == "up_proj")

    def shard_keys(self, name: str) -> tuple[Hashable, ...]:
        experts = range(self.cfg.moe.num_experts) if self.cfg.moe else ()
        if name.endswith("mlp.w13"):
            return tuple((e, j) for e in experts for j in (False, True))
        if name.endswith("mlp.w2"):
            return tuple((e,) for e in experts)
        return super().shard_keys(name)

    def param_region(self, param: torch.Tensor, name: str, key: Hashable) -> torch.Tensor:
        if name.endswith("mlp.w2"):
            assert isinstance(key, tuple)  # shard_keys: (expert,)
            return param[key[0]]
        if name.endswith("mlp.w13"):
            assert isinstance(key, tuple)  # shard_keys: (expert, is_up)
            size = param.shape[1] // 2
            return param[key[0], key[1] * size:(key[1] + 1) * size]
        return super().param_region(param, name, key)
