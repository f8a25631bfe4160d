"""The OpenAI Responses API on the wire (``POST /v1/responses``): request
schemas and their translation into the one chat request the server runs
(``ChatCompletionRequest``). Errors keep OpenAI's error object.

The server keeps no state: ``store`` is accepted and nothing is stored, so
``previous_response_id``, ``conversation`` and ``background`` are a 400
(send the whole conversation as ``input`` items instead). Input images
(``input_image`` with an ``image_url``: a data URL or an http(s) URL) become
the chat message's image parts; files, and images by ``file_id``, are a 400;
earlier reasoning items are dropped, as chat templates drop earlier
reasoning.

Tools as agents send them (Codex): functions; ``namespace`` tools, whose
functions the model sees under a qualified name (``mcp__srv__`` + ``fn``,
or ``ns__fn``) and whose calls go back as the inner name plus its
``namespace``; ``custom`` (freeform) tools, offered as a function of one
string ``input`` (their grammar in the description) and answered as
``custom_tool_call`` items; hosted tools the server cannot run
(``web_search``, ``file_search``, ...) left out of the prompt, logged, and
named in the response's metadata.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal, NamedTuple, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    model_validator,
)

from .anthropic_schema import chat_request
from .api_error import APIError
from .openai_schema import ChatCompletionRequest, freeform_function, refuse_lone_surrogates

log = logging.getLogger("mlx_lm_server.http")

# A function call's namespace that means none (Codex's default namespace).
NO_NAMESPACE = (None, "", "functions")


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")  # ids, statuses, annotations


class TextContent(_Item):
    type: Literal["input_text", "output_text"]
    text: StrictStr


class ImageContent(_Item):
    type: Literal["input_image"]
    image_url: Optional[StrictStr] = None
    file_id: Optional[StrictStr] = None
    detail: Optional[StrictStr] = None  # accepted; the model's processor decides the size


MessagePart = Annotated[Union[TextContent, ImageContent], Field(discriminator="type")]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[StrictStr, list[MessagePart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content if isinstance(part, TextContent))

    def chat_content(self, where: str) -> Union[str, list[dict]]:
        """The chat message's content: its text, or with images its parts."""
        if isinstance(self.content, str) or \
                not any(isinstance(p, ImageContent) for p in self.content):
            return self.text()
        parts = []
        for j, part in enumerate(self.content):
            if isinstance(part, TextContent):
                parts.append({"type": "text", "text": part.text})
            elif part.image_url is None:
                raise APIError(400, f"{where}.{j}: an input_image by file_id is not supported "
                               "(this server keeps no files); send its image_url",
                               param=f"{where}.{j}")
            else:
                parts.append({"type": "image_url", "image_url": {"url": part.image_url},
                              "source_param": f"{where}.{j}"})
        return parts


class _CallItem(_Item):
    """A call the model made, sent back: the chat's tool call under the name
    the model saw."""
    call_id: StrictStr
    name: StrictStr
    namespace: Optional[StrictStr] = None

    def chat_call(self) -> dict:
        return {"id": self.call_id, "type": "function", "function": {
            "name": qualified(self.namespace, self.name), "arguments": self.chat_arguments()}}


class FunctionCallItem(_CallItem):
    type: Literal["function_call"]
    arguments: StrictStr

    def chat_arguments(self) -> str:
        return self.arguments


class CustomToolCallItem(_CallItem):
    type: Literal["custom_tool_call"]
    input: StrictStr

    def chat_arguments(self) -> str:
        return json.dumps({"input": self.input}, ensure_ascii=False)


class OutputPart(_Item):
    """A part of a tool's output: text is kept, images and files are not
    (the model reads text only)."""
    type: StrictStr
    text: Optional[StrictStr] = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: StrictStr
    output: Union[StrictStr, list[OutputPart]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else \
            "".join(part.text or "" for part in self.output)


class ReasoningItem(_Item):
    type: Literal["reasoning"]


def _item_type(value: Any) -> Optional[str]:
    """A message item may leave out its type."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Union[
    Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
    Annotated[CustomToolCallItem, Tag("custom_tool_call")],
    Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Annotated[FunctionCallOutputItem, Tag("custom_tool_call_output")],
    Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


def qualified(namespace: Optional[str], name: str) -> str:
    """The name the model sees for ``name`` in ``namespace``: Codex's MCP
    namespaces end in ``__`` (``mcp__srv__`` + ``fn``), others get one."""
    if namespace in NO_NAMESPACE:
        return name
    return f"{namespace}{name}" if namespace.endswith("__") else f"{namespace}__{name}"


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[dict[StrictStr, Any]] = None
    strict: Optional[StrictBool] = None
    defer_loading: Optional[StrictBool] = None

    def chat_function(self, namespace: Optional[str] = None) -> dict:
        return {"name": qualified(namespace, self.name),
                **self.model_dump(include={"description", "parameters"}, exclude_none=True)}


class CustomFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "grammar"]
    syntax: Optional[StrictStr] = None
    definition: Optional[StrictStr] = None


class CustomTool(BaseModel):
    """A freeform tool: its input is text, not JSON arguments."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"]
    name: StrictStr
    description: Optional[StrictStr] = None
    format: Optional[CustomFormat] = None
    defer_loading: Optional[StrictBool] = None

    def chat_function(self, namespace: Optional[str] = None) -> dict:
        fmt = self.format
        grammar = fmt is not None and fmt.type == "grammar"
        return freeform_function(qualified(namespace, self.name), self.description,
                                 fmt.syntax if grammar else None,
                                 fmt.definition if grammar else None)


def _inner_type(value: Any) -> Optional[str]:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


InnerTool = Annotated[Union[Annotated[FunctionTool, Tag("function")],
                            Annotated[CustomTool, Tag("custom")]], Discriminator(_inner_type)]


class NamespaceTool(BaseModel):
    """Functions grouped under a name (Codex: MCP servers, its agent tools)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["namespace"]
    name: StrictStr
    description: Optional[StrictStr] = None
    tools: list[InnerTool]


class HostedTool(BaseModel):
    """A tool OpenAI's servers run (``web_search``, ``file_search``,
    ``code_interpreter``, ...): this server cannot, so the model is not
    offered it."""
    model_config = ConfigDict(extra="allow")
    type: StrictStr


def _tool_type(value: Any) -> str:
    kind = _inner_type(value)
    return kind if kind in ("function", "custom", "namespace") else "hosted"


Tool = Annotated[Union[Annotated[FunctionTool, Tag("function")],
                       Annotated[CustomTool, Tag("custom")],
                       Annotated[NamespaceTool, Tag("namespace")],
                       Annotated[HostedTool, Tag("hosted")]], Discriminator(_tool_type)]


class Offered(NamedTuple):
    """What a name the model calls stands for."""
    name: str
    namespace: Optional[str]
    custom: bool


class FunctionChoice(BaseModel):
    """A call to this tool, forced: a function's or a custom tool's name, as
    the model sees it (a namespaced function's qualified name)."""
    type: Literal["function", "custom"]
    name: StrictStr


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[StrictStr] = None
    schema_: Optional[Union[dict[StrictStr, Any], StrictBool]] = Field(None, alias="schema")
    description: Optional[StrictStr] = None
    strict: Optional[StrictBool] = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: Optional[TextFormat] = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # include, prompt_cache_key, client_metadata, ...

    model: StrictStr
    input: Union[StrictStr, list[InputItem]]
    instructions: Optional[StrictStr] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], FunctionChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    max_output_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    text: Optional[TextOptions] = None
    reasoning: Optional[dict[StrictStr, Any]] = None  # effort and summary: not used
    stream: StrictBool = False
    store: Optional[StrictBool] = None  # accepted; nothing is stored
    metadata: Optional[dict[StrictStr, Any]] = None
    previous_response_id: Optional[StrictStr] = None
    conversation: Optional[Any] = None
    background: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _text_is_unicode(self):
        """Every string well-formed Unicode, ``metadata`` (echoed back) too."""
        return refuse_lone_surrogates(self)

    def to_chat(self) -> ChatCompletionRequest:
        self._check_stateless()
        fields: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        # Only fields the client sent: one left out takes the server's default (--temp...).
        fields.update({name: getattr(self, name) for name in ("temperature", "top_p")
                       if name in self.model_fields_set})
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        offered = self._chat_tools()
        if offered:
            fields["tools"] = offered
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function",
                                     "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self._response_format(self.text.format)
        return chat_request(fields)

    def offered(self) -> dict[str, Offered]:
        """Each name the model may call, and the tool it stands for."""
        out = {}
        for tool, namespace in self._callable():
            out[qualified(namespace, tool.name)] = Offered(
                tool.name, namespace, isinstance(tool, CustomTool))
        return out

    def hosted_tools(self) -> list[str]:
        """The types of the tools left out: the server cannot run them."""
        return [t.type for t in self.tools or [] if isinstance(t, HostedTool)]

    def _callable(self) -> list[tuple]:
        out = []
        for tool in self.tools or []:
            if isinstance(tool, NamespaceTool):
                out += [(inner, tool.name) for inner in tool.tools]
            elif not isinstance(tool, HostedTool):
                out.append((tool, None))
        return out

    def _chat_tools(self) -> list[dict]:
        hosted = self.hosted_tools()
        if hosted:
            log.info("responses: left out of the prompt, the server cannot run them: %s",
                     ", ".join(hosted))
        return [{"type": "function", "function": tool.chat_function(namespace)}
                for tool, namespace in self._callable()]

    def text_format(self) -> dict:
        """``text`` as a response echoes it."""
        fmt = self.text.format if self.text is not None else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None else {"type": "text"}}

    def _check_stateless(self) -> None:
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported: this server keeps no responses; "
                               "send the whole conversation as input items", param=name)
        if self.background:
            raise APIError(400, "background responses are not supported", param="background")

    def _messages(self) -> list[dict]:
        out: list[dict] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.chat_content(f"input.{i}.content")})
            elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
                call = item.chat_call()
                if out and out[-1]["role"] == "assistant":  # calls join the turn they are in
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    @staticmethod
    def _response_format(fmt: TextFormat) -> dict:
        if fmt.type != "json_schema":
            return {"type": fmt.type}
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema",
                           param="text.format.schema")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_,
            **({"strict": fmt.strict} if fmt.strict is not None else {})}}
