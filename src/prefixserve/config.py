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
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is e4m3 (vLLM's names)


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse feed-forward layers (Qwen3-MoE): `num_experts` experts of `intermediate_size`,
    each token routed to its top `top_k` by softmax over the router's logits."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = False  # renormalize the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (then a dense MLP)

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size", "decoder_sparse_step"):
            _positive(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds num_experts ({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only architecture read from an HF config.json; `architecture` picks the model
    class (model/registry.py). Fields past `architecture` are used by some families only."""

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
    layer_types: tuple[str, ...] = ()  # per layer, one of LAYER_TYPES; () = all full attention
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    rope_local_theta: float | None = None  # rotary base of sliding layers (Gemma 3); None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5; None: head_dim
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    moe: MoEConfig | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        bad = set(self.layer_types) - set(LAYER_TYPES)
        if bad:
            raise ValueError(f"unsupported layer_types {sorted(bad)}; supported: {LAYER_TYPES}")
        if self.sliding_layers:
            _positive("sliding_window", self.sliding_window)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to every earlier key)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """An HF config.json (a multimodal one's `text_config` for its text tower)."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if "text_config" in cfg:
            cfg = {**_with_defaults(cfg["text_config"]), "architectures": archs}
        heads = cfg["num_attention_heads"]
        theta, local_theta, rope = _rope(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", archs[0].startswith("Gemma3"))),
            attention_bias=bool(cfg.get("attention_bias", archs[0].startswith("Qwen2"))),
            rope_scaling=tuple(sorted(rope.items())),
            architecture=archs[0],
            layer_types=_layer_types(cfg, archs[0]),
            sliding_window=cfg.get("sliding_window"),
            rope_local_theta=local_theta,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            moe=_moe(cfg),
        )


def _with_defaults(text_config: dict) -> dict:
    """A multimodal config's text_config lists only what differs from transformers' defaults
    for its model type (Gemma 3's published configs omit e.g. the head count)."""
    from transformers import AutoConfig
    rest = {k: v for k, v in text_config.items() if k != "model_type"}
    return AutoConfig.for_model(text_config.get("model_type", "gemma3_text"), **rest).to_dict()


def _rope(cfg: dict) -> tuple[float, float | None, dict]:
    """-> (rotary base, the sliding layers' base or None, scaling dict without the default)
    from either HF layout: rope_theta + rope_scaling (+ rope_local_base_freq), or
    rope_parameters, flat or per layer type (transformers 5)."""
    params = cfg.get("rope_parameters") or {}
    local = None
    if "full_attention" in params:
        local = params.get("sliding_attention", {}).get("rope_theta")
        params = params["full_attention"]
    rope = dict(cfg.get("rope_scaling") or params)
    theta = rope.pop("rope_theta", params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    local = local or cfg.get("rope_local_base_freq")
    return float(theta), None if local is None else float(local), rope


def _layer_types(cfg: dict, arch: str) -> tuple[str, ...]:
    """HF's `layer_types`; older Gemma 3 configs say `sliding_window_pattern` (every n-th layer
    full); Qwen2/3 without `use_sliding_window` slide nowhere."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    if arch.startswith("Gemma3"):
        every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                     for i in range(n))
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first = cfg.get("max_window_layers", n)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    return ()


def _moe(cfg: dict) -> MoEConfig | None:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return None
    return MoEConfig(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                     intermediate_size=cfg["moe_intermediate_size"],
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                     decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
                     mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    chunk_size: int | None = None  # token slots per chunk; None: a device-dependent default
    kv_cache_memory: int | None = None  # bytes; None: a device-dependent default
    enable_prefix_caching: bool = True
    max_pinned_tokens_per_tenant: int | None = None  # None: no quota (public pins never count)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: e4m3 with fixed scales (kvcache/scales.py)

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
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
    tp_join_timeout: float = 120.0  # seconds for every worker to start and join the rendezvous
    enforce_eager: bool = False  # CUDA: run decode steps without CUDA graphs
    # a request's tokens and logprobs bit for bit the same whatever else runs with it (issue 24):
    # batch-invariant GEMMs, attention over fixed key cells merged in a fixed order, rank-ordered
    # all-reduce, seeded sampling (unseeded requests draw with `seed`)
    deterministic: bool = False
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    def __post_init__(self):
        for name, allowed in (("dtype", DTYPES), ("load_format", LOAD_FORMATS), ("device", DEVICES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not (isinstance(self.tp_join_timeout, (int, float)) and self.tp_join_timeout > 0):
            raise ValueError(f"tp_join_timeout must be a number of seconds > 0, got {self.tp_join_timeout!r}")
        if self.load_format == "dummy" and self.model is None:
            raise ValueError("load_format='dummy' needs model= naming a config.json or its folder")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Flat keyword arguments (as `LLM(...)` and the CLI take them) -> nested configs."""
        def take(sub: type) -> dict:
            names = {f.name for f in dataclasses.fields(sub)}
            return {k: kwargs.pop(k) for k in list(kwargs) if k in names}

        cache, scheduler = CacheConfig(**take(CacheConfig)), SchedulerConfig(**take(SchedulerConfig))
        own = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kwargs) - own
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(cache=cache, scheduler=scheduler, **kwargs)
