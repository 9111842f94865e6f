"""Pinned prefixes over HTTP (engine/pins.py holds the semantics):

    POST   /v1/prefixes       {prompt | messages, ttl_seconds?, public?, cache_salt?} -> the pin
    GET    /v1/prefixes       the caller's pins (the admin: everyone's)
    DELETE /v1/prefixes/{id}  the caller's pin (the admin: anyone's)

A pin lives in its maker's partition (tenant, cache_salt); `public` (the admin's alone) makes it
read by every tenant. Over the tenant's `--max-pinned-tokens-per-tenant`, or too large for the
KV cache beside what may run: 400, nothing pinned. Another tenant's pin id is a 404, exactly
like an id that never existed.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, Request

from ..engine.async_engine import EngineDeadError, RequestFailed
from .chat import render_prompt, system_prefix_ids
from .errors import APIError
from .generation import ServerState, parse_body
from .protocol import PinRequest
from .tenancy import ADMIN, Tenants


def add_prefix_routes(app: FastAPI, state: ServerState) -> None:
    tenants = state.cfg.tenants

    @app.post("/v1/prefixes")
    async def create(request: Request):
        req = await parse_body(request, PinRequest)
        tenant = request.state.tenant
        if req.public and not _is_admin(tenants, tenant):
            raise APIError(403, "public pins need the admin API key", "public", "admin_only")
        ids = await asyncio.to_thread(_prompt_ids, state.engine.tokenizer, req)
        try:
            pin = await state.engine.pin(f"prefix-{uuid.uuid4().hex}", ids, tenant=tenant, public=req.public,
                                         cache_salt=req.cache_salt or "", ttl=req.ttl_seconds)
        except ValueError as e:
            raise APIError(400, str(e), None, "pin_refused") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "engine_unavailable") from e
        except RequestFailed as e:
            raise APIError(500, f"{e}; nothing was pinned and the server is still serving: retry", None,
                           "internal_error") from e
        return pin

    @app.get("/v1/prefixes")
    async def listing(request: Request):
        owner = None if _is_admin(tenants, request.state.tenant) else request.state.tenant
        return {"object": "list", "data": await state.engine.list_pins(owner)}

    @app.delete("/v1/prefixes/{pin_id}")
    async def delete(pin_id: str, request: Request):
        owner = None if _is_admin(tenants, request.state.tenant) else request.state.tenant
        try:
            pin = await state.engine.unpin(pin_id, owner)
        except ValueError as e:
            raise APIError(404, str(e), None, "prefix_not_found") from e
        return {"id": pin["id"], "object": "prefix.deleted", "deleted": True}


def _is_admin(tenants: Tenants, tenant: str) -> bool:
    """The operator: the admin key, or anyone on a server without keys (one tenant, nothing to hide)."""
    return tenant == ADMIN or not tenants.auth


def _prompt_ids(tokenizer, req: PinRequest) -> list[int]:
    if req.messages is None:
        return req.prompt if isinstance(req.prompt, list) else tokenizer.encode(req.prompt, add_special_tokens=False)
    system = [{"role": "system", "content": m.text()} for m in req.messages]
    render_prompt(tokenizer, system, add_generation_prompt=False)  # a 400 if the template refuses them
    return system_prefix_ids(tokenizer, system)
