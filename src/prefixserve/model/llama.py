"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2), over flattened token batches.

A step's tokens from all sequences are one flat batch `[T]`; attention is the only place
sequences are told apart, and it goes through the step's `AttentionBackend` (plan/run).
q/k/v and gate/up projections are fused at load time; `load_weights` takes HF names.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attn: AttentionBackend, k_cache, v_cache):
        """x: [T, hidden]; cos, sin: [T, 1, D]; k_cache, v_cache: [num_chunks, C, Hkv, D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        o = attn.run(q, k, v.view(t, self.num_kv_heads, self.head_dim), k_cache, v_cache)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# HF parameter name suffix -> (our suffix, shard index within the fused weight)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling),
                                      cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; k_caches: [L, num_chunks, C, Hkv, D] -> hidden [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn, k_caches[i], v_caches[i])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> fp32 logits [B, vocab]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be written."""
        params = dict(self.named_parameters())
        written = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            shard = None
            for old, (new, idx) in _FUSED.items():
                if f".{old}." in name:
                    name, shard = name.replace(old, new), idx
            param = params[name]
            if shard is None:
                param.copy_(tensor)
            else:
                sizes = self._shard_sizes(name)
                start = sum(sizes[:shard])
                param[start:start + sizes[shard]].copy_(tensor)
            written.add((name, shard))
        missing = {n for n in params if not any(w[0] == n for w in written)}
        if missing:
            raise ValueError(f"checkpoint lacks weights for {sorted(missing)[:5]}")

    def _shard_sizes(self, name: str) -> tuple[int, ...]:
        if "qkv_proj" in name:
            return self.layers[0].self_attn.sizes
        return (self.cfg.intermediate_size, self.cfg.intermediate_size)
