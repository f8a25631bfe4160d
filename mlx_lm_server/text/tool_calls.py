"""Tool calls in generated text, turned into OpenAI ``tool_calls``.

Models that call tools write each call between markers their chat template
defines (Qwen2.5: ``<tool_call>`` ... ``</tool_call>``); mlx-lm's tokenizer
wrapper knows the markers and a parser for the text between them
(``tokenizer.tool_parser``), as upstream ``mlx_lm.server`` uses them. Here
the text is split into content and call texts (in a stream, holding back
what may be the start of a marker), and each call is parsed into
``{"id", "type": "function", "function": {"name", "arguments"}}``. A call
that does not parse (cut off by ``max_tokens``, say) is returned as content,
never dropped. A whole completion is read by the same rules as a stream.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, NamedTuple, Optional

from .stop_strings import held_back

log = logging.getLogger("mlx_lm_server")


class ToolMarkers(NamedTuple):
    """How one request's tool calls are written: between ``start`` and
    ``end``, read by ``parser``, for the ``tools`` the template offered."""

    start: str
    end: str
    parser: Callable
    tools: list[dict]


class ToolCallSplitter:
    """Streamed text in, ``("content", text)`` and ``("call", text)`` pieces out."""

    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        out = []
        while True:
            marker = self.end if self._in_call else self.start
            at = self._buffer.find(marker)
            if at < 0:
                break
            piece, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
            if self._in_call:
                out.append(("call", piece))
            elif piece:
                out.append(("content", piece))
            self._in_call = not self._in_call
        if not self._in_call:
            # Everything but a suffix that could begin the start marker.
            keep = held_back(self._buffer, [self.start])
            if len(self._buffer) > keep:
                out.append(("content", self._buffer[: len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep:]
        return out

    def close(self) -> list[tuple[str, str]]:
        """What is left at the end: an unterminated call is still tried as one."""
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        return [("call" if self._in_call else "content", rest)]


class ToolCallReader:
    """Generated text in, chat deltas out: ``{"content": text}``, and each
    parsed call as ``{"tool_calls": [{"index": i, ...call}]}``. With
    ``parallel`` false only the first call is kept (``parallel_tool_calls``)."""

    def __init__(self, markers: ToolMarkers, parallel: bool = True):
        self.markers = markers
        self.parallel = parallel
        self.num_calls = 0
        self._splitter = ToolCallSplitter(markers.start, markers.end)

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self._splitter.feed(text))

    def close(self) -> list[dict]:
        return self._deltas(self._splitter.close())

    def read_all(self, text: str) -> tuple[str, list[dict]]:
        """A whole completion: (its content, its tool calls)."""
        deltas = self.feed(text) + self.close()
        content = "".join(d.get("content", "") for d in deltas)
        calls = [{k: v for k, v in call.items() if k != "index"}
                 for d in deltas for call in d.get("tool_calls", [])]
        return content, calls

    def finish_reason(self, reason: str) -> str:
        """A completion that stopped by itself after calling tools says so."""
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    def _deltas(self, pieces: list[tuple[str, str]]) -> list[dict]:
        deltas = []
        for kind, piece in pieces:
            calls = parse_call(piece, self.markers.parser, self.markers.tools) \
                if kind == "call" else None
            if calls is None:
                text = piece if kind == "content" else self.markers.start + piece
                if text:
                    deltas.append({"content": text})
                continue
            for call in calls:
                if self.num_calls and not self.parallel:
                    break
                deltas.append({"tool_calls": [{"index": self.num_calls, **call}]})
                self.num_calls += 1
        return deltas


def parse_call(text: str, parser: Callable, tools: Optional[list]) -> Optional[list[dict]]:
    """OpenAI tool calls from one call's text; None when it does not parse."""
    try:
        parsed = parser(text.strip(), tools)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        log.warning("a tool call did not parse (%s: %s); returned as text", type(e).__name__, e)
        return None
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                      "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
    return calls


def template_messages(messages: list) -> list[dict]:
    """Chat messages as chat templates expect them: an assistant's earlier
    calls with their arguments as objects (OpenAI sends JSON strings), a
    tool's answer with the id of the call it answers."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            entry["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    return out


def _template_call(call: dict) -> dict:
    if call.get("type") == "custom":  # a freeform tool's call: the function the template saw
        custom = call.get("custom") or {}
        return {"id": call.get("id"), "type": "function", "function": {
            "name": custom.get("name"), "arguments": {"input": custom.get("input", "")}}}
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}
