"""The routing key: the tenant first (resolved from the API key exactly as the single-process
server resolves it), then the cache salt, then the prompt; no raw API key (no Ray needed)."""

import asyncio
import json

import pytest

from prefixserve.serve_ray.routing_key import routing_key
from prefixserve.server.middleware import AuthMiddleware
from prefixserve.server.tenancy import ADMIN, Tenants, key_tenant, request_tenant

TENANTS = Tenants((("ka1", "alice"), ("ka2", "alice"), ("kb", "bob"), ("solo", key_tenant("solo"))), "kadmin")


def _chat(system: str, user: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": user}]}).encode()


def _ingress_key(key: str | None, body: bytes) -> str | int:
    """What the ingress does: its AuthMiddleware resolves the tenant, _forward keys by it.
    Returns the routing key, or the status of a refusal."""
    seen, sent = {}, []

    async def forward(scope, receive, send):
        seen["key"] = routing_key(request_tenant(scope), body)

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers,
             "query_string": b""}
    asyncio.run(AuthMiddleware(forward, tenants=TENANTS)(scope, receive, send))
    return seen.get("key", sent[0]["status"] if sent else None)


def test_the_tenant_leads_the_key_and_no_key_is_in_it():
    body = _chat("You are terse.", "hi")
    a1, a2, b = _ingress_key("ka1", body), _ingress_key("ka2", body), _ingress_key("kb", body)
    assert a1 == a2 == "alice\x00\x00" + "system\x1fYou are terse.\x1euser\x1fhi\x1e"  # one tenant, two keys
    assert b == "bob" + a1[len("alice"):]
    assert _ingress_key("kadmin", body).startswith(ADMIN + "\x00")
    solo = _ingress_key("solo", body)
    assert solo.startswith(key_tenant("solo") + "\x00") and "solo" not in solo  # a hash names --api-key keys
    assert not any(k in key for key in (a1, b) for k in ("ka1", "ka2", "kb", "Bearer"))


def test_unknown_keys_are_refused_before_routing():
    assert _ingress_key("nope", _chat("s", "u")) == 401
    assert _ingress_key(None, _chat("s", "u")) == 401


def test_without_keys_every_request_is_one_partition():
    seen = {}

    async def forward(scope, receive, send):
        seen["tenant"] = request_tenant(scope)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    asyncio.run(AuthMiddleware(forward, tenants=Tenants())(scope, None, None))
    assert seen["tenant"] == ""


@pytest.mark.parametrize("name", ["a\x00b", "", "has space", "tab\there"])
def test_tenant_names_cannot_break_the_key_s_prefix(name):
    with pytest.raises(ValueError, match="tenant name"):
        Tenants((("k", name),))


def test_requests_sharing_a_system_prompt_share_a_key_prefix():
    a, b = routing_key("t", _chat("You are terse.", "hi")), routing_key("t", _chat("You are terse.", "yo"))
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert a[:common].endswith("You are terse.\x1e" + "user\x1f")


def test_completion_prompts_text_and_token_ids():
    assert routing_key("", json.dumps({"prompt": "abc"}).encode()) == "\x00\x00abc"
    assert routing_key("", json.dumps({"prompt": [1, 22, 3]}).encode()) == "\x00\x001 22 3"
    assert routing_key("", json.dumps({"prompt": [[5, 6]]}).encode()) == "\x00\x005 6"


def test_the_cache_salt_splits_a_partition():
    a = routing_key("p", json.dumps({"prompt": "abc", "cache_salt": "s1"}).encode())
    b = routing_key("p", json.dumps({"prompt": "abc", "cache_salt": "s2"}).encode())
    assert a == "p\x00s1\x00abc" and b == "p\x00s2\x00abc"


def test_malformed_bodies_route_by_partition_alone():
    for body in (b"not json", b"[1, 2]", b"\xff"):
        assert routing_key("p", body) == "p\x00"
    assert routing_key("p", b'{"messages": "x", "cache_salt": 7}') == "p\x00\x00"
