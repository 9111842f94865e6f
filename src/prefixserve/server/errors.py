"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a fitting status."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NOT_FIELDS = {"body", "query", "str", "int", "float", "bool", "list", "dict", "TextPart"}
_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """A pydantic error as a 400 naming the offending field. Of a union's failed members, the
    error that got deepest into the value is the most telling (prompt=[1, "a"]: "prompt.1")."""
    errors = e.errors()
    first = max(errors, key=lambda err: len(err.get("loc", ())))
    # Drop pydantic's own location parts: "body", and union members' type names ("str", "list[int]").
    loc = [str(p) for p in first.get("loc", ()) if isinstance(p, int) or
           (_FIELD.fullmatch(str(p)) and p not in _NOT_FIELDS)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return APIError(400, f"{param}: {message}" if param else message, param)


def install(app: FastAPI, on_error=None) -> None:
    """Every error the app can raise leaves as OpenAI-shaped JSON; `on_error(status)` counts them."""

    def respond(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
        if on_error is not None:
            on_error(status)
        return error_response(status, message, param, code, headers)

    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return respond(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        err = from_validation_error(e)
        return respond(err.status, err.message, err.param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                   f"{request.url.path}"}.get(e.status_code, str(e.detail))
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code)
        return respond(e.status_code, message, None, code, getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return respond(500, "internal server error", None, "internal_error")
