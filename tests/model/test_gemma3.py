"""Gemma 3 (`Gemma3ForCausalLM`): a tiny random checkpoint with sliding layers (window 16 <
the 45-token shared prefix; layers 0, 1, 3 slide, 2 is global, each kind its own rotary base),
token-identical to transformers on every backend, prefix caching on and off; and the text
tower of a `Gemma3ForConditionalGeneration` checkpoint (vision weights skipped)."""

from __future__ import annotations

import pytest

from family_checks import BACKENDS, PREFIX_LEN, check_deterministic, check_engine, reference

WINDOW = 16


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import Gemma3TextConfig
    cfg = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=WINDOW, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=20.0, architectures=["Gemma3ForCausalLM"])
    assert WINDOW < PREFIX_LEN
    return reference(cfg, tmp_path_factory.mktemp("gemma3"), seed=5, norm_center=0.0)


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
    text = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, sliding_window=WINDOW, max_position_embeddings=512,
                            layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                       boi_token_index=297, eoi_token_index=298, image_token_index=299,
                       architectures=["Gemma3ForConditionalGeneration"])
    return reference(cfg, tmp_path_factory.mktemp("gemma3mm"), seed=6, norm_center=0.0)


def test_multimodal_checkpoint_text_tower_matches_transformers(gemma3_multimodal):
    check_engine(gemma3_multimodal, "hydragen", True)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma3_matches_transformers(gemma3, backend, prefix_caching):
    check_engine(gemma3, backend, prefix_caching)


def test_tensor_parallel_2_matches_transformers(gemma3):
    """Two gloo ranks: heads, the vocabulary and every MLP's intermediate dimension split."""
    check_engine(gemma3, "auto", True, tensor_parallel_size=2)


def test_deterministic_mode_is_batch_invariant(gemma3):
    """Its GELU and logit soft-capping (tanh) run row by row on the CPU; its norm is one
    program per row on CUDA (torch's own ops are batch-variant on both)."""
    check_deterministic(gemma3)
