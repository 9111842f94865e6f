"""The routing key: what Ray's prefix router matches on. One function builds it, so that what
partitions the KV cache (the request's tenant, then its `cache_salt`) is part of it in one place.

    key = tenant + "\\x00" + cache_salt + "\\x00" + prompt text
          (messages: "role\\x1fcontent\\x1e" each; token ids: decimal, space-separated)

The tenant is the one the single-process server gives the request (server/tenancy.py: from its
API key, through the same AuthMiddleware in the ingress), never a raw key; tenant names are
printable, so two tenants never share a key prefix and a request is never sent to a replica for
another tenant's cached prompt. A body that is not a well-formed request gets the tenant alone
as its key; the replica it lands on answers it with the usual 400.
"""

from __future__ import annotations

import json

_SEP, _ROLE, _END = "\x00", "\x1f", "\x1e"


def routing_key(partition: str, body: bytes) -> str:
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        req = None
    if not isinstance(req, dict):
        return partition + _SEP
    salt = req.get("cache_salt")
    return partition + _SEP + (salt if isinstance(salt, str) else "") + _SEP + prompt_text(req)


def prompt_text(req: dict) -> str:
    """The prompt of a /v1/completions or /v1/chat/completions body, as routable text."""
    messages, prompt = req.get("messages"), req.get("prompt")
    if isinstance(messages, list):
        return "".join(_message(m) for m in messages)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt) if all(isinstance(t, int) for t in prompt) else _text(prompt)
    return prompt if isinstance(prompt, str) else ""


def _message(m) -> str:
    if not isinstance(m, dict):
        return ""
    return f"{m.get('role', '')}{_ROLE}{_text(m.get('content'))}{_END}"


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""
