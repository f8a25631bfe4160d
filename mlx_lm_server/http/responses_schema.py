"""The OpenAI Responses API on the wire (``POST /v1/responses``): request
schemas and their translation into the one chat request the server runs
(``ChatCompletionRequest``). Errors keep OpenAI's error object.

The server keeps no state: ``store`` is accepted and nothing is stored, so
``previous_response_id``, ``conversation`` and ``background`` are a 400
(send the whole conversation as ``input`` items instead). Input images and
files, and tools other than functions, are refused by the schema; earlier
reasoning items are dropped, as chat templates drop earlier reasoning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
)

from .anthropic_schema import chat_request
from .openai_schema import APIError, ChatCompletionRequest


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")  # ids, statuses, annotations


class TextContent(_Item):
    type: Literal["input_text", "output_text"]
    text: StrictStr


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[StrictStr, list[TextContent]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Union[StrictStr, list[TextContent]]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else \
            "".join(part.text for part in self.output)


class ReasoningItem(_Item):
    type: Literal["reasoning"]


def _item_type(value: Any) -> Optional[str]:
    """A message item may leave out its type."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Union[
    Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
    Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[dict[StrictStr, Any]] = None
    strict: Optional[StrictBool] = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
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
    model_config = ConfigDict(extra="ignore")  # metadata, user, include, truncation...

    model: StrictStr
    input: Union[StrictStr, list[InputItem]]
    instructions: Optional[StrictStr] = None
    tools: Optional[list[FunctionTool]] = None
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

    def to_chat(self) -> ChatCompletionRequest:
        self._check_stateless()
        fields: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        # Only fields the client sent: one left out takes the server's default (--temp...).
        fields.update({name: getattr(self, name) for name in ("temperature", "top_p")
                       if name in self.model_fields_set})
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type", "strict"}, exclude_none=True)} for t in self.tools]
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
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
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
