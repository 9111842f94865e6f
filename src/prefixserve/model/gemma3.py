"""Gemma 3 text models (`Gemma3ForCausalLM`, and the text tower of
`Gemma3ForConditionalGeneration` checkpoints, whose vision weights are skipped).

Against the Llama decoder: embeddings scaled by sqrt(hidden) (rounded to the dtype, as HF);
RMSNorm with weight (1 + w), multiplied in fp32 before the cast (`fused.gemma_rms_norm`); four norms per layer
(input, post-attention, pre- and post-feed-forward: each sub-block's output is normalized
before it joins the residual); per-head q/k norms; a GELU-tanh gated MLP; the attention scale
query_pre_attn_scalar ** -0.5; sliding-window attention on the layers `layer_types` marks,
with their own (local) rotary base; optional final logit soft-capping. The MLP's
activation is HF's torch op; the norm is HF's op order (on CUDA one Triton program per row,
so that a row's bits do not depend on the batch, as torch's reductions' would).
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable

import torch
from torch import nn

from ..config import ModelConfig
from . import fused
from .layers import Linear, RotaryEmbedding
from .llama import Attention, LlamaForCausalLM, VocabEmbedding
from .parallel import TPGroup
from .qwen3 import per_head_norm

_VISION = ("vision_tower", "multi_modal_projector")
_TEXT_PREFIX = re.compile(r"^(model\.language_model\.|language_model\.model\.|language_model\.|model\.)")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> x / rms(x) * (1 + w), all in fp32, rounded once to x's dtype."""
        return fused.gemma_rms_norm(x, self.weight, self.eps)


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, layer: int):
        super().__init__(cfg, tp, rotary, layer)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return per_head_norm(q, self.q_norm), per_head_norm(k, self.k_norm)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        if cfg.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 with hidden_activation {cfg.hidden_act!r}: only "
                             "'gelu_pytorch_tanh' is supported")
        self.tp, self.size = tp, tp.part(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.size, False, tp.invariant)
        self.down_proj = Linear(self.size, cfg.hidden_size, False, tp.invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        h = fused.elementwise(_gelu_tanh, gate, self.tp.invariant) * up
        return self.tp.all_reduce(self.down_proj(h))


class GemmaDecoderLayer(nn.Module):
    """h += post_attn_norm(attn(input_norm(h)));  h += post_ffw_norm(mlp(pre_ffw_norm(h)))."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, layer: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(cfg, tp, rotary, layer)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(cfg, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, h, positions, attn, k_cache, v_cache, kv_scale=None):
        """h: [T, hidden], the residual stream -> the next layer's."""
        x = self.self_attn(self.input_layernorm(h), positions, attn, k_cache, v_cache, kv_scale)
        h = h + self.post_attention_layernorm(x)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        if cfg.attn_logit_softcapping is not None:
            raise ValueError(f"attn_logit_softcapping {cfg.attn_logit_softcapping} is not "
                             "supported (Gemma 3 checkpoints have none)")
        nn.Module.__init__(self)
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabEmbedding(cfg, tp)
        # sqrt(H) as HF holds it: an fp32 buffer, rounded to the activations' dtype when used
        self.register_buffer("embed_scale", torch.tensor(math.sqrt(cfg.hidden_size)), persistent=False)
        full = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling),
                               cfg.max_position_embeddings)
        local = RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, {},
                                cfg.max_position_embeddings)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, tp, full if cfg.window(i) is None else local, i)
            for i in range(cfg.num_layers))
        # HF's name (model.norm); Gemma's forward calls it, never RMSNorm's add_forward
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # type: ignore[assignment]
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, self.embed_tokens.num_embeddings, False, tp.invariant)

    def forward(self, input_ids, positions, attn, k_caches, v_caches, kv_scales=None):
        """input_ids, positions: [T]; k_caches: [L, num_chunks, C, Hkv, D]; kv_scales: [L, 4,
        Hkv] or None (LlamaForCausalLM.forward) -> hidden [T, hidden]."""
        h = self.embed_tokens(input_ids)
        h = h * self.embed_scale.to(h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, attn, k_caches[i], v_caches[i], None if kv_scales is None else kv_scales[i])
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_product(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = fused.elementwise(torch.tanh, logits / cap, self.tp.invariant) * cap
        return self.tp.all_gather_last(logits.float())

    def layer_weight_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        h, d = self.cfg.hidden_size, self.cfg.head_dim
        return {**super().layer_weight_shapes(layer), "self_attn.q_norm.weight": (d,),
                "self_attn.k_norm.weight": (d,), "pre_feedforward_layernorm.weight": (h,),
                "post_feedforward_layernorm.weight": (h,)}

    def weight_target(self, hf_name: str) -> tuple[str, Hashable] | None:
        if any(v in hf_name for v in _VISION):
            return None
        return super().weight_target(_TEXT_PREFIX.sub("", hf_name))
