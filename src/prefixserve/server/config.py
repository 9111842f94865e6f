"""Server settings: frozen and validated; `prefixserve serve`'s flags and defaults come from here."""

from __future__ import annotations

import dataclasses

from .tenancy import Tenants


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Per-request limits, checked before anything is allocated (a request over one gets a 4xx)."""

    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_tokens: int | None = None  # None: up to the model's context
    max_stop: int = 8
    max_stop_length: int = 256
    max_logprobs: int = 20
    max_concurrent_requests: int = 256

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


LIMIT_HELP = {
    "max_body_bytes": "largest request body, in bytes (413 above it)",
    "max_n": "most samples per request (n)",
    "max_tokens": "most tokens one request may generate (default: the model's context)",
    "max_stop": "most stop strings per request",
    "max_stop_length": "longest stop string, in characters",
    "max_logprobs": "most top logprobs per token (completions `logprobs`, chat `top_logprobs`)",
    "max_concurrent_requests": "most generation requests in flight (429 above it)",
}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    tenants: Tenants = Tenants()  # API keys -> tenants (server/tenancy.py); empty: no auth
    limits: ServerLimits = ServerLimits()
    health_stall_timeout: float = 60.0  # seconds with work but no finished step before /health is 503
    body_timeout: float = 30.0  # seconds a client gets to send its whole request body (408 after)

    def __post_init__(self):
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if not self.health_stall_timeout > 0:
            raise ValueError(f"health_stall_timeout must be > 0, got {self.health_stall_timeout!r}")
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0, got {self.body_timeout!r}")
