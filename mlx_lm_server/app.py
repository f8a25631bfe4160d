"""The OpenAI-compatible HTTP app.

Handlers validate, tokenize and enqueue; the scheduler's inference thread does
all MLX work. Every error reaches the client as an OpenAI error object, for a
streaming request as an error event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Optional, Union

from .api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
    done_usage,
    new_id,
    now,
    usage_chunk,
)
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .requests import ErrorEvent, GenerationRequest, QueueFullError, ShuttingDownError, TextEvent
from .service import Service
from .tool_calls import ToolCallSplitter, parse_call, split_tool_calls

log = logging.getLogger("mlx_lm_server")

# Seconds between checks for a vanished client while a non-streaming request runs.
DISCONNECT_POLL_S = 0.25

# Request bodies above this are refused before they are read (a context of a
# million tokens is about 4 MB of text).
MAX_BODY_BYTES = 16 << 20


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
            return await self._refuse(send, int(declared))
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
                await self._refuse(send, seen)

    async def _refuse(self, send, size: int):
        response = JSONResponse(
            error_body(f"the request body is {size} bytes; at most {self.limit} are accepted",
                       code="413"), status_code=413)
        await response({"type": "http"}, None, send)


def _sse(data: Union[dict, str]) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(service: Service) -> FastAPI:
    from .sampling import SamplingParams

    from .prometheus import ServerMetrics
    from .spec_decode.metrics import snapshot

    app = FastAPI(title="mlx-lm-server", version="0.1.0")
    scheduler = service.scheduler
    metrics = ServerMetrics(scheduler)

    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        elif loc:
            message = f"{loc}: {message}"
        return JSONResponse(error_body(message, param=loc or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body("internal server error", type="server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        body = {"status": "shutting_down" if scheduler.stopping else "ok",
                "model": service.config.model_id, **scheduler.stats()}
        return JSONResponse(body, status_code=503 if scheduler.stopping else 200)

    @app.get("/v1/spec_decode/metrics")
    async def spec_decode_metrics():
        return snapshot(service.config.spec.mode, scheduler.spec_counts, scheduler.engine,
                        scheduler.throughput.rate())

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": service.config.model_id, "object": "model", "created": 0,
             "owned_by": "mlx-lm-server"}
        ]}

    # As upstream: XTC never excludes a newline or an end of sequence.
    xtc_special_tokens = tuple(sorted(set(service.tokenizer.encode("\n", add_special_tokens=False))
                                      | set(service.tokenizer.eos_token_ids)))

    def _sampling(req) -> SamplingParams:
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed,
            logit_bias=req.token_biases(len(service.tokenizer)),
            repetition_context_size=req.repetition_context_size,
            presence_context_size=req.presence_context_size,
            frequency_context_size=req.frequency_context_size,
            xtc_probability=req.xtc_probability, xtc_threshold=req.xtc_threshold,
            xtc_special_tokens=xtc_special_tokens,
        )

    def _submit(gen_request: GenerationRequest):
        try:
            return scheduler.submit(gen_request)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from e
        except ShuttingDownError as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from e

    async def _prepare(req, prompt_fn):
        req.check()
        service.check_model(req.model)
        prompt = await asyncio.to_thread(prompt_fn, req)
        if not prompt:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        max_tokens = service.max_tokens(len(prompt), req.requested_max_tokens(),
                                        "prompt" if isinstance(req, CompletionRequest)
                                        else "messages")
        grammar = await asyncio.to_thread(service.grammar, req)
        return GenerationRequest(
            prompt_tokens=prompt, max_tokens=max_tokens, sampling=_sampling(req),
            stop=req.stop_strings(), top_logprobs=req.num_top_logprobs(),
            max_draft_tokens=req.draft_token_cap(service.max_draft_tokens),
            grammar=grammar,
        )

    async def _watch_disconnect(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def _collect(request: Request, handle):
        """Wait for a whole completion, cancelling it if the client goes away."""
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

    def _tool_deltas(splitter, markers, pieces, state) -> list[dict]:
        """Chat deltas for split text: content as is, each parsed call as a
        ``tool_calls`` delta with its index (a call that does not parse is
        content)."""
        deltas = []
        for kind, piece in pieces:
            calls = parse_call(piece, markers[2], markers[3]) if kind == "call" else None
            if calls is None:
                text = piece if kind == "content" else markers[0] + piece
                if text:
                    deltas.append({"content": text})
                continue
            for call in calls:
                if state["calls"] and not state["parallel"]:
                    break  # parallel_tool_calls: false keeps the first call only
                deltas.append({"tool_calls": [{"index": state["calls"], **call}]})
                state["calls"] += 1
        return deltas

    async def _stream(handle, rid, created, chat: bool, include_usage: bool,
                      first: Optional[dict], markers=None,
                      parallel: bool = True) -> AsyncIterator[str]:
        model = service.config.model_id
        finished = False
        splitter = ToolCallSplitter(markers[0], markers[1]) if markers else None
        state = {"calls": 0, "parallel": parallel}
        try:
            if first is not None:
                yield _sse(first)
            while True:
                event = await handle.events.get()
                if isinstance(event, TextEvent):
                    if not event.text and not event.logprobs:
                        continue
                    if splitter is not None:
                        lp = chat_logprobs(event.logprobs) if event.logprobs else None
                        deltas = _tool_deltas(splitter, markers, splitter.feed(event.text), state)
                        for i, delta in enumerate(deltas or ([{}] if lp else [])):
                            yield _sse(chat_chunk(rid, model, created, delta,
                                                  logprobs=lp if i == 0 else None))
                    elif chat:
                        lp = chat_logprobs(event.logprobs) if event.logprobs else None
                        yield _sse(chat_chunk(rid, model, created, {"content": event.text},
                                              logprobs=lp))
                    else:
                        lp = completion_logprobs(event.logprobs) if event.logprobs else None
                        yield _sse(completion_chunk(rid, model, created, event.text, logprobs=lp))
                elif isinstance(event, ErrorEvent):
                    finished = True
                    yield _sse(error_body(event.message, type=event.type, code=event.code))
                    break
                else:
                    finished = True
                    reason = event.finish_reason
                    if splitter is not None:
                        for delta in _tool_deltas(splitter, markers, splitter.close(), state):
                            yield _sse(chat_chunk(rid, model, created, delta))
                        if state["calls"] and reason == "stop":
                            reason = "tool_calls"
                    if chat:
                        yield _sse(chat_chunk(rid, model, created, {}, reason))
                    else:
                        yield _sse(completion_chunk(rid, model, created, "", event.finish_reason))
                    if include_usage:
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        usage = done_usage(event)
                        yield _sse(usage_chunk(rid, model, created, obj, usage))
                    break
            yield _sse("[DONE]")
        finally:
            if not finished:  # the client disconnected mid-stream
                scheduler.cancel(handle)

    _stream_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

    async def _complete(body, request: Request, chat: bool):
        """Both endpoints: validate, submit, then stream or collect."""
        model = service.config.model_id
        gen_request = await _prepare(body, service.chat_prompt if chat else service.completion_prompt)
        markers = service.tool_markers(body) if chat else None
        handle = _submit(gen_request)
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        if body.stream:
            first = chat_chunk(rid, model, created, {"role": "assistant", "content": ""}) if chat else None
            return StreamingResponse(
                _stream(handle, rid, created, chat, body.include_usage, first, markers,
                        parallel=not chat or body.parallel_tool_calls is not False),
                media_type="text/event-stream", headers=_stream_headers,
            )
        result = await _collect(request, handle)
        if result is None:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        text, entries, done = result
        usage = done_usage(done)
        if chat:
            logprobs = chat_logprobs(entries) if body.logprobs else None
            calls, reason = None, done.finish_reason
            if markers:
                text, calls = split_tool_calls(text, *markers)
                if calls and body.parallel_tool_calls is False:
                    calls = calls[:1]
                if calls and reason == "stop":
                    reason = "tool_calls"
            return chat_response(rid, model, created, text, reason, usage, logprobs, calls)
        logprobs = completion_logprobs(entries) if body.logprobs is not None else None
        return completion_response(rid, model, created, text, done.finish_reason, usage, logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _complete(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(body, request, chat=False)

    return app
