"""The OpenAI wire format of requests: schemas and validation (the error
object is ``api_error.py``'s, the response bodies ``openai_answer.py``'s).

Validation happens here, before a request reaches the scheduler, so that every
bad request is answered with a 4xx and an OpenAI-style error object, for
streaming requests before the stream starts.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from .api_error import APIError
from .openai_messages import ChatMessage

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


# Python's json joins a valid pair of UTF-16 escapes into one character, so
# any surrogate left in a parsed string is a lone one: not text a tokenizer takes.
_SURROGATE = re.compile("[\ud800-\udfff]")


def refuse_lone_surrogates(request: BaseModel) -> BaseModel:
    """``request``, or a 400 naming where a string holds a lone surrogate
    (one echoed back, as a response's ``metadata``, would fail to encode: a 500)."""
    path = lone_surrogate_path(request)
    if path is not None:
        where = ".".join(map(str, path))
        raise APIError(400, f"{where}: the text holds a lone UTF-16 surrogate (\\ud800 to "
                       "\\udfff without its pair), which is not Unicode text; send the "
                       "character whole or drop it", param=where)
    return request


def lone_surrogate_path(value: Any) -> Optional[tuple]:
    """Where the first string holding a lone UTF-16 surrogate is in a parsed
    request (field names, list indices and dict keys; for a key, the path of
    its dict), or None when there is none."""
    stack = [((), value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
            continue
        if isinstance(value, BaseModel):
            items = [(name, getattr(value, name)) for name in type(value).model_fields]
            items += list((value.model_extra or {}).items())
        elif isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        else:
            continue
        if any(isinstance(key, str) and _SURROGATE.search(key) for key, _ in items):
            return path
        stack.extend(((*path, key), item) for key, item in reversed(items))
    return None


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class SpecDecodeOptions(BaseModel):
    """Per-request speculation, like mlx-lm's ``num_draft_tokens``: at most
    this many drafts per step for this request (0: none)."""

    model_config = ConfigDict(extra="forbid")
    num_speculative_tokens: Annotated[StrictInt, Field(ge=0, le=64)]


class _SamplingRequest(BaseModel):
    """Parameters shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    temperature: Temperature = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0
    min_p: Probability = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Signed or unsigned 64-bit, as clients send them.
    seed: Optional[Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]] = None
    # {"token id": bias}, added to the logits before sampling (OpenAI: -100..100).
    logit_bias: Optional[dict[StrictStr, Annotated[float, Field(ge=-100.0, le=100.0)]]] = None
    # How many recent tokens each penalty looks at (upstream mlx_lm.server's fields).
    repetition_context_size: Annotated[StrictInt, Field(ge=1)] = 20
    presence_context_size: Annotated[StrictInt, Field(ge=1)] = 20
    frequency_context_size: Annotated[StrictInt, Field(ge=1)] = 20
    # XTC: per token, with this probability exclude every choice above the
    # threshold but the least likely one (upstream's fields and ranges).
    xtc_probability: Probability = 0.0
    xtc_threshold: Annotated[float, Field(ge=0.0, le=0.5)] = 0.1
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    user: Optional[str] = None
    # false: no speculation for this request; true: the server's setting.
    spec_decode: Optional[Union[StrictBool, SpecDecodeOptions]] = None
    # mlx_lm.server's per-request adapters and draft model: honoured when
    # they name what the model is served with (a set serves each choice as
    # a model of its own), else a 400 naming the field.
    adapters: Optional[StrictStr] = None
    draft_model: Optional[StrictStr] = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    response_format: Optional[dict[StrictStr, Any]] = None

    @model_validator(mode="after")
    def _text_is_unicode(self):
        """Every string of the request (messages, prompt, tools, schemas,
        template arguments...) is well-formed Unicode, or the request is a 400."""
        return refuse_lone_surrogates(self)

    def draft_token_cap(self, server_max: Optional[int]) -> Optional[int]:
        """The request's cap on drafts per step, None for the server's own k."""
        if self.spec_decode is None or self.spec_decode is True:
            return None
        if self.spec_decode is False:
            return 0
        k = self.spec_decode.num_speculative_tokens
        if server_max is not None and k > server_max:
            raise APIError(400, f"spec_decode.num_speculative_tokens must be at most {server_max} "
                           f"(the server's --num-speculative-tokens), got {k}",
                           param="spec_decode.num_speculative_tokens")
        return k

    def token_biases(self, vocab_size: int) -> tuple:
        """``logit_bias`` as ((token id, bias), ...), ids checked against the vocabulary."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}",
                               param="logit_bias") from None
            if not 0 <= token < vocab_size:
                raise APIError(400, f"logit_bias token id {token} is out of range "
                               f"[0, {vocab_size})", param="logit_bias")
            out.append((token, float(bias)))
        return tuple(sorted(out))

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
        if any(s == "" for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops

    def check_common(self) -> None:
        if self.n != 1:
            raise APIError(400, f"only n=1 is supported, got n={self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")
        self.stop_strings()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class PredictedOutput(BaseModel):
    """OpenAI's Predicted Outputs: text much of the answer is expected to repeat,
    drafted first when the server speculates (``spec_decode/proposer/prediction.py``)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["content"]
    content: Any = None  # a string or text parts (``text`` checks them)

    def text(self) -> str:
        """The predicted text; content that is not text is a 400 naming it."""
        if isinstance(self.content, str):
            return self.content
        parts = self.content if isinstance(self.content, list) else [self.content]
        for i, part in enumerate(parts):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                where = f"prediction.content.{i}" if parts is self.content else "prediction.content"
                raise APIError(400, f"{where}: a prediction is text or a list of text parts, "
                               '{"type": "text", "text": "..."}', param=where)
        return "".join(part["text"] for part in parts)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


def freeform_function(name: str, description: Optional[str], syntax: Optional[str] = None,
                      definition: Optional[str] = None) -> dict:
    """A custom (freeform) tool as the chat template sees it: a function of
    one string ``input``, its grammar, if any, in the description."""
    about = description or ""
    if definition:
        about += f"\n\nIts input follows this {syntax or ''} grammar:\n{definition}"
    return {"name": name, "description": about.strip(),
            "parameters": {"type": "object", "required": ["input"], "properties": {
                "input": {"type": "string", "description": "The tool's input, as text"}}}}


class CustomFormat(BaseModel):
    """``{"type": "text"}`` or ``{"type": "grammar", "grammar": {"syntax", "definition"}}``."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "grammar"]
    grammar: Optional[dict[StrictStr, Any]] = None


class CustomSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    description: Optional[StrictStr] = None
    format: Optional[CustomFormat] = None


class CustomToolSpec(BaseModel):
    """A freeform tool (``apply_patch``-like): its input is text, not JSON
    arguments; offered as a function of one string, answered as a ``custom``
    tool call."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"]
    custom: CustomSpec

    @property
    def function(self) -> FunctionSpec:
        grammar = (self.custom.format.grammar or {}) if self.custom.format else {}
        return FunctionSpec(**freeform_function(self.custom.name, self.custom.description,
                                                grammar.get("syntax"), grammar.get("definition")))


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    """A call to this function (``function``) or custom tool (``custom``), forced."""
    type: Literal["function", "custom"]
    function: Optional[NamedFunction] = None
    custom: Optional[NamedFunction] = None

    @property
    def name(self) -> str:
        named = self.function if self.type == "function" else self.custom
        if named is None:
            raise APIError(400, f"tool_choice of type {self.type!r} needs its "
                           f"{self.type}.name", param="tool_choice")
        return named.name


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Optional[list[Annotated[Union[ToolSpec, CustomToolSpec],
                                   Field(discriminator="type")]]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], NamedToolChoice]] = None
    # false: at most one call (required: the grammar allows one; auto: later
    # calls in the output are dropped).
    parallel_tool_calls: Optional[StrictBool] = None
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    # Passed to the chat template (e.g. Qwen3's {"enable_thinking": false}).
    chat_template_kwargs: Optional[dict[StrictStr, Any]] = None
    # {"type": "content", "content": text or text parts}: the expected answer.
    prediction: Optional[PredictedOutput] = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        for i, message in enumerate(self.messages):
            if message.role == "user" and message.content is None:
                raise APIError(400, f"messages.{i}.content: a user message needs content, "
                               "not null", param=f"messages.{i}.content")
        if self.prediction is not None:
            self.prediction.text()

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def template_tools(self) -> Optional[list[dict]]:
        """The tools the chat template offers the model (None: no tool calling).

        ``none`` offers none; a named function offers only it (a grammar
        then makes the model call it, as ``required`` makes it call one of
        the tools: see ``Service.grammar``).
        """
        if not self.tools or self.tool_choice == "none":
            if isinstance(self.tool_choice, NamedToolChoice):
                raise APIError(400, "tool_choice names a function but no tools were given",
                               param="tool_choice")
            return None
        tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
                 for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.name
            tools = [t for t in tools if t["function"]["name"] == name]
            if not tools:
                raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                               param="tool_choice")
        return tools

    def custom_tools(self) -> frozenset:
        """The names of the freeform tools offered (their calls come back as ``custom``)."""
        return frozenset(t.custom.name for t in self.tools or [] if isinstance(t, CustomToolSpec))

    def num_top_logprobs(self) -> Optional[int]:
        """None when no logprobs were asked for; else how many alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: Union[StrictStr, Annotated[list[StrictInt], Field(min_length=1)], list[StrictStr]]
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    echo: StrictBool = False

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            self.prompt = self.prompt[0]
        if self.prompt == "" or self.prompt == []:
            raise APIError(400, "prompt must not be empty", param="prompt")

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def num_top_logprobs(self) -> Optional[int]:
        return self.logprobs
