"""An Anthropic message built from a chat answer's deltas: the documented
stream events (``message_start``, ``content_block_start`` / ``_delta`` /
``_stop``, ``message_delta``, ``message_stop``, ``ping``), or the whole
message, which is the same events played into one body.

A chat delta's ``content`` becomes a text block, its ``reasoning`` (when the
model thinks) a thinking block, each tool call a tool_use block. A stop is
``end_turn``, or ``stop_sequence`` naming the sequence that ends in the
request's last generated token.
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from ..serving.request import DoneEvent, ErrorEvent, TextEvent
from .anthropic_schema import anthropic_error_body
from .openai_answer import ChatAnswer, FromChat, deltas

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class MessagesAnswer(FromChat):
    """One message, from its chat answer's chunks; ``on_text`` is shown every
    text event (the token ids name the stop sequence)."""

    def __init__(self, chat: ChatAnswer, model: str, prompt_tokens: int, stops: list[str],
                 tokenizer):
        super().__init__(chat)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.stops = stops
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.blocks: list[dict] = []
        self.open: Optional[str] = None  # the type of the block being written
        self.stop_reason: Optional[str] = None
        self.stop_sequence: Optional[str] = None
        self.usage = {"input_tokens": prompt_tokens, "output_tokens": 0}

    def on_text(self, event: TextEvent) -> None:
        self.token_ids.extend(event.token_ids)

    def first_chunks(self) -> list:
        self.chat.first_chunks()  # the role, which a message_start carries
        start = {**self.whole_body(), "content": [], "usage": dict(self.usage)}
        return [("message_start", {"type": "message_start", "message": start}),
                ("ping", {"type": "ping"})]

    def done_chunks(self, done: DoneEvent) -> list:
        chunks = self.chat.done_chunks(done)
        events = self._events(deltas(chunks)) + self._close()
        self.stop_reason, self.stop_sequence = self._stop(chunks[-1]["choices"][0]["finish_reason"])
        usage = self.chat.usage_chunk(done)["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.usage = {"input_tokens": usage["prompt_tokens"] - cached,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
                      "output_tokens": usage["completion_tokens"]}
        return events + [
            ("message_delta", {"type": "message_delta", "usage": self.usage, "delta": {
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}}),
            ("message_stop", {"type": "message_stop"})]

    def error_chunks(self, event: ErrorEvent) -> list:
        return [("error", anthropic_error_body(503 if event.code == "shutting_down" else 500,
                                               event.message))]

    def whole_body(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": self.usage}

    def _events(self, deltas: list[dict]) -> list:
        events = []
        for delta in deltas:
            if delta.get("reasoning"):
                events += self._write("thinking", "thinking", delta["reasoning"])
            if delta.get("content"):
                events += self._write("text", "text", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_use(call)
        return events

    def _write(self, kind: str, field: str, text: str) -> list:
        """``text`` added to the open block of ``kind``, opening one if needed."""
        events = []
        if self.open != kind:
            events = self._close()
            start = {"type": kind, field: "", **({"signature": ""} if kind == "thinking" else {})}
            events += self._start(start)
        self.blocks[-1][field] += text
        events.append(self._delta({"type": f"{field}_delta", field: text}))
        return events

    def _tool_use(self, call: dict) -> list:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):  # not an input object: the call stays text
            return self._write("text", "text", json.dumps(function, ensure_ascii=False))
        events = self._close()
        events += self._start({"type": "tool_use", "id": call["id"], "name": function["name"],
                               "input": {}})
        self.blocks[-1]["input"] = arguments
        events.append(self._delta({"type": "input_json_delta",
                                   "partial_json": json.dumps(arguments, ensure_ascii=False)}))
        return events + self._close()

    def _start(self, block: dict) -> list:
        self.blocks.append(dict(block))
        self.open = block["type"]
        return [("content_block_start", {"type": "content_block_start",
                                         "index": len(self.blocks) - 1, "content_block": block})]

    def _delta(self, delta: dict) -> tuple:
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": len(self.blocks) - 1, "delta": delta})

    def _close(self) -> list:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop",
                                        "index": len(self.blocks) - 1})]

    def _stop(self, finish_reason: str) -> tuple[str, Optional[str]]:
        if finish_reason != "stop":
            return STOP_REASONS.get(finish_reason, "end_turn"), None
        if self.stops and self.token_ids:
            # A stop string ends in the last token (the first one to end
            # there); text before it, the reasoning say, may hold any.
            text = self.tokenizer.decode(self.token_ids)
            last = len(self.tokenizer.decode(self.token_ids[:-1]))
            hits = [(at, s) for s in self.stops
                    if (at := text.find(s, max(0, last - len(s) + 1))) >= 0]
            if hits:
                return "stop_sequence", min(hits)[1]
        return "end_turn", None
