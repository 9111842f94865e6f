"""Keys -> tenants from the flags, the environment and a keys file (no server needed): keys
need not be on the command line (FOUND.md 8), each key's tenant is what the server and the Ray
ingress both use, and who may read the views that show every tenant's traffic."""

from __future__ import annotations

import pytest

from prefixserve.cli import build_parser
from prefixserve.server.setup import ADMIN_KEY_ENV, API_KEY_ENV, server_config
from prefixserve.server.tenancy import ADMIN, ANONYMOUS, Tenants, key_tenant


def tenants(monkeypatch, *flags: str, env: dict[str, str] | None = None) -> Tenants:
    for name in (API_KEY_ENV, ADMIN_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return server_config(build_parser().parse_args(["serve", *flags])).tenants


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_keys_from_the_environment_not_the_command_line(monkeypatch):
    t = tenants(monkeypatch, env={API_KEY_ENV: "env-key", ADMIN_KEY_ENV: "env-admin"})
    assert t.tenant_of(bearer("env-key")) == key_tenant("env-key") and t.tenant_of(bearer("env-admin")) == ADMIN
    assert t.tenant_of(bearer("other")) is None and t.tenant_of(b"") is None
    assert t.shared and t.operator_authorization() == bearer("env-admin")


def test_repeated_keys_and_a_keys_file(monkeypatch, tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# key tenant\nka1 alice\n\nka2 alice\nkb bob\n")
    t = tenants(monkeypatch, "--api-key", "k1", "--api-key", "k2", "--api-keys-file", str(path),
                env={API_KEY_ENV: "ignored-when-flags-give-keys"})
    assert [t.tenant_of(bearer(k)) for k in ("ka1", "ka2", "kb")] == ["alice", "alice", "bob"]
    assert t.tenant_of(bearer("k1")) != t.tenant_of(bearer("k2"))  # each --api-key its own tenant
    assert t.tenant_of(bearer("ignored-when-flags-give-keys")) is None
    assert t.names == tuple(sorted({"alice", "bob", key_tenant("k1"), key_tenant("k2")}))
    assert t.operator_authorization() is None  # tenants but no admin key: nobody reads /metrics


def test_one_key_is_the_operator_s_own_server(monkeypatch):
    t = tenants(monkeypatch, "--api-key", "only")
    assert not t.shared and t.operator_authorization() == bearer("only")
    none = tenants(monkeypatch)
    assert not none.auth and none.tenant_of(b"") == ANONYMOUS and none.operator_authorization() == b""


@pytest.mark.parametrize("keys, admin, message", [
    ((("k", "a"), ("k", "b")), None, "two tenants"),
    ((("k", "a"),), "k", "two tenants"),
    ((("has space", "a"),), None, "no spaces"),
    ((("k", "other"),), None, "reserved"),
])
def test_bad_key_sets_name_the_problem(keys, admin, message):
    with pytest.raises(ValueError, match=message):
        Tenants(keys, admin)
