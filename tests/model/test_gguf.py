"""GGUF files of the new families, read as transformers reads them: a tiny random model
written with gguf-py (llama.cpp's tensor names; Gemma's norms stored as 1 + w), converted
once by prefixserve, token-identical to transformers loading the same file.

transformers' GGUF reader takes some fields from its config defaults (Qwen3's head_dim 128,
Gemma 3's query_pre_attn_scalar 256 and every-6th-layer pattern), so the tiny configs use
those values. Qwen3-MoE is left out: transformers 5.24 fails to load its stacked experts
(gate and up map to one fused tensor of twice the size: a size-mismatch error), so there is
no reference to be identical to; prefixserve's converter splits them (loader._family_tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from family_checks import check_engine, greedy_reference, save_checkpoint

gguf = pytest.importorskip("gguf")


def write_gguf(model, path, arch, meta: dict) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch.name.lower())
    w.add_name(f"tiny-{arch.name.lower()}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(meta.pop("rope_theta"))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if arch == gguf.MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's (1 + w)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        w.add_tensor(gname, t.contiguous().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_reference(tmp_path, monkeypatch, hf_config, arch, meta, seed, **save):
    monkeypatch.setenv("PREFIXSERVE_CACHE", str(tmp_path / "cache"))
    model = save_checkpoint(hf_config, tmp_path / "hf", seed, **save)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path, arch, meta)
    from transformers import AutoModelForCausalLM
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None
    return greedy_reference(theirs, path, seed)


def test_qwen3_gguf(tmp_path, monkeypatch):
    from transformers import Qwen3Config
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                      max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
    ref = gguf_reference(tmp_path, monkeypatch, cfg, gguf.MODEL_ARCH.QWEN3,
                         {"rope_theta": 10000.0}, seed=8)
    check_engine(ref, "hydragen", True)


def test_gemma3_gguf(tmp_path, monkeypatch):
    from transformers import Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, sliding_window=16, max_position_embeddings=512,
                           rope_theta=1_000_000.0)
    ref = gguf_reference(tmp_path, monkeypatch, cfg, gguf.MODEL_ARCH.GEMMA3,
                         {"rope_theta": 1_000_000.0, "sliding_window": 16}, seed=10, norm_center=0.0)
    check_engine(ref, "chunk", True)
