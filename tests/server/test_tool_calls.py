"""Tool calling: tools reach the chat template, tool calls in the output come
back as OpenAI ``tool_calls``, whole and streamed, through the official client.

The parser is the real one of Qwen2.5-Coder's tokenizer (``<tool_call>``
markers around a JSON object, as its template asks). Left to choose, the
small Qwen2.5-Coder models here answer tool requests with bare or fenced
JSON, never the markers (tried: plain, few-shot histories, asking to copy a
tagged call), so the path from freely tagged output to ``tool_calls`` over
HTTP is driven by a scripted generator: the one stand-in here, for a model
output no model at hand makes. ``tool_choice`` "required" or a named
function makes the real model call, through a grammar (``structured.py``).
"""

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from mlx_lm_server.serving.request import DoneEvent, TextEvent
from mlx_lm_server.text.tool_calls import ToolCallReader, ToolCallSplitter, ToolMarkers, parse_call

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
OUTPUT = "Let me check.\n" + CALL + "\n" + CALL.replace("Rome", "Oslo")


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen05_path):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(qwen05_path))
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    return tokenizer


def _markers(tokenizer) -> ToolMarkers:
    return ToolMarkers(tokenizer.tool_call_start, tokenizer.tool_call_end,
                       tokenizer.tool_parser, TOOLS)


def test_calls_are_split_out_whole_and_at_every_chunking(qwen_tokenizer):
    markers = _markers(qwen_tokenizer)
    content, calls = ToolCallReader(markers).read_all(OUTPUT)
    assert content == "Let me check.\n\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"},
                                                                        {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for size in range(1, len(OUTPUT) + 1):
        splitter = ToolCallSplitter(*markers[:2])
        pieces = []
        for i in range(0, len(OUTPUT), size):
            pieces += splitter.feed(OUTPUT[i:i + size])
        pieces += splitter.close()
        assert "".join(p for k, p in pieces if k == "content") == content, size
        assert [parse_call(p, *markers[2:])[0]["function"]["arguments"]
                for k, p in pieces if k == "call"] == [c["function"]["arguments"] for c in calls]


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_and_whole_read_the_same(qwen_tokenizer, parallel):
    """One set of rules: the deltas of a stream, at every chunking, add up to
    the whole reading; ``parallel_tool_calls: false`` keeps the first call."""
    markers = _markers(qwen_tokenizer)
    whole = ToolCallReader(markers, parallel)
    content, calls = whole.read_all(OUTPUT)
    assert content == "Let me check.\n\n" and len(calls) == (2 if parallel else 1)
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"

    def named(call):
        return call["function"]["name"], call["function"]["arguments"]

    for size in range(1, len(OUTPUT) + 1):
        reader = ToolCallReader(markers, parallel)
        deltas = []
        for i in range(0, len(OUTPUT), size):
            deltas += reader.feed(OUTPUT[i:i + size])
        deltas += reader.close()
        assert "".join(d.get("content", "") for d in deltas) == content, size
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["index"] for c in streamed] == list(range(len(calls)))
        assert [named(c) for c in streamed] == [named(c) for c in calls], size
        assert reader.finish_reason("stop") == "tool_calls"


def test_a_call_that_does_not_parse_stays_text(qwen_tokenizer):
    cut = "Sure. <tool_call>\n{\"name\": \"get_weather\", \"argum"
    content, calls = ToolCallReader(_markers(qwen_tokenizer)).read_all(cut)
    assert calls == [] and content == cut
    text = "No tools needed: a < b and <tool is not a marker."
    assert ToolCallReader(_markers(qwen_tokenizer)).read_all(text) == (text, [])


# ---- over HTTP with the real model -----------------------------------------------


@pytest.fixture(scope="module")
def qwen_server(qwen05_path):
    from conftest import LiveServer

    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    server = LiveServer(qwen05_path, spec=SpecDecodeConfig(mode="ngram", calibration_seconds=0))
    yield server
    server.close()


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def test_tools_and_tool_history_reach_the_template(qwen_server):
    """The tool catalogue and an earlier call with its result are in the prompt
    (more prompt tokens), and the request completes, speculating."""
    client = _client(qwen_server)
    question = [{"role": "user", "content": "What is the weather in Rome?"}]
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ] + question
    plain = client.chat.completions.create(model=qwen_server.model, messages=question,
                                           max_tokens=8, temperature=0)
    with_tools = client.chat.completions.create(model=qwen_server.model, messages=question,
                                                tools=TOOLS, max_tokens=8, temperature=0)
    with_history = client.chat.completions.create(model=qwen_server.model, messages=history,
                                                  tools=TOOLS, max_tokens=8, temperature=0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    expected = qwen_server.tokenizer.apply_chat_template(
        [history[0], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}, *history[2:]],
        tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"city": "Paris"' in expected and "18 C, sunny" in expected
    assert with_history.usage.prompt_tokens == len(qwen_server.tokenizer.encode(
        expected, add_special_tokens=False))
    assert with_history.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("tool_choice,parallel", [
    ("required", False), ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, None)])
def test_a_forced_tool_choice_makes_the_model_call(qwen_server, tool_choice, parallel):
    """The grammar holds the output to calls whose arguments follow the
    function's parameter schema; speculation (n-gram) runs alongside.
    ``required`` allows several calls (this model then calls until
    ``max_tokens``); with ``parallel_tool_calls: false``, exactly one."""
    import jsonschema

    tools = TOOLS + [{"type": "function", "function": {
        "name": "get_time", "description": "Local time in a time zone",
        "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "maxLength": 40},
            "format": {"enum": ["12h", "24h"]}}, "required": ["zone", "format"],
            "additionalProperties": False}}}]
    r = _client(qwen_server).chat.completions.create(
        model=qwen_server.model, tools=tools, tool_choice=tool_choice, max_tokens=60,
        temperature=0, messages=[{"role": "user", "content": "Hello! How are you today?"}],
        **({} if parallel is None else {"parallel_tool_calls": parallel}))
    choice = r.choices[0]
    assert choice.message.tool_calls, choice
    if parallel is False or isinstance(tool_choice, dict):
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert not choice.message.content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert r.usage.model_extra["structured_output"]["forced_tokens"] > 0


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
])
def test_tool_requests_the_server_cannot_honour_are_a_400(qwen_server, fields, param):
    body = {"model": qwen_server.model, "max_tokens": 4, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Hi"}], **fields}
    r = httpx.post(qwen_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert param in str(r.json()["error"]["param"])


def test_tools_for_a_model_without_tool_calling_are_a_400(live_server):
    body = {"model": live_server.model, "max_tokens": 4, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# ---- tagged output to tool_calls, through the official client ------------------------


class _ScriptedScheduler:
    """Answers every request with ``OUTPUT`` in small text events."""

    stopping = False
    on_finish = None

    def __init__(self, chunk: int = 5):
        self.chunk = chunk

    def submit(self, request):
        from mlx_lm_server.serving.request import RequestHandle

        handle = RequestHandle(request, asyncio.get_running_loop())
        for i in range(0, len(OUTPUT), self.chunk):
            handle.events.put_nowait(TextEvent(OUTPUT[i:i + self.chunk]))
        handle.events.put_nowait(DoneEvent("stop", len(request.prompt_tokens), 40))
        return handle

    def cancel(self, handle):
        pass


@pytest.fixture(scope="module")
def scripted_client(qwen05_path, qwen_tokenizer):
    from fastapi.testclient import TestClient

    from mlx_lm_server.config import ServerConfig
    from mlx_lm_server.http.routes import create_app
    from mlx_lm_server.http.service import Service

    service = Service(ServerConfig(model=str(qwen05_path)), qwen_tokenizer, _ScriptedScheduler(),
                      max_context=32768)
    with TestClient(create_app(service)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http), \
            service.config.model_id


def test_tool_calls_come_back_whole(scripted_client):
    client, model = scripted_client
    r = client.chat.completions.create(model=model, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Rome and Oslo?"}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n\n"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})]


def test_tool_calls_come_back_streamed(scripted_client):
    client, model = scripted_client
    stream = client.chat.completions.create(model=model, tools=TOOLS, stream=True, messages=[
        {"role": "user", "content": "Weather in Rome and Oslo?"}])
    content, calls, reasons = [], {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(content) == "Let me check.\n\n"
    assert calls == {0: ("get_weather", {"city": "Rome"}), 1: ("get_weather", {"city": "Oslo"})}
    assert reasons[-1] == "tool_calls"


def test_without_tools_the_same_text_is_content(scripted_client):
    client, model = scripted_client
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content == OUTPUT and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


# ---- custom (freeform) tools on the chat route ------------------------------------

PATCH_TOOL = {"type": "custom", "custom": {
    "name": "apply_patch", "description": "Apply a patch to the repository",
    "format": {"type": "grammar", "grammar": {"syntax": "lark",
                                              "definition": 'start: "*** Begin Patch" /.+/'}}}}


def test_a_custom_tools_call_comes_back_as_custom_whole_and_streamed(qwen_tokenizer):
    """A call naming a freeform tool is ``{"type": "custom", "custom": {"name",
    "input"}}`` with the text of its ``input``; function calls stay as they are."""
    from mlx_lm_server.http.openai_answer import ChatAnswer

    patch = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\nx"}}' \
            '\n</tool_call>'
    text = "Patching.\n" + patch + "\n" + CALL
    done = DoneEvent("stop", 5, 9)
    answer = ChatAnswer("m", False, _markers(qwen_tokenizer), custom=frozenset({"apply_patch"}))
    whole = answer.whole(text, [], done)["choices"][0]["message"]["tool_calls"]
    assert whole[0]["type"] == "custom" and "function" not in whole[0]
    assert whole[0]["custom"] == {"name": "apply_patch", "input": "*** Begin Patch\nx"}
    assert whole[0]["id"].startswith("call_")
    assert whole[1]["type"] == "function" and whole[1]["function"]["name"] == "get_weather"
    streamed = ChatAnswer("m", False, _markers(qwen_tokenizer),
                          custom=frozenset({"apply_patch"}))
    chunks = [c for i in range(0, len(text), 7)
              for c in streamed.text_chunks(TextEvent(text[i:i + 7]))]
    chunks += streamed.done_chunks(done)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c.get("type"), (c.get("custom") or c.get("function"))["name"]) for c in calls] == \
        [("custom", "apply_patch"), ("function", "get_weather")]
    assert calls[0]["custom"]["input"] == "*** Begin Patch\nx"


def test_the_model_calls_a_custom_tool_and_its_history_reaches_the_template(qwen_server):
    """``tool_choice`` naming a custom tool forces a call to it (the grammar
    of a function of one string); an earlier custom call and its output in the
    history reach the chat template as the function call the model saw."""
    body = {"model": qwen_server.model, "max_tokens": 60, "temperature": 0,
            "tools": TOOLS + [PATCH_TOOL],
            "tool_choice": {"type": "custom", "custom": {"name": "apply_patch"}},
            "messages": [{"role": "user", "content": "Apply the patch 'x = 1'."}]}
    r = httpx.post(qwen_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and len(calls) == 1, choice
    assert calls[0]["type"] == "custom" and calls[0]["custom"]["name"] == "apply_patch"
    assert calls[0]["custom"]["input"] == "x = 1"  # the input's text, not JSON arguments

    history = [
        {"role": "user", "content": "Rename foo to bar in main.py."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_7", "type": "custom",
            "custom": {"name": "apply_patch", "input": "*** Begin Patch\n-foo\n+bar"}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "Done: 1 file changed"}]
    r = httpx.post(qwen_server.url + "/v1/chat/completions", timeout=120, json={
        "model": qwen_server.model, "max_tokens": 4, "temperature": 0,
        "tools": [PATCH_TOOL], "messages": history})
    assert r.status_code == 200, r.text
    seen = [{"type": "function", "function": {
        "name": "apply_patch", "description": PATCH_TOOL["custom"]["description"]
        + '\n\nIts input follows this lark grammar:\nstart: "*** Begin Patch" /.+/',
        "parameters": {"type": "object", "required": ["input"], "properties": {
            "input": {"type": "string", "description": "The tool's input, as text"}}}}}]
    expected = qwen_server.tokenizer.apply_chat_template(
        [history[0], {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_7", "type": "function", "function": {
                "name": "apply_patch", "arguments": {"input": "*** Begin Patch\n-foo\n+bar"}}}]},
         history[2]], tools=seen, tokenize=False, add_generation_prompt=True)
    assert "Begin Patch" in expected and "Done: 1 file changed" in expected
    assert r.json()["usage"]["prompt_tokens"] == len(qwen_server.tokenizer.encode(
        expected, add_special_tokens=False))
