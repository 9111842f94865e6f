"""Building blocks of the Llama family, written to match HuggingFace transformers op for op.

Exactness against transformers is the product's promise, so each block mirrors the reference
computation order (RMSNorm in fp32 then cast, cos/sin from an fp32 outer product, rotate_half):
the arithmetic lives in `fused`, whose CPU path is that order and whose CUDA kernels keep its
rounding points.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import fused
from .fused.linear import invariant_linear


class Linear(nn.Linear):
    """nn.Linear (same parameters and names); `invariant`: every output row's bits independent of
    how many rows are computed with it (deterministic mode: `fused.linear`, the group's choice)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, invariant: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.invariant = invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return invariant_linear(x, self.weight, self.bias)
        return super().forward(x)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, H] -> (norm(x + residual), x + residual): the residual add, fused."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rot):
        return dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq, mscale


class RotaryEmbedding(nn.Module):
    """Rotary embedding of q and k by position; inv_freq variants: default, linear, llama3,
    yarn (HF semantics)."""

    def __init__(self, head_dim: int, base: float, scaling: dict, max_pos: int):
        super().__init__()
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.attention_scaling = 1.0
        if kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(base, head_dim, scaling, max_pos)
        elif kind != "default":
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: "
                             "default, linear, llama3, yarn")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves follow the model; a cast to its dtype does not: inv_freq stays fp32, as in
        transformers (a bf16 inv_freq would put the angles of far positions off)."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q: [T, Hq, D] and k: [T, Hkv, D] (views of the qkv projection) in place;
        positions: [T] int."""
        fused.apply_rotary_(q, k, positions, self.inv_freq, self.attention_scaling)
