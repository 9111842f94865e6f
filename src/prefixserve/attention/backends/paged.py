"""`paged`: PagedAttention -- each sequence attends over its own block table, one partial per
sequence and no merge. Shared chunks are physically shared but read once per sequence; this is
the baseline every benchmark compares against."""

from ..registry import register_backend
from ..schedule import paged
from .scheduled import ScheduledBackend


@register_backend("paged")
class PagedBackend(ScheduledBackend):
    schedule = staticmethod(paged)
