"""Qwen3 (`Qwen3ForCausalLM`): a tiny random checkpoint, token-identical to transformers on
every backend, prefix caching on and off; head_dim (24) independent of hidden / heads (64 / 4);
checkpoints saved in 16-bit types."""

from __future__ import annotations

import pytest
import torch

from family_checks import BACKENDS, check_engine, reference


def qwen3_config():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                      max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
                      architectures=["Qwen3ForCausalLM"])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return reference(qwen3_config(), tmp_path_factory.mktemp("qwen3"), seed=3)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_matches_transformers(qwen3, backend, prefix_caching):
    check_engine(qwen3, backend, prefix_caching)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_checkpoints_load_exactly(tmp_path, dtype):
    """A checkpoint saved in bf16 / fp16, served in fp32: the same tokens as transformers on
    the same (upcast) weights."""
    check_engine(reference(qwen3_config(), tmp_path, seed=7, dtype=dtype), "paged", True)
