"""OpenAI-compatible HTTP front end: FastAPI app, argparse CLI, uvicorn runner.

Handlers validate, tokenize and enqueue; the scheduler's inference thread does
all MLX work. Every error reaches the client as an OpenAI error object, for a
streaming request as an error event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
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
    new_id,
    now,
    usage_body,
    usage_chunk,
)
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .blas import ensure_fast_blas
from .config import LOG_LEVELS, ServerConfig
from .spec_decode.config import SpecDecodeConfig

log = logging.getLogger("mlx_lm_server")

# Seconds between checks for a vanished client while a non-streaming request runs.
DISCONNECT_POLL_S = 0.25


def context_length(model_path: str) -> Optional[int]:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings"
    )
    return int(value) if value else None


class Service:
    """What the HTTP handlers need: tokenizer, limits, and the scheduler."""

    def __init__(self, config: ServerConfig, tokenizer, scheduler, max_context: Optional[int]):
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_context = max_context

    def check_model(self, name: str) -> None:
        if name not in (self.config.model_id, self.config.model):
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.config.model_id!r}",
                code="model_not_found",
                param="model",
            )

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja errors, e.g. roles the template refuses
            raise APIError(400, f"the chat template rejected these messages: {e}",
                           param="messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return self.tokenizer.encode(req.prompt)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in req.prompt if not 0 <= t < len(self.tokenizer)]
        if bad:
            raise APIError(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}",
                           param="prompt")
        return list(req.prompt)

    def max_tokens(self, prompt_len: int, requested: Optional[int]) -> int:
        if self.max_context is not None and prompt_len >= self.max_context:
            raise APIError(
                400,
                f"the prompt is {prompt_len} tokens long, but this model's context "
                f"length is {self.max_context} tokens",
                code="context_length_exceeded",
                param="messages",
            )
        n = requested if requested is not None else self.config.max_tokens
        if self.max_context is not None:
            n = min(n, self.max_context - prompt_len)
        return n


def _sse(data: Union[dict, str]) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(service: Service) -> FastAPI:
    from .sampling import SamplingParams
    from .scheduler import (
        ErrorEvent,
        GenerationRequest,
        QueueFullError,
        ShuttingDownError,
        TextEvent,
    )

    from .prometheus import ServerMetrics
    from .spec_decode.metrics import snapshot

    app = FastAPI(title="mlx-lm-server", version="0.1.0")
    scheduler = service.scheduler
    metrics = ServerMetrics(scheduler)

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

    def _sampling(req) -> SamplingParams:
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed,
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
        max_tokens = service.max_tokens(len(prompt), req.requested_max_tokens())
        return GenerationRequest(
            prompt_tokens=prompt, max_tokens=max_tokens, sampling=_sampling(req),
            stop=req.stop_strings(), top_logprobs=req.num_top_logprobs(),
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

    async def _stream(handle, rid, created, chat: bool, include_usage: bool,
                      first: Optional[dict]) -> AsyncIterator[str]:
        model = service.config.model_id
        finished = False
        try:
            if first is not None:
                yield _sse(first)
            while True:
                event = await handle.events.get()
                if isinstance(event, TextEvent):
                    if not event.text and not event.logprobs:
                        continue
                    if chat:
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
                    if chat:
                        yield _sse(chat_chunk(rid, model, created, {}, event.finish_reason))
                    else:
                        yield _sse(completion_chunk(rid, model, created, "", event.finish_reason))
                    if include_usage:
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        usage = usage_body(event.prompt_tokens, event.completion_tokens,
                                           event.spec_decode)
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
        handle = _submit(gen_request)
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        if body.stream:
            first = chat_chunk(rid, model, created, {"role": "assistant", "content": ""}) if chat else None
            return StreamingResponse(
                _stream(handle, rid, created, chat, body.include_usage, first),
                media_type="text/event-stream", headers=_stream_headers,
            )
        result = await _collect(request, handle)
        if result is None:
            return JSONResponse(error_body("client disconnected"), status_code=499)
        text, entries, done = result
        usage = usage_body(done.prompt_tokens, done.completion_tokens, done.spec_decode)
        if chat:
            logprobs = chat_logprobs(entries) if body.logprobs else None
            return chat_response(rid, model, created, text, done.finish_reason, usage, logprobs)
        logprobs = completion_logprobs(entries) if body.logprobs is not None else None
        return completion_response(rid, model, created, text, done.finish_reason, usage, logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _complete(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(body, request, chat=False)

    return app


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig(model="")
    parser = argparse.ArgumentParser(
        prog="mlx-lm-server",
        description=(
            "OpenAI-compatible server for MLX language models with continuous batching. "
            "Point any OpenAI client at http://HOST:PORT/v1."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", required=True,
                        help="MLX model folder (e.g. from `mlx-lm-server-models fetch NAME`)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients pass as `model` (default: the folder's name)")
    parser.add_argument("--host", default=d.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=d.port, help="port to listen on")
    parser.add_argument("--max-batch-size", type=int, default=d.max_batch_size,
                        help="most sequences decoded together in one step")
    parser.add_argument("--prefill-batch-size", type=int, default=d.prefill_batch_size,
                        help="most prompts prefilled together")
    parser.add_argument("--prefill-step-size", type=int, default=d.prefill_step_size,
                        help="prompt tokens processed per prefill step; long prompts are "
                             "chunked so decoding of other requests keeps going")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens,
                        help="completion length when a request gives no max_tokens")
    parser.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                        help="requests waiting for their first token beyond which new "
                             "ones get HTTP 429")
    parser.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS)

    s = d.spec
    spec = parser.add_argument_group(
        "Speculative Decoding",
        "Draft several tokens per step and verify them in one forward pass, for every "
        "sequence of the batch. Lossless at temperature 0 (identical tokens) and at any "
        "temperature (same distribution) unless --spec-verify threshold is asked for.",
    )
    spec.add_argument("--spec-decode", choices=["none", "ngram", "draft"], default=s.mode,
                      help="proposer: n-gram prompt lookup (no extra model), a draft model "
                           "(--draft-model-path), or none")
    spec.add_argument("--num-speculative-tokens", "--num-draft-tokens", type=int,
                      default=s.num_speculative_tokens, dest="num_speculative_tokens",
                      help="most draft tokens per sequence per step (k)")
    spec.add_argument("--spec-decode-disable-batch-size", type=int, default=None,
                      help="decode without speculation when the batch has at least this "
                           "many sequences")
    spec.add_argument("--ngram-max", type=int, default=s.ngram_max,
                      help="longest suffix n-gram looked up")
    spec.add_argument("--ngram-min", type=int, default=s.ngram_min,
                      help="shortest suffix n-gram looked up")
    spec.add_argument("--no-ngram-prompt-lookup", action="store_true",
                      help="only match n-grams in generated text, not in the prompt")
    spec.add_argument("--draft-model-path", default=None,
                      help="MLX folder of the draft model (--spec-decode draft); it must "
                           "share the target's tokenizer")
    spec.add_argument("--draft-model-quantize", type=int, choices=[4, 8], default=None,
                      help="quantize the draft model after loading")
    spec.add_argument("--no-spec-decode-dynamic", action="store_true",
                      help="never switch speculation off by itself")
    spec.add_argument("--spec-decode-acceptance-threshold", type=float,
                      default=s.acceptance_threshold,
                      help="acceptance rate below which speculation is switched off")
    spec.add_argument("--no-adaptive-k", action="store_true",
                      help="always draft --num-speculative-tokens tokens")
    spec.add_argument("--spec-verify", choices=["auto", "greedy", "threshold"],
                      default=s.verify_mode,
                      help="auto: exact match at temperature 0, rejection sampling above "
                           "(lossless); greedy: exact match only; threshold: also accept "
                           "drafts the target finds likely (LOSSY, changes outputs)")
    spec.add_argument("--spec-verify-threshold", type=float, default=s.verify_threshold,
                      help="target probability at which --spec-verify threshold accepts")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        model=args.model, served_model_name=args.served_model_name, host=args.host,
        port=args.port, max_batch_size=args.max_batch_size,
        prefill_batch_size=args.prefill_batch_size, prefill_step_size=args.prefill_step_size,
        max_tokens=args.max_tokens, max_queued_requests=args.max_queued_requests,
        log_level=args.log_level,
        spec=SpecDecodeConfig(
            mode=args.spec_decode,
            num_speculative_tokens=args.num_speculative_tokens,
            ngram_min=args.ngram_min,
            ngram_max=args.ngram_max,
            prompt_lookup=not args.no_ngram_prompt_lookup,
            draft_model_path=args.draft_model_path,
            draft_model_quantize=args.draft_model_quantize,
            disable_by_batch_size=args.spec_decode_disable_batch_size,
            acceptance_threshold=args.spec_decode_acceptance_threshold,
            dynamic=not args.no_spec_decode_dynamic,
            adaptive_k=not args.no_adaptive_k,
            verify_mode=args.spec_verify,
            verify_threshold=args.spec_verify_threshold,
        ),
    )


def load_service(config: ServerConfig) -> Service:
    from mlx_lm import load

    from .scheduler import Scheduler
    from .spec_decode.engine import make_engine

    model, tokenizer = load(config.model)
    scheduler = Scheduler(
        model, tokenizer, max_batch_size=config.max_batch_size,
        prefill_batch_size=config.prefill_batch_size,
        prefill_step_size=config.prefill_step_size,
        max_queued_requests=config.max_queued_requests,
        engine=make_engine(model, config.spec, tokenizer, config.model),
        spec_mode=config.spec.mode,
    )
    return Service(config, tokenizer, scheduler, context_length(config.model))


def make_uvicorn_server(app, config: ServerConfig, on_exit):
    """A uvicorn server whose first signal ends every stream, then exits with 0."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # Unlike uvicorn's, do not re-raise the signal after a graceful
            # shutdown: a clean stop on SIGINT/SIGTERM exits with status 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=5, access_log=config.log_level == "debug",
    )
    return _Server(uv_config)


def main(argv: Optional[list[str]] = None) -> int:
    ensure_fast_blas()
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not Path(config.model).is_dir():
        print(f"error: --model {config.model!r} is not a folder. Fetch one with "
              "`mlx-lm-server-models fetch smollm2-135m-instruct`.", file=sys.stderr)
        return 2
    log.info("loading %s", config.model)
    service = load_service(config)
    service.scheduler.start()
    server = make_uvicorn_server(create_app(service), config, service.scheduler.shutdown)
    log.info("serving %s on http://%s:%d/v1", config.model_id, config.host, config.port)
    server.run()
    service.scheduler.shutdown()
    service.scheduler.join(timeout=5)
    if service.scheduler.alive:
        log.warning("inference thread still inside a long step; exiting without it")
    # Every client has had its last event. Leave without interpreter teardown,
    # which can abort the process while MLX's worker threads still run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
