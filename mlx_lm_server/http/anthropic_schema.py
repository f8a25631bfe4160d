"""The Anthropic Messages API on the wire (``POST /v1/messages``): request
schemas, their translation into the one chat request the server runs
(``ChatCompletionRequest``), and Anthropic's error object.

What a chat request cannot say is refused with a 400 rather than dropped:
document blocks, images in an assistant or system message, a last
assistant message (a prefill), a forced tool choice without tools. Image
blocks (base64 or a URL), in a user message or in a ``tool_result``'s
content, become the chat message's image parts (a tool result's: the tool
message's, laid out as the chat template takes them, ``tool_images.py``).
``metadata`` and ``cache_control`` are accepted
and ignored; earlier thinking blocks are dropped, as chat templates drop
earlier reasoning.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from .api_error import APIError
from .openai_schema import ChatCompletionRequest

# Anthropic's error type for each status (others: invalid_request_error or api_error).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class ImageSource(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["base64", "url"]
    media_type: Optional[StrictStr] = None
    data: Optional[StrictStr] = None
    url: Optional[StrictStr] = None


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource

    def chat_part(self, where: str) -> dict:
        """The chat request's image part: a data URL for base64 data."""
        src = self.source
        if src.type == "url":
            if src.url is None:
                raise APIError(400, f"{where}.source: an image source of type 'url' needs "
                               "its url", param=f"{where}.source")
            url = src.url
        else:
            if src.data is None:
                raise APIError(400, f"{where}.source: an image source of type 'base64' "
                               "needs its data", param=f"{where}.source")
            url = f"data:{src.media_type or 'image/png'};base64,{src.data}"
        return {"type": "image_url", "image_url": {"url": url}, "source_param": where}


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[StrictStr, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Union[StrictStr, list[Annotated[Union[TextBlock, ImageBlock],
                                             Field(discriminator="type")]]] = ""
    is_error: Optional[StrictBool] = None

    def chat_content(self, where: str):
        """The tool message's content: its text, or with images, the chat's
        parts in order (each image's param ``where.content.k``)."""
        if isinstance(self.content, str):
            return self.content
        return _user_content([b.chat_part(f"{where}.content.{k}") if b.type == "image" else b
                              for k, b in enumerate(self.content)])


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: Optional[StrictStr] = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: StrictStr


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # "system": Claude Code (2.1.x) sends context mid-conversation as system
    # messages (the beta mid-conversation-tool-changes); kept in place, so
    # that the prompt before it stays the same bytes turn after turn.
    role: Literal["user", "assistant", "system"]
    content: Union[StrictStr, list[Block]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Optional[Literal["custom"]] = None
    name: StrictStr
    description: Optional[StrictStr] = None
    input_schema: dict[StrictStr, Any]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[StrictStr] = None
    disable_parallel_tool_use: Optional[StrictBool] = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[Annotated[StrictInt, Field(ge=0)]] = None


class CountTokensRequest(BaseModel):
    """A Messages request as ``/v1/messages/count_tokens`` takes it: the prompt only."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Optional[Union[StrictStr, list[TextBlock]]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    # Qwen3-style templates read enable_thinking; others ignore it.
    thinking: Optional[Thinking] = None

    def to_chat(self) -> ChatCompletionRequest:
        return self._chat(max_tokens=1)

    def _chat(self, **sampling) -> ChatCompletionRequest:
        fields: dict[str, Any] = {"model": self.model, **sampling,
                                  "messages": chat_messages(self.system, self.messages)}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}}
                for t in self.tools]
        fields.update(self._tool_choice())
        if self.thinking is not None:
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return chat_request(fields)

    def _tool_choice(self) -> dict:
        choice = self.tool_choice
        if choice is None:
            return {}
        if choice.type in ("any", "tool") and not self.tools:
            raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, "tool_choice of type 'tool' needs a name", param="tool_choice.name")
        out: dict[str, Any] = {"tool_choice": {
            "auto": "auto", "any": "required", "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}}}[choice.type]}
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: Optional[list[StrictStr]] = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0
    stream: StrictBool = False
    metadata: Optional[dict[StrictStr, Any]] = None  # accepted, not used

    def to_chat(self) -> ChatCompletionRequest:
        # Only fields the client sent: one left out takes the server's default (--temp...).
        sampling = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k")
                    if name in self.model_fields_set}
        return self._chat(max_tokens=self.max_tokens, stop=self.stop_sequences, **sampling)


def chat_messages(system, messages: list[Message]) -> list[dict]:
    """Chat messages for Anthropic's system prompt and messages: tool_use
    blocks become an assistant's tool_calls, tool_result blocks tool messages."""
    out: list[dict] = []
    if system:
        out.append({"role": "system",
                    "content": system if isinstance(system, str) else _joined(system)})
    for i, m in enumerate(messages):
        if not isinstance(m.content, str) and not m.content:  # as Anthropic's API answers
            raise APIError(400, f"messages.{i}: all messages must have non-empty content",
                           param=f"messages.{i}.content")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "system":
            out.append({"role": "system", "content": _joined(_text_only(m.content, i))})
        elif m.role == "assistant":
            out.append(_assistant(m.content, i))
        else:
            out.extend(_user(m.content, i))
    if messages[-1].role == "assistant":
        raise APIError(400, "a last assistant message (a prefill to continue) is not supported; "
                       "end with a user message", param=f"messages.{len(messages) - 1}")
    return out


def _assistant(blocks: list, i: int) -> dict:
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if b.type == "tool_use"]
    for kind in ("tool_result", "image"):
        if any(b.type == kind for b in blocks):
            raise APIError(400, f"{kind} blocks belong in user messages",
                           param=f"messages.{i}.content")
    message: dict[str, Any] = {"role": "assistant",
                               "content": _joined([b for b in blocks if b.type == "text"])}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list, i: int) -> list[dict]:
    """Tool results as tool messages, text and images between them as user
    messages, in order."""
    out, text = [], []
    for j, b in enumerate(blocks):
        if b.type == "tool_use":
            raise APIError(400, "tool_use blocks belong in assistant messages",
                           param=f"messages.{i}.content")
        if b.type == "text":
            text.append(b)
        elif b.type == "image":
            text.append(b.chat_part(f"messages.{i}.content.{j}"))
        elif b.type == "tool_result":
            if text:
                out.append({"role": "user", "content": _user_content(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": b.chat_content(f"messages.{i}.content.{j}")})
    if text or not out:
        out.append({"role": "user", "content": _user_content(text)})
    return out


def _user_content(items: list):
    """Text blocks joined, as before; with images, the chat's parts in order."""
    if all(isinstance(item, TextBlock) for item in items):
        return _joined(items)
    return [{"type": "text", "text": item.text} if isinstance(item, TextBlock) else item
            for item in items]


def _text_only(blocks: list, i: int) -> list:
    if any(b.type != "text" for b in blocks):
        raise APIError(400, "a system message holds text blocks only",
                       param=f"messages.{i}.content")
    return blocks


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def chat_request(fields: dict) -> ChatCompletionRequest:
    """The chat request for translated ``fields``; a 400 when they do not make one."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", param=where or None) from None
