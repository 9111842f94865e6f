"""Tenants: who a request is, from its API key, server-side; and the prefix cache partition it uses.

Keys come from `--api-key` (repeatable; each key its own tenant, named `key-` + the first 8 hex
digits of its SHA-256, so the name is stable and never shows the key), `$PREFIXSERVE_API_KEY`,
and `--api-keys-file` (`KEY TENANT` per line; `#` comments and blank lines allowed). The
`--admin-api-key` is the operator's: public pins, every tenant's pins, `/metrics` and
`/health?detail=1` (those show every tenant's traffic, so with more than one identity they need it).

Isolation: a request's partition is (its tenant, its `cache_salt`). The salt only splits a
tenant further; it never widens sharing, since the tenant part comes from the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import pathlib

ADMIN = "admin"  # the operator's tenant name (its own partition for generation requests)
ANONYMOUS = ""  # the one tenant of a server without keys
OTHER = "other"  # the metrics' tenant label of everyone the keys do not name (the admin, ANONYMOUS)


@dataclasses.dataclass(frozen=True)
class Tenants:
    """API key -> tenant name. Empty: no auth, every request is ANONYMOUS."""

    keys: tuple[tuple[str, str], ...] = ()  # (key, tenant)
    admin_key: str | None = None

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for key, tenant in self.keys + ((self.admin_key, ADMIN),) * (self.admin_key is not None):
            if not key or not key.strip() or any(c.isspace() for c in key):
                raise ValueError(f"an API key must be non-empty and have no spaces (tenant {tenant!r})")
            if key in seen and seen[key] != tenant:
                raise ValueError(f"one API key is given to two tenants: {seen[key]!r} and {tenant!r}")
            seen[key] = tenant
        for _, tenant in self.keys:
            if not tenant or not tenant.isprintable() or any(c.isspace() for c in tenant):
                raise ValueError(f"a tenant name must be printable with no spaces, got {tenant!r}")
        for reserved in {ADMIN, OTHER} & {t for _, t in self.keys}:
            raise ValueError(f"the tenant name {reserved!r} is reserved (the admin key's, and the metrics' label "
                             f"for unnamed tenants)")

    @property
    def auth(self) -> bool:
        return bool(self.keys) or self.admin_key is not None

    @property
    def names(self) -> tuple[str, ...]:
        """The tenants the keys name (sorted, without the admin): the bounded metric labels."""
        return tuple(sorted({t for _, t in self.keys}))

    @property
    def shared(self) -> bool:
        """More than one identity (two tenants, or a tenant and the admin): then what shows every
        tenant's traffic is the admin's alone. One key alone is the operator's own server."""
        return len(self.names) + (self.admin_key is not None) > 1

    def operator_authorization(self) -> bytes | None:
        """The `Authorization` value the operator's own calls to the routes that show every
        tenant's traffic use (a Ray replica reading its /metrics); None: no key may read them."""
        if not self.auth:
            return b""
        if self.admin_key is not None or not self.shared:
            return f"Bearer {self.admin_key or self.keys[0][0]}".encode()
        return None

    def tenant_of(self, authorization: bytes) -> str | None:
        """The tenant of an `Authorization` header's value; None: no such key. Every key is
        compared, in constant time, so the time taken says nothing about which one matched."""
        if not self.auth:
            return ANONYMOUS
        found = None
        for key, tenant in self.keys + ((self.admin_key, ADMIN),) * (self.admin_key is not None):
            if hmac.compare_digest(authorization, f"Bearer {key}".encode()):
                found = tenant
        return found


def key_tenant(key: str) -> str:
    """The tenant name of a key given with `--api-key`."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def read_keys_file(path: str) -> tuple[tuple[str, str], ...]:
    """`KEY TENANT` per line. ValueError naming the file and line if unreadable or malformed."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the API keys file {path}: {e}") from e
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path} line {n}: expected `KEY TENANT` (two fields), got {len(parts)} fields")
        keys.append((parts[0], parts[1]))
    if not keys:
        raise ValueError(f"the API keys file {path} has no keys")
    return tuple(keys)


def request_tenant(scope) -> str:
    """The tenant of a request that AuthMiddleware let through (it put it in the ASGI scope's
    state): what partitions the prefix cache, and so what a router that places requests by
    prefix (Ray Serve, scale-out) must route by, so that a tenant's prefixes meet only its own."""
    return scope["state"]["tenant"]
