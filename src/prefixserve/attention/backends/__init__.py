"""Built-in attention backends; importing this package registers them all (see registry.py)."""

from . import auto, chunk, hydragen, no_attention, paged, relay  # noqa: F401
