"""Qwen3 (`Qwen3ForCausalLM`): the Llama decoder with an RMSNorm over each head of q and k
before the rotary (weights [D], shared by the heads), and `head_dim` independent of
hidden_size / heads (Qwen3-8B: 32 heads x 128 = 4,096 = hidden; Qwen3-0.6B: 16 x 128 > 1,024).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding
from .llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from .parallel import TPGroup


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, layer: int):
        super().__init__(cfg, tp, rotary, layer)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] -> each head RMS-normalized over D (new tensors)."""
        return per_head_norm(q, self.q_norm), per_head_norm(k, self.k_norm)


def per_head_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """x: [T, H, D] (any strides) -> norm over D of every head: [T, H, D], contiguous."""
    t, h, d = x.shape
    return norm(x.reshape(t * h, d)).view(t, h, d)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(Qwen3Attention(self.cfg, self.tp, rotary, layer),
                            MLP(self.cfg, self.tp), self.cfg)

    def layer_weight_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        d = self.cfg.head_dim
        return {**super().layer_weight_shapes(layer), "self_attn.q_norm.weight": (d,),
                "self_attn.k_norm.weight": (d,)}

