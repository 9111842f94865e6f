"""Qwen3-MoE (`Qwen3MoeForCausalLM`): a tiny random checkpoint (8 experts, top 3, renormalized;
layer 1 dense by `mlp_only_layers`, layer 3 dense by `decoder_sparse_step`), token-identical to
transformers on every backend, prefix caching on and off."""

from __future__ import annotations

import pytest

from family_checks import BACKENDS, check_deterministic, check_engine, reference


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=80,
                         moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=24, max_position_embeddings=512, tie_word_embeddings=False,
                         architectures=["Qwen3MoeForCausalLM"])
    return reference(cfg, tmp_path_factory.mktemp("qwen3_moe"), seed=4, max_shard_size="100KB")


def test_checkpoint_is_sharded_and_mixes_dense_and_sparse_layers(qwen3_moe):
    assert (qwen3_moe.folder / "model.safetensors.index.json").exists()
    from prefixserve import LLM
    model = LLM(str(qwen3_moe.folder), device="cpu", kv_cache_memory=4 << 20).engine.model
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["SparseMoE", "MLP", "SparseMoE"]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_moe_matches_transformers(qwen3_moe, backend, prefix_caching):
    check_engine(qwen3_moe, backend, prefix_caching)


def test_tensor_parallel_2_matches_transformers(qwen3_moe):
    """Two gloo ranks: heads, the vocabulary and every expert's intermediate dimension split."""
    check_engine(qwen3_moe, "auto", True, tensor_parallel_size=2)


def test_deterministic_mode_is_batch_invariant(qwen3_moe):
    """The experts' SiLU row by row on the CPU (fused.reference.rowwise)."""
    check_deterministic(qwen3_moe)
