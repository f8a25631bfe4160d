"""The HTTP app's routes, and the transport of each answer.

A route parses the body (``openai_schema.py``), has ``Service.prepare``
build the request, submits it, then streams or collects its events; the
scheduler's inference thread does all MLX work. The checks before any route
(API key, body size, CORS) are in ``guards.py``; every error reaches the
client as an error object (``errors.py``), for a streaming request as an
error event followed by ``data: [DONE]``.

Anthropic's Messages API (``/v1/messages``, ``anthropic_schema.py``,
``anthropic_answer.py``) and OpenAI's Responses API (``/v1/responses``,
``responses_schema.py``, ``responses_answer.py``) are the same pipeline:
their bodies become a chat request, and the chat answer's deltas are written
back in their API's events (a ``Wire`` says how each stream ends and
fails); the Anthropic routes' errors take Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, NamedTuple, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..serving.request import (
    ErrorEvent,
    GenerationRequest,
    QueueFullError,
    ShuttingDownError,
    TextEvent,
)
from .anthropic_answer import MessagesAnswer
from .anthropic_schema import CountTokensRequest, MessagesRequest
from .api_error import APIError, error_body
from .errors import ERROR_HANDLERS
from .guards import guard
from .model_set import ModelSet
from .openai_answer import ChatAnswer, CompletionAnswer
from .openai_schema import ChatCompletionRequest, CompletionRequest
from .prometheus import render_models
from .responses_answer import ResponsesAnswer
from .responses_schema import ResponsesRequest
from .service import Service

# Seconds between checks for a vanished client while a non-streaming request runs.
DISCONNECT_POLL_S = 0.25

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Answer = Union[ChatAnswer, CompletionAnswer, MessagesAnswer, ResponsesAnswer]


class Wire(NamedTuple):
    """What an API writes around an answer's stream chunks: the chunks of a
    failure, the last chunks, and who is shown every text event (empty ones
    too) whether streamed or whole."""

    error: Callable[[ErrorEvent], list]
    last: tuple = ()
    on_text: Optional[Callable[[TextEvent], None]] = None


OPENAI_WIRE = Wire(lambda e: [error_body(e.message, type=e.type, code=e.code)], ("[DONE]",))


def _model_object(model_id: str, status: Optional[dict] = None) -> dict:
    body = {"id": model_id, "object": "model", "created": 0, "owned_by": "mlx-lm-server"}
    if status is not None:
        body.update(loaded=status["loaded"], aliases=status["aliases"],
                    input_modalities=["text", "image"] if status["images"] else ["text"])
    return body


def create_app(served) -> FastAPI:
    """The app for one model's ``Service``, or for a ``ModelSet`` (several,
    chosen by each request's ``model``: ``model_set.py``)."""
    models = served if isinstance(served, ModelSet) else ModelSet.single(served)
    app = FastAPI(title="mlx-lm-server", version="0.1.0", exception_handlers=ERROR_HANDLERS)
    guard(app, models.config)
    _status_routes(app, models)
    _openai_routes(app, models)
    _agent_routes(app, models)
    return app


def _status_routes(app: FastAPI, models: ModelSet) -> None:
    """What is served and how it goes: health, metrics, the model list."""

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


def _openai_routes(app: FastAPI, models: ModelSet) -> None:
    """OpenAI's chat and text completions."""

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


def _agent_routes(app: FastAPI, models: ModelSet) -> None:
    """Anthropic's Messages API and OpenAI's Responses API: each body becomes
    a chat request, and the chat answer's deltas are written back in its API."""

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
                              answer, Wire(answer.error_chunks, on_text=answer.on_text))

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


def _chat_answer(model: str, chat: ChatCompletionRequest, markers) -> ChatAnswer:
    return ChatAnswer(model, False, markers, parallel=chat.parallel_tool_calls is not False)


# ---- the answer, streamed or whole --------------------------------------------------


async def _respond(scheduler, request: Request, stream: bool, include_usage: bool,
                   gen_request: GenerationRequest, answer: Answer, wire: Wire = OPENAI_WIRE):
    handle = _submit(scheduler, gen_request)
    if stream:
        return StreamingResponse(_stream(scheduler, handle, answer, include_usage, wire),
                                 media_type="text/event-stream", headers=STREAM_HEADERS)
    result = await _collect(scheduler, request, handle, wire.on_text)
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
                if wire.on_text is not None:
                    wire.on_text(event)
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
                   on_text: Optional[Callable[[TextEvent], None]] = None) -> Optional[tuple]:
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
                if on_text is not None:  # shown every text event
                    on_text(event)
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
