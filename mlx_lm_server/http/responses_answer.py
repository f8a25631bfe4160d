"""A Responses API response built from a chat answer's deltas: the
documented semantic stream events, each with its ``sequence_number``, or the
whole response object, which is the same events played into one body.

A chat delta's ``reasoning`` (when the model thinks) becomes a reasoning
item, its ``content`` a message item with one output_text part, each tool
call a function_call item (with its ``namespace`` for a namespaced
function) or, for a custom tool, a custom_tool_call item whose ``input`` is
the text the model wrote. A response cut by ``max_output_tokens`` is
``incomplete``, its last item too.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional

from ..decoding.sampling import SamplingParams
from ..serving.request import DoneEvent, ErrorEvent
from .openai_answer import ChatAnswer, FromChat, deltas
from .responses_schema import ResponsesRequest

# The output item of each kind of delta, and the field its text goes to.
ITEMS = {"reasoning": ("rs", "reasoning_text"), "content": ("msg", "output_text")}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesAnswer(FromChat):
    """One response, from its chat answer's chunks."""

    def __init__(self, chat: ChatAnswer, model: str, body: ResponsesRequest,
                 sampling: Optional[SamplingParams] = None):
        super().__init__(chat)
        # What was applied: a field the client left out took the server's
        # default (--temp, --top-p), which the response must echo, not 1.0.
        self.sampling = sampling
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.body = body
        self.seq = 0
        self.output: list[dict] = []
        self.open: Optional[str] = None  # the kind of the item being written
        self.status = "in_progress"
        self.usage: Optional[dict] = None
        self.offered = body.offered()

    def first_chunks(self) -> list:
        self.chat.first_chunks()
        return [self._event("response.created", response=self._response()),
                self._event("response.in_progress", response=self._response())]

    def done_chunks(self, done: DoneEvent) -> list:
        chunks = self.chat.done_chunks(done)
        events = self._events(deltas(chunks))
        self.status = "incomplete" if done.finish_reason == "length" else "completed"
        events += self._close()
        usage = self.chat.usage_chunk(done)["usage"]
        details = usage.get("completion_tokens_details") or {}
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}
        return events + [self._event(f"response.{self.status}", response=self._response())]

    def error_chunks(self, event: ErrorEvent) -> list:
        self.status = "failed"
        error = {"code": event.code or event.type, "message": event.message}
        return [self._event("error", **error, param=None),
                self._event("response.failed", response=self._response(error))]

    def whole_body(self) -> dict:
        return self._response()

    def _response(self, error: Optional[dict] = None) -> dict:
        b = self.body
        tool_choice: Any = b.tool_choice if b.tool_choice is not None else "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if self.status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.model, "output": [dict(item) for item in self.output],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": bool(b.store), "temperature": self._applied("temperature"),
            "top_p": self._applied("top_p"),
            "text": b.text_format(), "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "truncation": "disabled", "usage": self.usage, "metadata": self._metadata(),
        }

    def _metadata(self) -> dict:
        """The request's own, and the hosted tools the model was not offered."""
        hosted = self.body.hosted_tools()
        return {**(self.body.metadata or {}),
                **({"ignored_tools": ",".join(hosted)} if hosted else {})}

    def _applied(self, name: str) -> float:
        return getattr(self.sampling if self.sampling is not None else self.body, name)

    def _events(self, deltas: list[dict]) -> list:
        events = []
        for delta in deltas:
            for kind in ("reasoning", "content"):
                if delta.get(kind):
                    events += self._write(kind, delta[kind])
            for call in delta.get("tool_calls") or []:
                events += self._function_call(call)
        return events

    def _write(self, kind: str, text: str) -> list:
        """``text`` added to the open item of ``kind``, opening one if needed."""
        events = []
        if self.open != kind:
            events = self._close()
            events += self._open(kind)
        item = self.output[-1]
        item["content"][0]["text"] += text
        _, part = ITEMS[kind]
        events.append(self._event(f"response.{part}.delta", **self._where(), delta=text,
                                  **({"logprobs": []} if kind == "content" else {})))
        return events

    def _open(self, kind: str) -> list:
        prefix, part = ITEMS[kind]
        item: dict[str, Any] = {"id": _id(prefix), "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}
        if kind == "reasoning":
            item = {"id": item["id"], "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
        self.output.append(item)
        self.open = kind
        empty = {"type": part, "text": "", **({"annotations": [], "logprobs": []}
                                              if kind == "content" else {})}
        events = [self._event("response.output_item.added", output_index=len(self.output) - 1,
                              item=_copy(item))]
        item["content"].append(dict(empty))
        return events + [self._event("response.content_part.added", **self._where(), part=empty)]

    def _close(self) -> list:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        item = self.output[-1]
        item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        _, part_type = ITEMS[kind]
        part = item["content"][0]
        text_done = {"text": part["text"], **({"logprobs": []} if kind == "content" else {})}
        return [self._event(f"response.{part_type}.done", **self._where(), **text_done),
                self._event("response.content_part.done", **self._where(), part=dict(part)),
                self._event("response.output_item.done", output_index=len(self.output) - 1,
                            item=_copy(item))]

    def _function_call(self, call: dict) -> list:
        events = self._close()
        function = call["function"]
        tool = self.offered.get(function["name"])
        if tool is not None and tool.custom:
            return events + self._custom_tool_call(call["id"], tool, function["arguments"])
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": function["name"], "arguments": ""}
        if tool is not None and tool.namespace is not None:
            item.update(name=tool.name, namespace=tool.namespace)
        index, where = self._add(item)
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=_copy(item)))
        item.update(arguments=function["arguments"], status="completed")
        return events + [
            self._event("response.function_call_arguments.delta", **where,
                        delta=function["arguments"]),
            self._event("response.function_call_arguments.done", **where,
                        name=item["name"], arguments=function["arguments"]),
            self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _custom_tool_call(self, call_id: str, tool, arguments: str) -> list:
        text = _custom_input(arguments)
        item = {"id": _id("ctc"), "type": "custom_tool_call", "status": "in_progress",
                "call_id": call_id, "name": tool.name, "input": ""}
        if tool.namespace is not None:
            item["namespace"] = tool.namespace
        index, where = self._add(item)
        added = self._event("response.output_item.added", output_index=index, item=_copy(item))
        item.update(input=text, status="completed")
        return [added,
                self._event("response.custom_tool_call_input.delta", **where, delta=text),
                self._event("response.custom_tool_call_input.done", **where, input=text),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _add(self, item: dict) -> tuple[int, dict]:
        self.output.append(item)
        index = len(self.output) - 1
        return index, {"item_id": item["id"], "output_index": index}

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1,
                "content_index": 0}

    def _event(self, kind: str, **fields) -> tuple:
        self.seq += 1
        return (kind, {"type": kind, "sequence_number": self.seq - 1, **fields})


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item \
        else dict(item)


def _custom_input(arguments: str) -> str:
    """A custom tool's text from the call the model wrote as a function of
    one ``input``: that string, or the arguments as written when the model
    wrote something else."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return parsed["input"]
    return arguments
