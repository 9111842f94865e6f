"""The architecture registry and ModelConfig's reading of HF configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve.config import ModelConfig
from prefixserve.model.registry import model_class, supported_architectures

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError) as e:
        model_class("FalconForCausalLM")
    assert "FalconForCausalLM" in str(e.value)
    for arch in supported_architectures():
        assert arch in str(e.value)


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_architecture_has_a_class(arch):
    assert model_class(arch).__name__.endswith("ForCausalLM")


def test_llama_family_configs_read_as_before():
    cfg = ModelConfig.from_hf(json.loads((CONFIGS / "llama-3-8b.json").read_text()))
    assert (cfg.architecture, cfg.head_dim, cfg.layer_types, cfg.moe) == ("LlamaForCausalLM", 128, (), None)
    assert cfg.attn_scale == 128 ** -0.5 and cfg.window(0) is None


def bench_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((CONFIGS / f"{name}.json").read_text()))


def test_gemma3_12b_slides_five_layers_in_six():
    cfg = bench_config("gemma-3-12b")
    assert cfg.sliding_layers == tuple(i for i in range(48) if (i + 1) % 6)
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (1024, 1e6, 1e4)
    assert dict(cfg.rope_scaling) == {"factor": 8.0, "rope_type": "linear"}
    assert cfg.attn_scale == 256 ** -0.5 and cfg.tie_word_embeddings


def test_qwen3_30b_a3b_is_sparse_everywhere():
    cfg = bench_config("qwen3-30b-a3b")
    assert cfg.moe.num_experts == 128 and cfg.moe.top_k == 8 and cfg.moe.norm_topk_prob
    assert all(cfg.moe.is_sparse(i) for i in range(cfg.num_layers)) and cfg.layer_types == ()


def test_qwen3_8b_reads_its_head_dim():
    cfg = bench_config("qwen3-8b")
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.sliding_layers) == (
        "Qwen3ForCausalLM", 128, 8, ())


def test_multimodal_text_config_fills_transformers_defaults():
    cfg = ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"],
                               "text_config": {"model_type": "gemma3_text", "hidden_size": 64,
                                               "num_hidden_layers": 7, "sliding_window": 8}})
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.hidden_size == 64
    assert len(cfg.layer_types) == 7 and cfg.sliding_layers == (0, 1, 2, 3, 4, 6)


def test_bad_layer_types_name_the_value():
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8,
                             "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "layer_types": ["chunked_attention"]})


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b", "gemma-3-12b"])
def test_dummy_weights_cover_every_parameter(tmp_path, name):
    """Load the bench config scaled down (2 layers, narrow) with dummy weights: every
    parameter must be written (load_weights raises otherwise)."""
    from prefixserve import LLM
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg.update(num_hidden_layers=2, hidden_size=64, intermediate_size=64, vocab_size=512,
               head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    if "num_experts" in cfg:
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    llm = LLM(str(path), load_format="dummy", device="cpu", kv_cache_memory=4 << 20)
    assert type(llm.engine.model).__name__ == cfg["architectures"][0]
    out = llm.generate([[1, 2, 3]], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0
