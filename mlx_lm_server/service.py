"""The wiring: a loaded model, its scheduler and engine, and what the HTTP
handlers need from them (tokenizer, limits, the served name)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .api import APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .config import ServerConfig
from .structured import GrammarError, response_format_grammar, tool_call_grammar
from .tool_calls import template_messages


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

    def grammar(self, req) -> Optional[str]:
        """The grammar the request's output must follow (None: free text),
        checked against the model's vocabulary: a schema feature the engine
        cannot enforce is a 400 naming it."""
        forced_call = isinstance(req, ChatCompletionRequest) and (
            req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice))
        if forced_call and req.tools:
            if req.response_format not in (None, {"type": "text"}):
                raise APIError(400, "response_format cannot be combined with a tool_choice "
                               "that forces a call", param="response_format")
            start, end, parser, tools = self.tool_markers(req)
            if getattr(parser, "__module__", "") != "mlx_lm.tool_parsers.json_tools":
                raise APIError(400, f"tool_choice {req.tool_choice!r} needs a model whose tool "
                               "calls are JSON objects (name, arguments); this model's are not",
                               param="tool_choice")
            tokenizer = self.scheduler.grammar_tokenizer
            try:
                grammar = tool_call_grammar(tokenizer, start, end, tools,
                                            multiple=req.tool_choice == "required"
                                            and req.parallel_tool_calls is not False)
                tokenizer.check(grammar)
            except GrammarError as e:
                raise APIError(400, f"tools: {e}", param="tools") from None
            return grammar
        try:
            grammar = response_format_grammar(req.response_format)
            if grammar is not None:
                self.scheduler.grammar_tokenizer.check(grammar)
        except GrammarError as e:
            raise APIError(400, f"response_format: {e}", param="response_format") from None
        return grammar

    @property
    def max_draft_tokens(self) -> Optional[int]:
        """The most drafts a request may ask for (the server's k); None when
        speculation is off (a request's setting then changes nothing)."""
        spec = self.config.spec
        return spec.num_speculative_tokens if spec.enabled else None

    def check_model(self, name: str) -> None:
        if name not in (self.config.model_id, self.config.model):
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.config.model_id!r}",
                code="model_not_found",
                param="model",
            )

    def tool_markers(self, req: ChatCompletionRequest) -> Optional[tuple]:
        """(start, end, parser, tools) when this request offers tools, else None."""
        tools = req.template_tools()
        if tools is None:
            return None
        t = self.tokenizer
        if not getattr(t, "has_tool_calling", False):
            raise APIError(400, "this model's chat template has no tool calling; send no "
                           "tools, or serve a model whose template has them", param="tools")
        return t.tool_call_start, t.tool_call_end, t.tool_parser, tools

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = template_messages(req.messages)
        markers = self.tool_markers(req)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        extra = req.chat_template_kwargs or {}
        reserved = sorted(set(extra) & {"messages", "conversation", "tokenize",
                                        "add_generation_prompt", "tools"})
        if reserved:
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}",
                           param="chat_template_kwargs")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True,
                **({"tools": markers[3]} if markers else {}), **extra,
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

    def max_tokens(self, prompt_len: int, requested: Optional[int],
                   param: str = "messages") -> int:
        if self.max_context is not None and prompt_len >= self.max_context:
            raise APIError(
                400,
                f"the prompt is {prompt_len} tokens long, but this model's context "
                f"length is {self.max_context} tokens",
                code="context_length_exceeded",
                param=param,
            )
        n = requested if requested is not None else self.config.max_tokens
        if self.max_context is not None:
            n = min(n, self.max_context - prompt_len)
        return n


def load_service(config: ServerConfig, link=None) -> Service:
    """Model, engine and scheduler for ``config``; in tensor parallel
    (``link`` over more than one rank) this rank's shard of the model."""
    from mlx_lm import load

    from .distributed import SOLO, load_sharded
    from .prompt_cache import PromptCache
    from .scheduler import Scheduler
    from .spec_decode.engine import make_engine

    link = link or SOLO
    if link.size > 1:
        model, tokenizer = load_sharded(config.model, link.group)
    else:
        model, tokenizer = load(config.model)
    scheduler = Scheduler(
        model, tokenizer, max_batch_size=config.max_batch_size,
        prefill_batch_size=config.prefill_batch_size,
        prefill_step_size=config.prefill_step_size,
        max_queued_requests=config.max_queued_requests,
        engine=make_engine(model, config.spec, tokenizer, config.model, link=link),
        spec_mode=config.spec.mode,
        prompt_cache=PromptCache(config.prompt_cache_size, config.prompt_cache_bytes)
        if config.prompt_cache_size > 0 else None,
        link=link,
    )
    return Service(config, tokenizer, scheduler, context_length(config.model))
