"""`chunk`: ChunkAttention's two-phase partition -- chunk-first, one work item per shared chunk
with the queries of the sequences below it; sequence-first, one item per sequence over its
private chunks; the saved partials merged per row."""

from ..registry import register_backend
from ..schedule import chunk
from .scheduled import ScheduledBackend


@register_backend("chunk")
class ChunkBackend(ScheduledBackend):
    schedule = staticmethod(chunk)
