"""`hydragen`: Hydragen with hierarchical sharing -- every key range read by 2+ sequences is
attended by the queries of all of them as one batched product; private tails per sequence;
each row merges the partials along its path."""

from ..registry import register_backend
from ..schedule import hydragen
from .scheduled import ScheduledBackend


@register_backend("hydragen")
class HydragenBackend(ScheduledBackend):
    schedule = staticmethod(hydragen)
