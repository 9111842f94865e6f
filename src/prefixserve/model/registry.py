"""HF `architectures` -> the model class that runs it: a family is one small file that
registers its names here, plus its tests.

Classes are imported on first use (`_FAMILIES` names the module of each architecture), so a
checkpoint's family is the only one loaded, and this module imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llama import LlamaForCausalLM

# architecture -> (module under prefixserve.model, class name)
_FAMILIES: dict[str, tuple[str, str]] = {
    **{arch: ("llama", "LlamaForCausalLM") for arch in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")},
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForCausalLM"),  # its text tower
}


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for an HF architecture name (every family subclasses Llama's); ValueError naming
    the supported ones."""
    if architecture not in _FAMILIES:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, name = _FAMILIES[architecture]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)
