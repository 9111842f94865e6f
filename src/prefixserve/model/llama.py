"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2), over flattened token batches,
and the base that the other families (qwen3.py, qwen3_moe.py, gemma3.py) change in places.

A step's tokens from all sequences are one flat batch `[T]`; attention is the only place
sequences are told apart, and it goes through the step's `AttentionBackend` (plan/run).
q/k/v and gate/up projections are fused at load time; `load_weights` takes HF names.
Under tensor parallelism (parallel.py) every size below is this rank's share.

A family overrides: `make_layer` (its decoder layer), `Attention.prepare_qk` (q/k before the
rotary), `weight_target` / `shard_keys` / `param_region` (how HF names land in parameters).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import cast

import torch
from torch import nn

from ..attention.base import AttentionBackend
from ..config import ModelConfig
from . import fused
from .fused.linear import invariant_linear
from .layers import Linear, RMSNorm, RotaryEmbedding
from .parallel import TPGroup


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, rotary: RotaryEmbedding, layer: int):
        super().__init__()
        self.tp, self.head_dim, self.rotary = tp, cfg.head_dim, rotary
        self.window = cfg.window(layer)  # None: full attention
        self.num_heads = tp.part(cfg.num_heads, "num_heads")
        self.num_kv_heads = tp.part(cfg.num_kv_heads, "num_kv_heads")
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes), cfg.attention_bias, tp.invariant)
        self.o_proj = Linear(q_size, cfg.hidden_size, False, tp.invariant)

    def forward(self, x, positions, attn: AttentionBackend, k_cache, v_cache, kv_scale=None):
        """x: [T, hidden]; positions: [T]; k_cache, v_cache: [num_chunks, C, Hkv, D];
        kv_scale: [4, Hkv], an fp8 cache's scales (`AttentionBackend.run`)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # views of one [T, q + 2 kv] tensor
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.prepare_qk(q, k)
        self.rotary(positions, q, k)
        o = attn.run(q, k, v.view(t, self.num_kv_heads, self.head_dim), k_cache, v_cache,
                     window=self.window, kv_scale=kv_scale)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, -1)))

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] before the rotary (which rotates what this returns in
        place); Llama: as they are."""
        return q, k


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp, self.size = tp, tp.part(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.size, False, tp.invariant)
        self.down_proj = Linear(self.size, cfg.hidden_size, False, tp.invariant)

    def forward(self, x):
        return self.tp.all_reduce(self.down_proj(fused.silu_mul(self.gate_up_proj(x), self.tp.invariant)))


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

    def __init__(self, attention: nn.Module, mlp: nn.Module, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, residual, positions, attn, k_cache, v_cache, kv_scale=None):
        """x, residual: [T, hidden]; residual None (the first layer): h = x, the embeddings."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(x, positions, attn, k_cache, v_cache, kv_scale)
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
        self.layers = nn.ModuleList(self.make_layer(i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, self.embed_tokens.num_embeddings, False, tp.invariant)

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(Attention(self.cfg, self.tp, rotary, layer), MLP(self.cfg, self.tp),
                            self.cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                k_caches: torch.Tensor, v_caches: torch.Tensor,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; k_caches: [L, num_chunks, C, Hkv, D]; kv_scales: [L, 4,
        Hkv], an fp8 cache's (`kvcache.scales`) -> hidden [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, attn, k_caches[i], v_caches[i],
                                None if kv_scales is None else kv_scales[i])
        assert residual is not None  # set by the first layer (num_layers >= 1)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> fp32 logits [B, vocab] (gathered from every rank)."""
        return self.tp.all_gather_last(self.lm_product(hidden).float())

    def lm_product(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] times the LM head (or the tied embeddings): [B, this rank's vocab]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        linear = invariant_linear if self.tp.invariant else nn.functional.linear
        return linear(hidden, weight)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be written."""
        params = dict(self.named_parameters())
        written = set()
        for hf_name, tensor in weights:
            target = self.weight_target(hf_name)
            if target is None:
                continue
            name, key = target
            self.param_region(params[name], name, key).copy_(self.tp.shard(hf_name, tensor))
            written.add((name, key))
        expected = {(n, key) for n in params for key in self.shard_keys(n)}
        missing = sorted(str(k) for k in expected - written)
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")

    def weight_target(self, hf_name: str) -> tuple[str, Hashable] | None:
        """HF name -> (our parameter, which part of it: a `shard_keys` key); None: not ours."""
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        shard = None
        for old, (new, idx) in _FUSED.items():
            if f".{old}." in name:
                name, shard = name.replace(old, new), idx
        return name, shard

    def shard_keys(self, name: str) -> tuple[Hashable, ...]:
        """The parts of parameter `name` that HF tensors fill, each exactly once."""
        if "qkv_proj" in name:
            return (0, 1, 2)
        return (0, 1) if "gate_up_proj" in name else (None,)

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> full (unsharded) shape of every tensor of this model's checkpoint (what
        dummy weights are drawn for)."""
        cfg, h = self.cfg, self.cfg.hidden_size
        shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        for n in range(cfg.num_layers):
            shapes.update({f"model.layers.{n}.{k}": v for k, v in self.layer_weight_shapes(n).items()})
        return shapes

    def layer_weight_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        cfg = self.cfg
        h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                  "self_attn.q_proj.weight": (cfg.num_heads * d, h),
                  "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
                  "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
                  "self_attn.o_proj.weight": (h, cfg.num_heads * d),
                  "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
                  "mlp.down_proj.weight": (h, i)}
        if cfg.attention_bias:
            for x, rows in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                shapes[f"self_attn.{x}_proj.bias"] = (rows * d,)
        return shapes

    def param_region(self, param: torch.Tensor, name: str, key: Hashable) -> torch.Tensor:
        """The view of `param` that the part `key` fills (rows of a fused projection)."""
        if key is None:
            return param
        assert isinstance(key, int)  # shard_keys: the part's index in the fused projection
        sizes = cast(Attention, self.layers[0].self_attn).sizes if "qkv_proj" in name else (param.shape[0] // 2,) * 2
        start = sum(sizes[:key])
        return param[start:start + sizes[key]]
