"""The routing key: partition first, prompt after, no raw API key (no Ray needed)."""

import json

from prefixserve.serve_ray.routing_key import api_key_identity, routing_key


def _chat(system: str, user: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": user}]}).encode()


def test_requests_sharing_a_system_prompt_share_a_key_prefix():
    a, b = routing_key("t", _chat("You are terse.", "hi")), routing_key("t", _chat("You are terse.", "yo"))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert a[:common].endswith("You are terse.\x1e" + "user\x1f")


def test_partitions_never_share_a_prefix():
    a, b = routing_key(api_key_identity(b"Bearer one"), _chat("s", "u")), routing_key(api_key_identity(b"Bearer two"), _chat("s", "u"))
    pa, pb = a.split("\x00")[0], b.split("\x00")[0]
    assert len(pa) == len(pb) == 16 and pa != pb
    assert "one" not in a and "Bearer" not in a


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
    assert api_key_identity(None) == ""
