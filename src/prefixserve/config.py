"""Frozen, validated configuration: one dataclass per layer of the system.

User-facing values are checked in `__post_init__` and raise `ValueError` naming the value.
Facts discovered at run time (number of chunks, eos ids, the device's memory) live on the
objects that discover them, never written back into a config. CLI defaults come from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DEVICES = ("auto", "cpu", "cuda")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family architecture (Llama, Mistral, Qwen2, SmolLM), read from an HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted items of HF's rope_scaling dict
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", archs[0].startswith("Qwen2"))),
            rope_scaling=tuple(sorted(rope.items())),
            architecture=archs[0],
        )


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    chunk_size: int | None = None  # token slots per chunk; None: a device-dependent default
    kv_cache_memory: int | None = None  # bytes; None: a device-dependent default
    enable_prefix_caching: bool = True
    max_pinned_tokens_per_tenant: int | None = None  # None: no quota (public pins never count)

    def __post_init__(self):
        if self.chunk_size is not None:
            _positive("chunk_size", self.chunk_size)
        if self.max_pinned_tokens_per_tenant is not None:
            _positive("max_pinned_tokens_per_tenant", self.max_pinned_tokens_per_tenant)
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    overlap_schedule: bool = True  # schedule step t+1 while step t runs (engine.py)

    def __post_init__(self):
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None  # None: the model's own
    load_format: str = "auto"
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # CUDA: run decode steps without CUDA graphs
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self):
        for name, allowed in (("dtype", DTYPES), ("load_format", LOAD_FORMATS), ("device", DEVICES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.load_format == "dummy" and self.model is None:
            raise ValueError("load_format='dummy' needs model= naming a config.json or its folder")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Flat keyword arguments (as `LLM(...)` and the CLI take them) -> nested configs."""
        groups = {}
        for sub in (CacheConfig, SchedulerConfig):
            names = {f.name for f in dataclasses.fields(sub)}
            groups[sub] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        own = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - own
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(cache=groups[CacheConfig], scheduler=groups[SchedulerConfig], **kwargs)
