"""Attention backends by name: `register_backend` (a class decorator), `backend_names`, `create_backend`.

The table is filled by importing `attention.backends` (each module registers its class), which
the package's __init__ does after importing this module; any import of a module under
`prefixserve.attention` runs that __init__ first, so the table is complete whenever it is read.
This module imports no backend (nor does base.py): the backends depend on it, not the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .base import AttentionBackend, AttentionShape

_REGISTRY: dict[str, Callable[[AttentionShape], AttentionBackend]] = {}
B = TypeVar("B", bound=type[AttentionBackend])


def register_backend(name: str) -> Callable[[B], B]:
    def deco(cls: B) -> B:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def create_backend(name: str, shape: AttentionShape) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {backend_names()}")
    return _REGISTRY[name](shape)
