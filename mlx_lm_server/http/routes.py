"""The OpenAI-compatible HTTP app: routes, and the transport of each answer.

A route parses the body (``openai_schema.py``), has ``Service.prepare`` build the
request, submits it, then streams or collects its events; the scheduler's
inference thread does all MLX work. Two pure ASGI checks come first: the API
key (``--api-key``) and the body size. Every error reaches the client as an
OpenAI error object, for a streaming request as an error event followed by
``data: [DONE]``.

Anthropic's Messages API (``/v1/messages``: ``anthropic_schema.py``,
``anthropic_answer.py``) and OpenAI's Responses API (``/v1/responses``:
``responses_schema.py``, ``responses_answer.py``) are the same pipeline:
their bodies become a chat request, and the chat answer's deltas are
written back in their API's events (a ``Wire`` says how each
stream ends and fails); the Anthropic routes' errors take Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import AsyncIterator, Callable, NamedTuple, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..serving.request import (
    ErrorEvent,
    GenerationRequest,
    QueueFullError,
    ShuttingDownError,
    TextEvent,
)
from .anthropic_answer import MessagesAnswer
from .anthropic_schema import CountTokensRequest, MessagesRequest, anthropic_error_body
from .model_set import ModelSet
from .openai_answer import ChatAnswer, CompletionAnswer
from .openai_schema import APIError, ChatCompletionRequest, CompletionRequest, error_body
from .prepare import Service
from .prometheus import render_models
from .responses_answer import ResponsesAnswer
from .responses_schema import ResponsesRequest

log = logging.getLogger("mlx_lm_server")

# Seconds between checks for a vanished client while a non-streaming request runs.
DISCONNECT_POLL_S = 0.25

# Request bodies above this are refused before they are read (a context of a
# million tokens is about 4 MB of text).
MAX_BODY_BYTES = 16 << 20

# The one route open without the API key: load balancers and probes poll it.
OPEN_PATHS = ("/health",)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Answer = Union[ChatAnswer, CompletionAnswer, MessagesAnswer, ResponsesAnswer]

# Routes that answer in the Anthropic Messages API's shape, errors included.
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


class Wire(NamedTuple):
    """What an API writes around an answer's stream chunks: the chunks of a
    failure, the last chunks, and who is shown every text event (empty ones
    too) whether streamed or whole."""

    error: Callable[[ErrorEvent], list]
    last: tuple = ()
    see: Optional[Callable[[TextEvent], None]] = None


OPENAI_WIRE = Wire(lambda e: [error_body(e.message, type=e.type, code=e.code)], ("[DONE]",))


def _model_object(model_id: str, status: Optional[dict] = None) -> dict:
    body = {"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-lm-server"}
    if status is not None:
        body.update(loaded=status["loaded"], aliases=status["aliases"])
    return body


def create_app(served) -> FastAPI:
    """The app for one model's ``Service``, or for a ``ModelSet`` (several,
    chosen by each request's ``model``: ``model_set.py``)."""
    models = served if isinstance(served, ModelSet) else _one(served)
    config = models.config
    app = FastAPI(title="mlx-lm-server", version="0.1.0", exception_handlers=ERROR_HANDLERS)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    if config.api_key is not None:  # added later, so it runs earlier
        app.add_middleware(ApiKeyCheck, key=config.api_key)
    if config.allowed_origins:  # first: preflights carry no key, and 401s need CORS
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])

    def loaded(name: Optional[str]) -> Service:
        """A loaded model's service for a query's ``model`` (503 if not loaded)."""
        service = models.loaded(name)
        if service is None:
            raise APIError(503, f"model {models.resolve(name)!r} is not loaded now",
                           type="server_error", code="model_not_loaded")
        return service

    @app.get("/health")
    async def health(model: Optional[str] = None):
        service = models.loaded(model)
        if service is None:  # a served model not loaded now: it loads on its first request
            return {"status": "ok", "model": models.resolve(model), "loaded": False}
        scheduler = service.scheduler
        # 503 until the scheduler serves (speculation's calibration: a
        # request sent before waits for it) and once it shuts down.
        status = ("shutting_down" if scheduler.stopping else
                  "starting" if scheduler.starting else "ok")
        body = {"status": status, "model": service.config.model_id, **scheduler.stats()}
        if models.several and model is None:
            body["models"] = models.listing()
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/spec_decode/metrics")
    async def spec_decode_metrics(model: Optional[str] = None):
        return loaded(model).scheduler.spec_stats.snapshot()

    @app.get("/metrics")
    async def prometheus_metrics(model: Optional[str] = None):
        if not models.several:
            return Response(loaded(model).metrics.render(), media_type=CONTENT_TYPE_LATEST)
        names = [models.resolve(model)] if model is not None else list(models.services)
        page = render_models({n: models.services[n].metrics for n in names
                              if n in models.services})
        return Response(page, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_object(m["id"], m) for m in models.listing()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        served = models.resolve(model_id)  # 404 with model_not_found otherwise
        known = [m for m in models.listing() if m["id"] == served]
        if not known:  # a repo id --allow-any-model would load, not asked for yet
            raise APIError(404, f"model {model_id!r} has not been loaded here yet",
                           code="model_not_found", param="model")
        return _model_object(served, known[0])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        service = await models.service(body.model)
        gen_request, markers = await asyncio.to_thread(service.prepare, body)
        answer = ChatAnswer(service.config.model_id, body.logprobs, markers,
                            parallel=body.parallel_tool_calls is not False,
                            custom=body.custom_tools())
        return await _respond(service.scheduler, request, body.stream, body.include_usage,
                              gen_request, answer)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service = await models.service(body.model)
        gen_request, _ = await asyncio.to_thread(service.prepare, body)
        answer = CompletionAnswer(service.config.model_id, body.logprobs is not None)
        return await _respond(service.scheduler, request, body.stream, body.include_usage,
                              gen_request, answer)

    # Anthropic's Messages API and OpenAI's Responses API: each body becomes a
    # chat request, and the chat answer's deltas are written back in its API.

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        chat = body.to_chat()
        service = await models.service(chat.model)
        model = service.config.model_id
        gen_request, markers = await asyncio.to_thread(service.prepare, chat)
        answer = MessagesAnswer(_chat_answer(model, chat, markers), model,
                                len(gen_request.prompt_tokens), gen_request.stop,
                                service.tokenizer)
        return await _respond(service.scheduler, request, body.stream, False, gen_request,
                              answer, Wire(answer.error_chunks, see=answer.see))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        chat = body.to_chat()
        service = await models.service(chat.model)
        gen_request, _ = await asyncio.to_thread(service.prepare, chat)
        return {"input_tokens": len(gen_request.prompt_tokens)}

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        chat = body.to_chat()
        service = await models.service(chat.model)
        model = service.config.model_id
        gen_request, markers = await asyncio.to_thread(service.prepare, chat)
        answer = ResponsesAnswer(_chat_answer(model, chat, markers), model, body,
                                 gen_request.sampling)
        return await _respond(service.scheduler, request, body.stream, False, gen_request,
                              answer, Wire(answer.error_chunks))

    return app


def _one(service: Service) -> ModelSet:
    return ModelSet.single(service)


def _chat_answer(model: str, chat: ChatCompletionRequest, markers) -> ChatAnswer:
    return ChatAnswer(model, False, markers, parallel=chat.parallel_tool_calls is not False)


# ---- the answer, streamed or whole --------------------------------------------------


async def _respond(scheduler, request: Request, stream: bool, include_usage: bool,
                   gen_request: GenerationRequest, answer: Answer, wire: Wire = OPENAI_WIRE):
    handle = _submit(scheduler, gen_request)
    if stream:
        return StreamingResponse(_stream(scheduler, handle, answer, include_usage, wire),
                                 media_type="text/event-stream", headers=STREAM_HEADERS)
    result = await _collect(scheduler, request, handle, wire.see)
    if result is None:
        return JSONResponse(error_body("client disconnected"), status_code=499)
    return answer.whole(*result)


def _submit(scheduler, gen_request: GenerationRequest):
    try:
        return scheduler.submit(gen_request)
    except QueueFullError as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from e
    except ShuttingDownError as e:
        raise APIError(503, str(e), type="server_error", code="shutting_down") from e


def _sse(data: Union[dict, str, tuple]) -> str:
    if isinstance(data, tuple):  # (event name, data): a named event
        name, data = data
        return f"event: {name}\ndata: {json.dumps(data)}\n\n"
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream(scheduler, handle, answer: Answer, include_usage: bool,
                  wire: Wire) -> AsyncIterator[str]:
    """Server-sent events: the answer's chunks, then the wire's last ones
    (OpenAI: ``[DONE]``). A client that leaves mid-stream cancels its request."""
    finished = False
    try:
        for chunk in answer.first_chunks():
            yield _sse(chunk)
        while True:
            event = await handle.events.get()
            if isinstance(event, TextEvent):
                if wire.see is not None:
                    wire.see(event)
                if event.text or event.reasoning or event.logprobs:
                    for chunk in answer.text_chunks(event):
                        yield _sse(chunk)
                continue
            finished = True
            if isinstance(event, ErrorEvent):
                for chunk in wire.error(event):
                    yield _sse(chunk)
            else:
                for chunk in answer.done_chunks(event):
                    yield _sse(chunk)
                if include_usage:
                    yield _sse(answer.usage_chunk(event))
            break
        for chunk in wire.last:
            yield _sse(chunk)
    finally:
        if not finished:  # the client disconnected mid-stream
            scheduler.cancel(handle)


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _collect(scheduler, request: Request, handle,
                   see: Optional[Callable[[TextEvent], None]] = None) -> Optional[tuple]:
    """(text, logprob entries, done event) of a whole completion; None, and
    the request cancelled, if the client goes away first."""
    text, logprobs = [], []
    watcher = asyncio.create_task(_watch_disconnect(request))
    try:
        while True:
            get = asyncio.create_task(handle.events.get())
            done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                scheduler.cancel(handle)
                return None
            event = get.result()
            if isinstance(event, TextEvent):
                if see is not None:  # shown every text event
                    see(event)
                text.append(event.text)
                logprobs.extend(event.logprobs or [])
            elif isinstance(event, ErrorEvent):
                raise APIError(503 if event.code == "shutting_down" else 500,
                               event.message, type=event.type, code=event.code)
            else:
                return "".join(text), logprobs, event
    except asyncio.CancelledError:
        scheduler.cancel(handle)
        raise
    finally:
        watcher.cancel()


# ---- errors ---------------------------------------------------------------------------


def _error_json(path: str, status: int, body: dict, headers=None) -> JSONResponse:
    """An OpenAI error object, or on an Anthropic route the same error in Anthropic's shape."""
    if path in ANTHROPIC_PATHS:
        body = anthropic_error_body(status, body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


async def _api_error(request, exc: APIError):
    return _error_json(request.scope["path"], exc.status, exc.body(), exc.headers)


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
    return _error_json(request.scope["path"], 400, error_body(message, param=loc or None))


async def _http_error(request, exc: StarletteHTTPException):
    return _error_json(request.scope["path"], exc.status_code,
                       error_body(str(exc.detail), code=str(exc.status_code)))


async def _unexpected(request, exc: Exception):
    log.exception("unhandled error")
    return _error_json(request.scope["path"], 500,
                       error_body("internal server error", type="server_error"))


ERROR_HANDLERS = {APIError: _api_error, RequestValidationError: _validation_error,
                  StarletteHTTPException: _http_error, Exception: _unexpected}


# ---- checks before the app: the API key, the body size ---------------------------------


class ApiKeyCheck:
    """Refuses every request but those to ``OPEN_PATHS`` without the server's
    key, sent as ``Authorization: Bearer KEY`` (OpenAI clients) or
    ``x-api-key: KEY`` (Anthropic clients), with a 401 error object, before
    its body is read. Pure ASGI, as ``BodyLimit``."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            return await self.app(scope, receive, send)
        response = _error_json(scope["path"], 401, error_body(
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
    """Refuses request bodies over `limit` bytes with a 413 error object.

    Pure ASGI, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware
    wraps `receive`, which hides a client's disconnect from the handlers that
    poll for it. A declared Content-Length is refused before reading; a
    chunked body is counted as it arrives.
    """

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
        response = _error_json(path, 413, error_body(
            f"the request body is {size} bytes; at most {self.limit} are accepted", code="413"))
        await response({"type": "http"}, None, send)
