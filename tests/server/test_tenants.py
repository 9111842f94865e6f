"""Tenants over HTTP, with the official client against a real server process: a tenant's cached
prefixes are invisible to another (cached_tokens), cache_salt splits a tenant, public pins are
read by all, pins over /v1/prefixes (create, list, TTL, delete, quota, bad bodies), and the
admin-only views (/metrics, /health?detail=1). The engine's integrity check runs after each."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from prefixserve.server.tenancy import key_tenant

from server_process import API_KEY, SYSTEM_PROMPT, launch

ADMIN_KEY = "admin-key-77aa"
KEYS = {"alice": "key-alice-1c2d", "bob": "key-bob-9e8f"}
QUOTA = 48  # --max-pinned-tokens-per-tenant


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# key tenant\n\n" + "".join(f"{k} {t}\n" for t, k in KEYS.items()))
    yield from launch(tmp_path_factory, "--api-keys-file", str(keys), "--admin-api-key", ADMIN_KEY,
                      "--max-pinned-tokens-per-tenant", str(QUOTA))


def key(tenant: str) -> str:
    return ADMIN_KEY if tenant == "admin" else KEYS[tenant]


def headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key(tenant)}"}


def complete(server, tenant: str, prompt, **extra):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key(tenant), max_retries=0, timeout=120)
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body=extra or None)
    return out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens


def chat_cached(server, tenant: str, system: str) -> int:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key(tenant), max_retries=0, timeout=120)
    out = client.chat.completions.create(model=server.model, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": f"Hello from {tenant}."}])
    return out.usage.prompt_tokens_details.cached_tokens


def pins(server, tenant: str, method: str = "GET", body=None, pin_id: str = "") -> httpx.Response:
    return httpx.request(method, f"{server.url}/v1/prefixes" + (f"/{pin_id}" if pin_id else ""), json=body,
                         headers=headers(tenant), timeout=120)


def integrity(server) -> dict:
    r = server.get("/health?detail=1", headers=headers("admin"))
    assert r.status_code == 200 and r.json()["integrity"] == "ok", r.text
    return r.json()


def test_another_tenant_s_exact_prompt_is_not_cached_for_me(server):
    secret = "The launch code for project Heliotrope is 7731, and the backup courier is named Orsolya Vance."
    n, cached = complete(server, "alice", secret)
    assert cached == 0
    assert complete(server, "bob", secret) == (n, 0)  # the oracle of FOUND.md 3: closed
    assert complete(server, "alice", secret) == (n, n - 1)  # all but the last token (it makes the logits)
    assert complete(server, "bob", secret) == (n, n - 1)  # bob's own copy now
    integrity(server)


def test_cache_salt_splits_a_tenant(server):
    prompt = "Summarize the quarterly report of the northern warehouse in three careful sentences, please."
    n, _ = complete(server, "alice", prompt, cache_salt="s1")
    assert complete(server, "alice", prompt, cache_salt="s2") == (n, 0)
    assert complete(server, "alice", prompt) == (n, 0)
    assert complete(server, "bob", prompt, cache_salt="s1") == (n, 0)  # a copied salt is no key
    assert complete(server, "alice", prompt, cache_salt="s1") == (n, n - 1)
    integrity(server)


def test_public_pins_are_read_by_every_tenant(server):
    for tenant in ("alice", "bob"):  # --pin-system-prompt: public
        assert chat_cached(server, tenant, SYSTEM_PROMPT) >= 15
    text = "Public notice for every tenant: the office closes at noon on Fridays during the summer."
    r = pins(server, "admin", "POST", {"prompt": text, "public": True})
    assert r.status_code == 200, r.text
    pin = r.json()
    for tenant in ("alice", "bob"):
        n, cached = complete(server, tenant, text + " Is that right?")
        assert cached >= pin["tokens"] - 1  # up to the token where the question starts
    assert pins(server, "admin", "DELETE", pin_id=pin["id"]).status_code == 200
    integrity(server)


def test_private_pin_create_list_delete(server):
    text = "Alice's private handbook: always answer in the voice of a patient librarian."
    r = pins(server, "alice", "POST", {"prompt": text})
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["id"].startswith("prefix-") and pin["tokens"] > 10 and pin["expires_at"] is None
    assert integrity(server)["pinned_tokens"] >= pin["tokens"]
    assert complete(server, "alice", text + " Where are the maps?")[1] >= pin["tokens"] - 1
    assert complete(server, "bob", text + " Where are the maps?")[1] == 0
    assert [p["id"] for p in pins(server, "alice").json()["data"]] == [pin["id"]]
    assert pins(server, "bob").json()["data"] == []
    assert pin["id"] in [p["id"] for p in pins(server, "admin").json()["data"]]
    assert pins(server, "bob", "DELETE", pin_id=pin["id"]).status_code == 404  # as if it did not exist
    r = pins(server, "alice", "DELETE", pin_id=pin["id"])
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert pins(server, "alice").json()["data"] == []
    assert pins(server, "alice", "DELETE", pin_id=pin["id"]).status_code == 404
    integrity(server)


def test_pin_from_messages_covers_the_system_turn(server):
    system = "You are Alice's tax helper. Cite the form number in every answer you give."
    r = pins(server, "alice", "POST", {"messages": [{"role": "system", "content": system}]})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert chat_cached(server, "alice", system) >= tokens
    public = chat_cached(server, "bob", "You are Bob's garden helper. Name the plant in every answer.")
    assert public < tokens  # bob reads the public pin's opening tokens (the template's), nothing more
    assert chat_cached(server, "bob", system) == public
    assert pins(server, "alice", "DELETE", pin_id=r.json()["id"]).status_code == 200
    integrity(server)


def test_pin_expires_after_its_ttl(server):
    before = integrity(server)["pinned_tokens"]
    r = pins(server, "bob", "POST", {"prompt": "Bob's short-lived context for the next few seconds only.",
                                     "ttl_seconds": 3.0})
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["expires_at"] is not None and 0 < pin["expires_at"] - time.time() <= 3.0
    assert integrity(server)["pinned_tokens"] > before
    time.sleep(max(0.0, pin["expires_at"] - time.time()) + 0.2)
    assert pins(server, "bob").json()["data"] == []
    assert pins(server, "bob", "DELETE", pin_id=pin["id"]).status_code == 404
    assert integrity(server)["pinned_tokens"] == before


def test_pins_over_the_tenant_quota_are_refused_whole(server):
    before = integrity(server)["pinned_tokens"]
    r = pins(server, "alice", "POST", {"prompt": list(range(1000, 1000 + QUOTA + 1))})
    assert r.status_code == 400 and "quota" in r.json()["error"]["message"], r.text
    first = pins(server, "alice", "POST", {"prompt": list(range(2000, 2040))})
    assert first.status_code == 200 and first.json()["tokens"] == 40
    r = pins(server, "alice", "POST", {"prompt": list(range(3000, 3040))})
    assert r.status_code == 400 and "quota" in r.json()["error"]["message"], r.text
    assert pins(server, "bob", "POST", {"prompt": list(range(3000, 3040))}).status_code == 200  # bob's own
    assert integrity(server)["pinned_tokens"] == before + 80
    for tenant in ("alice", "bob"):
        for p in pins(server, tenant).json()["data"]:
            assert pins(server, tenant, "DELETE", pin_id=p["id"]).status_code == 200
    assert integrity(server)["pinned_tokens"] == before


def test_a_pin_too_large_for_memory_is_refused_whole(server):
    before = integrity(server)["pinned_tokens"]
    r = pins(server, "admin", "POST", {"prompt": [7] * 8000, "public": True})  # over the context, at least
    assert r.status_code == 400, r.text
    assert integrity(server)["pinned_tokens"] == before


@pytest.mark.parametrize("body, status", [
    ({}, 400),
    ({"prompt": "a", "messages": [{"role": "system", "content": "b"}]}, 400),
    ({"messages": [{"role": "user", "content": "b"}]}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": []}, 400),
    ({"prompt": [10 ** 9]}, 400),
    ({"prompt": "a", "ttl_seconds": -1}, 400),
    ({"prompt": "a", "ttl_seconds": "5"}, 400),
    ({"prompt": "a", "public": True}, 403),  # public pins are the admin's
])
def test_bad_pin_bodies(server, body, status):
    r = pins(server, "alice", "POST", body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert pins(server, "alice").json()["data"] == []
    integrity(server)


def test_admin_only_views_and_401s_counted(server):
    assert server.get("/metrics", headers=headers("alice")).status_code == 403
    assert server.get("/health?detail=1", headers=headers("bob")).status_code == 403
    assert server.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert pins(server, "alice").status_code == 200
    text = server.get("/metrics", headers=headers("admin")).text
    values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(prefixserve_[^\s]+) (\S+)$", text, re.M)}
    assert values['prefixserve_request_errors_total{status="401"}'] >= 1
    assert values['prefixserve_request_errors_total{status="403"}'] >= 2
    labels = set(re.findall(r'^prefixserve_tenant_prompt_tokens_total\{tenant="([^"]*)"\}', text, re.M))
    assert labels == {"alice", "bob", key_tenant(API_KEY), "other"}  # the keys' tenants, and one for the rest
    assert values['prefixserve_tenant_prompt_tokens_total{tenant="alice"}'] > 0
    assert values['prefixserve_tenant_cached_tokens_total{tenant="bob"}'] > 0
    assert server.get("/health", headers={}).status_code == 200  # the liveness probe stays open


@pytest.mark.parametrize("content, message", [
    ("alice-key alice\nbroken-line\n", "line 2"),
    ("alice-key alice extra\n", "line 1"),
    ("# only a comment\n", "has no keys"),
    ("k1 admin\n", "reserved"),
])
def test_a_bad_keys_file_stops_the_server_before_the_model_loads(tmp_path, content, message):
    path = tmp_path / "keys.txt"
    path.write_text(content)
    run = serve_with_keys_file(path)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_an_unreadable_keys_file_stops_the_server(tmp_path):
    run = serve_with_keys_file(tmp_path / "missing.txt")
    assert run.returncode == 2 and "cannot read the API keys file" in run.stderr, run.stderr


def serve_with_keys_file(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixserve.cli", "serve", "--api-keys-file", str(path)],
                          capture_output=True, text=True, timeout=120)
