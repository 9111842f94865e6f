"""Pinned prefixes: prefilled once, never evicted until unpinned (by id) or expired.

A pin is made by a prefill-only request (request.py) in the pin's partition: `PUBLIC` (every
tenant reads it: `--pin-system-prompt`, the admin's pins) or its owner's own. It is *pending*
until that request has computed its whole prompt, then *active*: its leaf is pinned in the tree.

    add (quota checked) -> pending -> settle: fits? -> active -> unpin / expiry -> gone
                                               `-> refused (nothing pinned)

Honest memory: pinned chunks can never be evicted, so every sequence must still fit beside
them. A pin is refused whole (nothing pinned) unless, with it, the pinned chunks plus the
largest live sequence plus one spare chunk fit in the pool. Quotas count each pin's full
length against its owner (`max_pinned_tokens_per_tenant`); public pins are the operator's and
count against no tenant.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..kvcache.prefix_tree import PUBLIC, Node, Partition


@dataclasses.dataclass
class Pin:
    id: str
    owner: str  # the tenant that made it ("" in a server without tenants; "admin" for the operator)
    partition: Partition  # PUBLIC, or the owner's (tenant, salt)
    token_ids: list[int]
    ttl: float | None  # seconds, from when it became active
    created_at: float = dataclasses.field(default_factory=time.time)
    expires_at: float | None = None  # wall-clock seconds; set when it becomes active
    leaf: Node | None = None  # the pinned path's end, once active

    @property
    def public(self) -> bool:
        return self.partition == PUBLIC

    @property
    def active(self) -> bool:
        return self.leaf is not None

    def info(self) -> dict[str, Any]:
        """What the HTTP API shows of it."""
        return {"id": self.id, "object": "prefix", "owner": self.owner, "public": self.public,
                "tokens": len(self.token_ids), "created_at": self.created_at, "expires_at": self.expires_at,
                "status": "active" if self.active else "pending"}


class PinTable:
    def __init__(self, max_tokens_per_tenant: int | None):
        self.quota = max_tokens_per_tenant
        self.pins: dict[str, Pin] = {}

    def add(self, pin: Pin) -> None:
        """Reserve a pending pin; ValueError if its owner would go over the quota."""
        if pin.id in self.pins:
            raise ValueError(f"pin id {pin.id!r} is already in use")
        used = self.tokens_of(pin.owner)
        if not pin.public and self.quota is not None and used + len(pin.token_ids) > self.quota:
            raise ValueError(f"pinning {len(pin.token_ids)} tokens would put tenant {pin.owner!r} over its "
                             f"quota of {self.quota} pinned tokens ({used} pinned or pending)")
        self.pins[pin.id] = pin

    def discard_pending(self, pin_id: str) -> None:
        """Forget a pin that never became active (refused, aborted, or its request was refused)."""
        pin = self.pins.get(pin_id)
        if pin is not None and not pin.active:
            del self.pins[pin_id]

    def activate(self, pin: Pin, leaf: Node, now: float) -> None:
        pin.leaf = leaf
        pin.expires_at = None if pin.ttl is None else now + pin.ttl

    def tokens_of(self, owner: str) -> int:
        """Tokens of the owner's private pins, pending ones included (public ones count for nobody)."""
        return sum(len(p.token_ids) for p in self.pins.values() if p.owner == owner and not p.public)

    def pending(self) -> list[Pin]:
        return [p for p in self.pins.values() if not p.active]

    def expired(self, now: float) -> list[Pin]:
        return [p for p in self.pins.values() if p.expires_at is not None and p.expires_at <= now]

    def visible_to(self, owner: str | None) -> list[Pin]:
        """The owner's pins; None (the operator) sees all."""
        return [p for p in self.pins.values() if owner is None or p.owner == owner]

    def pinned_tokens_by_owner(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pins.values():
            if p.active:
                out[p.owner] = out.get(p.owner, 0) + len(p.token_ids)
        return out
