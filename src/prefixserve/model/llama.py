"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2), over flattened token batches.

A step's tokens from all sequences are one flat batch `[T]`; attention is the only place
sequences are told apart, and it goes through the step's `AttentionBackend` (plan/run).
q/k/v and gate/up projections are fused at load time; `load_weights` takes HF names.
Under tensor parallelism (parallel.py) every size below is this rank's share.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..config import ModelConfig
from . import fused
from .layers import RMSNorm, RotaryEmbedding
from .parallel import TPGroup


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding):
        super().__init__()
        self.tp, self.head_dim, self.rotary = tp, cfg.head_dim, rotary
        self.num_heads = tp.part(cfg.num_heads, "num_heads")
        self.num_kv_heads = tp.part(cfg.num_kv_heads, "num_kv_heads")
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def forward(self, x, positions, attn: AttentionBackend, k_cache, v_cache):
        """x: [T, hidden]; positions: [T]; k_cache, v_cache: [num_chunks, C, Hkv, D]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # views of one [T, q + 2 kv] tensor
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        self.rotary(positions, q, k)
        o = attn.run(q, k, v.view(t, self.num_kv_heads, self.head_dim), k_cache, v_cache)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp, self.size = tp, tp.part(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.size, bias=False)
        self.down_proj = nn.Linear(self.size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.tp.all_reduce(self.down_proj(fused.silu_mul(self.gate_up_proj(x))))


class VocabEmbedding(nn.Embedding):
    """The rows of this rank's vocabulary slice; other ids embed to 0 and the sum is all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__(tp.part(cfg.vocab_size, "vocab_size"), cfg.hidden_size)
        self.tp, self.start = tp, tp.rank * self.num_embeddings

    def forward(self, ids):
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(local.clamp(0, self.num_embeddings - 1)) * mine[:, None]
        return self.tp.all_reduce(x)


class DecoderLayer(nn.Module):
    """One layer on the residual stream h, carried as a pair (x, residual) with h = x + residual
    so that each add is fused into the norm after it (vLLM's pattern):

        h_mid = h + attn(norm(h));  returns (mlp(norm(h_mid)), h_mid), the next layer's pair
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, residual, positions, attn, k_cache, v_cache):
        """x, residual: [T, hidden]; residual None (the first layer): h = x, the embeddings."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(x, positions, attn, k_cache, v_cache)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x), residual


# HF parameter name suffix -> (our suffix, shard index within the fused weight)
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabEmbedding(cfg, tp)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling),
                                 cfg.max_position_embeddings)  # one, shared by every layer
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, self.embed_tokens.num_embeddings, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; k_caches: [L, num_chunks, C, Hkv, D] -> hidden [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, attn, k_caches[i], v_caches[i])
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> fp32 logits [B, vocab] (gathered from every rank)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.tp.all_gather_last(nn.functional.linear(hidden, weight).float())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be written."""
        params = dict(self.named_parameters())
        written = set()
        for hf_name, tensor in weights:
            tensor = self.tp.shard(hf_name, tensor)
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
        expected = {(n, i) for n in params for i in
                    (range(len(self._shard_sizes(n))) if ("qkv_proj.weight" in n or "gate_up_proj" in n)
                     else range(3) if "qkv_proj.bias" in n else [None])}
        missing = sorted(str(k) for k in expected - written)
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")

    def _shard_sizes(self, name: str) -> tuple[int, ...]:
        if "qkv_proj" in name:
            return self.layers[0].self_attn.sizes
        return (self.layers[0].mlp.size,) * 2
