"""The one place a request is prepared: an OpenAI chat or text completion
request checked against the served model and turned into the scheduler's
``GenerationRequest`` (prompt tokens, length cap, grammar, sampling). The
Anthropic and Responses routes come here too, as chat requests.

A chat request's images are read and checked here (``vision/images.py``:
any bad image is a 400 naming its part), written into the prompt by the
model's chat template and expanded by its processor (``vision/tower.py``);
a model that takes no images answers one with a 400 saying why."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Optional, Union

from ..config import RESERVED_TEMPLATE_KEYS, ServerConfig
from ..decoding.sampling import SamplingParams
from ..decoding.structured import (
    GrammarError,
    GrammarTokenizer,
    after_thinking,
    response_format_grammar,
    tool_call_grammar,
)
from ..runtime.mlx_lm_adapter import calls_are_json_objects
from ..serving.kv_budget import KVBudget
from ..serving.request import GenerationRequest
from ..text.reasoning import Thinking, thinking_of
from ..text.tool_calls import ToolMarkers, template_messages
from ..vision.images import ImageError, load_image
from ..vision.prompt import PromptImages
from ..vision.tower import ImageSupport
from . import tool_images
from .api_error import APIError
from .openai_schema import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .prometheus import ServerMetrics


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


class Service:
    """What the HTTP handlers need: the served model's tokenizer and limits,
    and the scheduler that runs its requests."""

    def __init__(self, config: ServerConfig, tokenizer, scheduler, max_context: Optional[int], *,
                 grammar_tokenizer: Optional[GrammarTokenizer] = None,
                 budget: Optional[KVBudget] = None, metrics: Optional[ServerMetrics] = None,
                 vision=None, images: Optional[ImageSupport] = None):
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_context = max_context
        # llguidance's view of the vocabulary: grammars are checked here, before submission.
        self.grammar_tokenizer = grammar_tokenizer
        # The KV budget the scheduler admits by (None: none): caps max_tokens here.
        self.budget = budget
        # /metrics (None: not served); the assembly builds it and hands its
        # observer to the scheduler.
        self.metrics = metrics
        # The model's vision tower (None: it takes no images), and whether it
        # takes images, or why not (the 400's words).
        self.vision = vision
        self.images = images or ImageSupport(
            False, f"model {config.model_id!r} is a text-only model: it takes no images")

    def prepare(self, req: Union[ChatCompletionRequest, CompletionRequest]
                ) -> tuple[GenerationRequest, Optional[ToolMarkers]]:
        """The request to submit, and for a chat request that offers tools,
        how its tool calls are written. Raises ``APIError`` (4xx) naming the
        field at fault; tokenizes, so it belongs off the event loop."""
        req.check()
        self.check_model(req.model)
        self._check_served_with(req)
        chat = isinstance(req, ChatCompletionRequest)
        markers = self._tool_markers(req) if chat else None
        prompt, images = self._chat_prompt(req, markers) if chat else \
            (self._completion_prompt(req), None)
        if not prompt:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        thinking = thinking_of(self.tokenizer, prompt) if chat else None
        # Keyword arguments are evaluated in order: this is the order of the checks.
        return GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=self._max_tokens(len(prompt), req.requested_max_tokens(),
                                        "messages" if chat else "prompt"),
            grammar=self._grammar(req, markers, thinking),
            sampling=self._sampling(req),
            stop=req.stop_strings(),
            top_logprobs=req.num_top_logprobs(),
            max_draft_tokens=req.draft_token_cap(self._max_draft_tokens),
            thinking=thinking,
            continues_prompt=not chat,
            prediction=self._prediction(req) if chat else None,
            images=images,
        ), markers

    def check_model(self, name: str) -> None:
        """A 404 (model_not_found) unless ``name`` is the served model."""
        if name not in (self.config.model_id, self.config.model, *self.config.aliases):
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.config.model_id!r}",
                code="model_not_found",
                param="model",
            )

    def _check_served_with(self, req) -> None:
        """``adapters`` and ``draft_model`` (mlx_lm.server loads them per
        request) must name what this model is served with."""
        served = {"adapters": self.config.adapter_path,
                  "draft_model": self.config.spec.draft_model_path}
        for field, path in served.items():
            asked = getattr(req, field)
            if asked is None or (path is not None and _same_path(asked, path)):
                continue
            raise APIError(400, f"{field}: this server serves {self.config.model_id!r} "
                           f"with {path or 'none'}, and a request cannot choose another; "
                           "serve that choice as a model of its own (--models-file) and "
                           "name it in model", param=field)

    def _tool_markers(self, req: ChatCompletionRequest) -> Optional[ToolMarkers]:
        """How tool calls are written, when this request offers tools; else None."""
        tools = req.template_tools()
        if tools is None:
            return None
        t = self.tokenizer
        if not getattr(t, "has_tool_calling", False):
            raise APIError(400, "this model's chat template has no tool calling; send no "
                           "tools, or serve a model whose template has them", param="tools")
        return ToolMarkers(t.tool_call_start, t.tool_call_end, t.tool_parser, tools)

    def _chat_prompt(self, req: ChatCompletionRequest, markers: Optional[ToolMarkers]
                     ) -> tuple[list[int], Optional[PromptImages]]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        reserved = sorted(set(req.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KEYS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}",
                           param="chat_template_kwargs")
        # --chat-template-args, each key overridden by the request's own.
        extra = {**self.config.chat_template_args, **(req.chat_template_kwargs or {})}
        messages = template_messages(req.messages)
        with_images = [i for i, m in enumerate(req.messages) if m.images(i)]
        if with_images:
            if self.vision is None:
                i = with_images[0]
                raise APIError(400, self.images.why_not, param=req.messages[i].images(i)[0][0])
            for i in with_images:  # the template writes each image's marker
                messages[i]["content"] = req.messages[i].template_content()
        text = self._render(messages, {**({"tools": markers.tools} if markers else {}), **extra})
        if not with_images:
            return self.tokenizer.encode(text, add_special_tokens=False), None
        loaded = []
        for i in with_images:
            for param, part in req.messages[i].images(i):
                try:
                    loaded.append(load_image(part.url))
                except ImageError as e:
                    raise APIError(400, f"{param}: {e}", param=param) from None
        try:
            return self.vision.prompt(text, loaded)
        except ValueError as e:  # the processor's: markers and images that do not match
            raise APIError(400, f"the model's processor refused the images: {e}",
                           param="messages") from None

    def _render(self, messages: list[dict], kwargs: dict) -> str:
        """The chat template's text for ``messages``; a tool result's images
        laid out the first way the template writes them (``tool_images.py``)."""
        def render(laid_out: list[dict]) -> str:
            return self.tokenizer.apply_chat_template(
                laid_out, tokenize=False, add_generation_prompt=True, **kwargs)

        try:
            return tool_images.rendered(render, messages)
        except Exception as e:  # jinja errors, e.g. roles the template refuses
            raise APIError(400, f"the chat template rejected these messages: {e}",
                           param="messages") from e

    def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return self.tokenizer.encode(req.prompt)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in req.prompt if not 0 <= t < len(self.tokenizer)]
        if bad:
            raise APIError(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}",
                           param="prompt")
        return list(req.prompt)

    def _max_tokens(self, prompt_len: int, requested: Optional[int], param: str) -> int:
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
        budget = self.budget
        if budget is not None:
            if requested is None:  # the server's default: as much of it as fits
                n = max(1, min(n, budget.most_tokens(prompt_len)))
            problem = budget.refusal(prompt_len, n)
            if problem is not None:
                raise APIError(400, problem, code="kv_memory_exceeded",
                               param="max_tokens" if budget.most_tokens(prompt_len) else param)
        return n

    def _prediction(self, req: ChatCompletionRequest) -> Optional[tuple[int, ...]]:
        """The predicted output's tokens (None: no prediction); one longer
        than the model's context is a 400."""
        if req.prediction is None:
            return None
        tokens = tuple(self.tokenizer.encode(req.prediction.text(), add_special_tokens=False))
        if self.max_context is not None and len(tokens) > self.max_context:
            raise APIError(400, f"prediction is {len(tokens)} tokens long, but this model's "
                           f"context length is {self.max_context} tokens",
                           code="context_length_exceeded", param="prediction")
        return tokens

    def _grammar(self, req, markers: Optional[ToolMarkers],
                 thinking: Optional[Thinking] = None) -> Optional[str]:
        """The grammar the request's output must follow (None: free text),
        checked against the model's vocabulary: a schema feature the engine
        cannot enforce is a 400 naming it. A thinking model's grammar holds
        its answer, after the reasoning (``after_thinking``)."""
        forced_call = markers is not None and (
            req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice))
        param = "tools" if forced_call else "response_format"
        if forced_call:
            grammar = self._tool_call_grammar(req, markers)
        else:
            try:
                grammar = response_format_grammar(req.response_format)
                if grammar is not None:
                    self.grammar_tokenizer.check(grammar)
            except GrammarError as e:
                raise APIError(400, f"response_format: {e}", param=param) from None
        if grammar is None or thinking is None:
            return grammar
        try:
            grammar = after_thinking(grammar, thinking, self.grammar_tokenizer)
            self.grammar_tokenizer.check(grammar)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        return grammar

    def _tool_call_grammar(self, req: ChatCompletionRequest, markers: ToolMarkers) -> str:
        """Calls to the offered tools only: ``required`` (one or more, or one
        with ``parallel_tool_calls: false``) or a named function."""
        if req.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format cannot be combined with a tool_choice "
                           "that forces a call", param="response_format")
        if not calls_are_json_objects(self.tokenizer):
            raise APIError(400, f"tool_choice {req.tool_choice!r} needs a model whose tool "
                           "calls are JSON objects (name, arguments); this model's are not",
                           param="tool_choice")
        tokenizer = self.grammar_tokenizer
        try:
            grammar = tool_call_grammar(tokenizer, markers.start, markers.end, markers.tools,
                                        multiple=req.tool_choice == "required"
                                        and req.parallel_tool_calls is not False)
            tokenizer.check(grammar)
        except GrammarError as e:
            raise APIError(400, f"tools: {e}", param="tools") from None
        return grammar

    def _sampling(self, req) -> SamplingParams:
        # --temp, --top-p, --top-k, --min-p: only for fields the request left out.
        given = self.config.sampling_defaults.given()
        picked = {name: given[name] if name in given and name not in req.model_fields_set
                  else getattr(req, name) for name in ("temperature", "top_p", "top_k", "min_p")}
        return SamplingParams(
            **picked,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed,
            logit_bias=req.token_biases(len(self.tokenizer)),
            repetition_context_size=req.repetition_context_size,
            presence_context_size=req.presence_context_size,
            frequency_context_size=req.frequency_context_size,
            xtc_probability=req.xtc_probability, xtc_threshold=req.xtc_threshold,
            xtc_special_tokens=self._xtc_special_tokens,
        )

    @cached_property
    def _xtc_special_tokens(self) -> tuple:
        """As upstream: XTC never excludes a newline or an end of sequence."""
        t = self.tokenizer
        return tuple(sorted(set(t.encode("\n", add_special_tokens=False))
                            | set(t.eos_token_ids)))

    @property
    def _max_draft_tokens(self) -> Optional[int]:
        """The most drafts a request may ask for (the server's k); None when
        speculation is off (a request's setting then changes nothing)."""
        spec = self.config.spec
        return spec.num_speculative_tokens if spec.enabled else None
