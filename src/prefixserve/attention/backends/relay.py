"""`relay`: RelayAttention -- the prefix common to the whole batch (or its pinned system prompt)
is attended by all query rows as one batched product; the rest of each sequence is paged; the
two partials of each row are merged by log-sum-exp. Nothing common: the paged schedule."""

from ..registry import register_backend
from ..schedule import relay
from .scheduled import ScheduledBackend


@register_backend("relay")
class RelayBackend(ScheduledBackend):
    schedule = staticmethod(relay)
