"""Exact shared-prefix attention: the engine's seam (base.py), schedules, plans, backends, ops."""

from .base import (
                   AttentionBackend,
                   AttentionBatch,
                   AttentionShape,
                   Segment,
                   SeqQueries,
                   backend_names,
                   create_backend,
)

__all__ = ["AttentionBackend", "AttentionBatch", "AttentionShape", "SeqQueries", "Segment",
           "backend_names", "create_backend"]
