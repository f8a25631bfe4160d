"""OpenAI response bodies built from a request's events: whole, or as
stream chunks, with usage and logprobs, and tool calls split out of the text."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional

from ..serving.request import DoneEvent, TextEvent
from ..text.tool_calls import ToolCallReader, ToolMarkers


def usage_body(done: DoneEvent) -> dict:
    """The usage object of a finished request."""
    usage = {
        "prompt_tokens": done.prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    if done.spec_decode is not None:
        usage["spec_decode"] = done.spec_decode
    if done.forced_tokens is not None:  # a grammar constrained the output
        usage["structured_output"] = {"forced_tokens": done.forced_tokens}
    details = {}
    if done.reasoning_tokens is not None:  # the model has thinking markers
        details["reasoning_tokens"] = done.reasoning_tokens
    if done.prediction is not None:  # the request predicted its output
        accepted, rejected = done.prediction
        details.update(accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)
    if details:
        usage["completion_tokens_details"] = details
    return usage


def reasoning_fields(text: str) -> dict:
    """A message's (or delta's) reasoning, under both names clients read."""
    return {"reasoning": text, "reasoning_content": text}


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[dict]) -> dict:
    """OpenAI chat ``logprobs`` from the scheduler's per-token entries."""
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": _token_bytes(e["token"]),
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": _token_bytes(t["token"])}
                    for t in e["top"]
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[dict]) -> dict:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
    offsets = []
    pos = 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
        "text_offset": offsets,
    }


class _Answer:
    """One completion's answer, built from its scheduler events: whole, or as
    stream chunks that share one id. ``logprobs``: whether they were asked for."""

    prefix = ""
    chunk_object = ""

    def __init__(self, model: str, logprobs: bool):
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs

    def usage_chunk(self, done: DoneEvent) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage_body(done)}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class ChatAnswer(_Answer):
    """A chat completion. When the request offered tools (``markers``), calls
    in the text come back as ``tool_calls``, by the same rules whole or streamed.
    Reasoning (a thinking model's) comes as ``reasoning`` and, the same text,
    ``reasoning_content`` (vLLM's name), apart from ``content``; tool calls
    are read from the answer only. A call to one of the ``custom`` (freeform)
    tools comes back as ``{"type": "custom", "custom": {"name", "input"}}``."""

    prefix, chunk_object = "chatcmpl", "chat.completion.chunk"

    def __init__(self, model: str, logprobs: bool, markers: Optional[ToolMarkers] = None,
                 parallel: bool = True, custom: frozenset = frozenset()):
        super().__init__(model, logprobs)
        self.tools = ToolCallReader(markers, parallel) if markers else None
        self.custom = custom

    def _calls(self, deltas: list[dict]) -> list[dict]:
        if self.custom:
            for d in deltas:
                if "tool_calls" in d:
                    d["tool_calls"] = [custom_call(c, self.custom) for c in d["tool_calls"]]
        return deltas

    def first_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text_chunks(self, event: TextEvent) -> list[dict]:
        lp = chat_logprobs(event.logprobs) if event.logprobs else None
        deltas = [reasoning_fields(event.reasoning)] if event.reasoning else []
        if self.tools is None:
            if event.text or not deltas:
                deltas.append({"content": event.text})
        else:  # the logprobs ride on the first delta, or on an empty one
            deltas += self._calls(self.tools.feed(event.text))
            deltas = deltas or ([{}] if lp else [])
        return [self._chunk(d, logprobs=lp if i == 0 else None) for i, d in enumerate(deltas)]

    def done_chunks(self, done: DoneEvent) -> list[dict]:
        reason, chunks = done.finish_reason, []
        if self.tools is not None:
            chunks = [self._chunk(d) for d in self._calls(self.tools.close())]
            reason = self.tools.finish_reason(reason)
        return chunks + [self._chunk({}, reason)]

    def whole(self, text: str, entries: list[dict], done: DoneEvent) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if done.reasoning:
            message.update(reasoning_fields(done.reasoning))
        reason = done.finish_reason
        if self.tools is not None:
            content, calls = self.tools.read_all(text)
            calls = [custom_call(c, self.custom) for c in calls]
            message["content"] = content
            if calls:
                message.update(content=content or None, tool_calls=calls)
            reason = self.tools.finish_reason(reason)
        return {**self._head("chat.completion"), "choices": [{
            "index": 0, "message": message,
            "logprobs": chat_logprobs(entries) if self.logprobs else None,
            "finish_reason": reason,
        }], "usage": usage_body(done)}

    def _chunk(self, delta: dict, finish_reason=None, logprobs=None) -> dict:
        return {**self._head(self.chunk_object), "choices": [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def custom_call(call: dict, custom: frozenset) -> dict:
    """A parsed function call as a custom tool's call when it names one: its
    ``input`` argument (the whole arguments text if it has none)."""
    function = call.get("function") or {}
    if function.get("name") not in custom:
        return call
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = None
    text = arguments["input"] if isinstance(arguments, dict) and isinstance(
        arguments.get("input"), str) else function.get("arguments", "")
    rest = {k: v for k, v in call.items() if k not in ("type", "function")}
    return {**rest, "type": "custom", "custom": {"name": function["name"], "input": text}}


class CompletionAnswer(_Answer):
    """A text completion."""

    prefix, chunk_object = "cmpl", "text_completion"

    def first_chunks(self) -> list[dict]:
        return []

    def text_chunks(self, event: TextEvent) -> list[dict]:
        lp = completion_logprobs(event.logprobs) if event.logprobs else None
        return [self._chunk(event.text, logprobs=lp)]

    def done_chunks(self, done: DoneEvent) -> list[dict]:
        return [self._chunk("", done.finish_reason)]

    def whole(self, text: str, entries: list[dict], done: DoneEvent) -> dict:
        logprobs = completion_logprobs(entries) if self.logprobs else None
        return {**self._chunk(text, done.finish_reason, logprobs), "usage": usage_body(done)}

    def _chunk(self, text: str, finish_reason=None, logprobs=None) -> dict:
        return {**self._head(self.chunk_object), "choices": [
            {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


class FromChat:
    """An answer in another API's wire format (Anthropic's messages, the
    Responses API), made from the chat answer's deltas: a subclass turns
    deltas into its events (``_events``) and says what its whole body is
    (``whole_body``); the whole body is the stream played into one."""

    def __init__(self, chat: ChatAnswer):
        self.chat = chat

    def text_chunks(self, event: TextEvent) -> list:
        return self._events(deltas(self.chat.text_chunks(event)))

    def whole(self, text: str, entries: list, done: DoneEvent, reasoning: str = "") -> dict:
        self.first_chunks()
        self.text_chunks(TextEvent(text, reasoning=reasoning))
        self.done_chunks(done)
        return self.whole_body()


def deltas(chunks: list[dict]) -> list[dict]:
    """The deltas of chat completion chunks."""
    return [c["choices"][0]["delta"] for c in chunks]
