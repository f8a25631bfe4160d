"""Every failure as the client's API writes it: an OpenAI error object, or
on an Anthropic route (``ANTHROPIC_PATHS``) the same error in Anthropic's
shape. ``ERROR_HANDLERS`` turn what a route raises (``APIError``, a body
that fails validation, Starlette's HTTP errors, anything else) into one."""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic_schema import anthropic_error_body
from .api_error import APIError, error_body

log = logging.getLogger("mlx_lm_server")

# Routes that answer in the Anthropic Messages API's shape, errors included.
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def error_json(path: str, status: int, body: dict, headers=None) -> JSONResponse:
    """An OpenAI error object, or on an Anthropic route the same error in Anthropic's shape."""
    if path in ANTHROPIC_PATHS:
        body = anthropic_error_body(status, body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


async def _api_error(request, exc: APIError):
    return error_json(request.scope["path"], exc.status, exc.body(), exc.headers)


async def _validation_error(request, exc: RequestValidationError):
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message = "the request body is not valid JSON"
    elif loc:
        message = f"{loc}: {message}"
    # A dict key in the location may hold a lone surrogate: escape it for the wire.
    loc, message = (text.encode("utf-8", "backslashreplace").decode() for text in (loc, message))
    return error_json(request.scope["path"], 400, error_body(message, param=loc or None))


async def _http_error(request, exc: StarletteHTTPException):
    return error_json(request.scope["path"], exc.status_code,
                      error_body(str(exc.detail), code=str(exc.status_code)))


async def _unexpected(request, exc: Exception):
    log.exception("unhandled error")
    return error_json(request.scope["path"], 500,
                      error_body("internal server error", type="server_error"))


ERROR_HANDLERS = {APIError: _api_error, RequestValidationError: _validation_error,
                  StarletteHTTPException: _http_error, Exception: _unexpected}
