"""What a request passes before any route: the API key (``--api-key``), the
body size, and CORS (``--allowed-origins``).

The key and size checks are pure ASGI, not ``@app.middleware("http")``:
Starlette's BaseHTTPMiddleware wraps ``receive``, which hides a client's
disconnect from the handlers that poll for it. Each refusal is an error
object in the route's API (``errors.py``).
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..config import ServerConfig
from .api_error import error_body
from .errors import error_json

# Request bodies above this are refused before they are read (a context of a
# million tokens is about 4 MB of text).
MAX_BODY_BYTES = 16 << 20

# The one route open without the API key: load balancers and probes poll it.
OPEN_PATHS = ("/health",)


def guard(app: FastAPI, config: ServerConfig) -> None:
    """Put the checks in front of ``app``: the last added runs first."""
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    if config.api_key is not None:  # added later, so it runs earlier
        app.add_middleware(ApiKeyCheck, key=config.api_key)
    if config.allowed_origins:  # first: preflights carry no key, and 401s need CORS
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])


class ApiKeyCheck:
    """Refuses every request but those to ``OPEN_PATHS`` without the server's
    key, sent as ``Authorization: Bearer KEY`` (OpenAI clients) or
    ``x-api-key: KEY`` (Anthropic clients), with a 401 error object, before
    its body is read."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            return await self.app(scope, receive, send)
        response = error_json(scope["path"], 401, error_body(
            "a valid API key is required: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
            type="authentication_error", code="invalid_api_key"),
            headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _allowed(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        sent = [bearer.strip() if scheme.lower() == b"bearer" else b"",
                headers.get(b"x-api-key", b"").strip()]
        # Both compared, in constant time: the timing tells nothing of the key.
        return any([hmac.compare_digest(s, self.key) for s in sent])


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over {limit} bytes, the most accepted")


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with a 413 error object.
    A declared Content-Length is refused before reading; a chunked body is
    counted as it arrives."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, int(declared), scope["path"])
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge(self.limit)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send, seen, scope["path"])

    async def _refuse(self, send, size: int, path: str):
        response = error_json(path, 413, error_body(
            f"the request body is {size} bytes; at most {self.limit} are accepted", code="413"))
        await response({"type": "http"}, None, send)
