"""The Anthropic Messages API and the OpenAI Responses API, through the
official clients, against one real server (Qwen2.5-Coder-0.5B: its template
has tool calling) with n-gram speculation on and an API key (the Anthropic
client sends it as ``x-api-key``, the OpenAI client as a bearer token).

Both routes run the chat pipeline: the same greedy text and token counts as
the equivalent chat completion, tool calls forced by the same grammar."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

KEY = "sk-agent-test"
GREEDY = {"temperature": 0}  # this anthropic client sends sampling fields only as extra_body
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"], "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": SCHEMA}
QUESTION = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def server(qwen05_path):
    from conftest import LiveServer

    from mlx_lm_server.config import SamplingDefaults
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    # --top-p 0.95: a Responses body that leaves it out must echo it.
    server = LiveServer(qwen05_path, api_key=KEY,
                        spec=SpecDecodeConfig(mode="ngram", calibration_seconds=0),
                        sampling_defaults=SamplingDefaults(top_p=0.95))
    yield server
    server.close()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _chat(oai, server, messages, **fields):
    r = oai.chat.completions.create(model=server.model, messages=messages, temperature=0,
                                    **fields)
    return r.choices[0], r.usage


def _draft_tokens(server) -> int:
    r = httpx.get(server.url + "/v1/spec_decode/metrics", headers={"x-api-key": KEY}, timeout=10)
    return r.json()["totals"]["draft_tokens"]


def _events(server, path, body, headers):
    """(event name, data) of a streamed request, read raw."""
    r = httpx.post(server.url + path, json={**body, "stream": True}, headers=headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    out = []
    for block in blocks:
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ---- Anthropic Messages -----------------------------------------------------------------


def test_a_message_is_the_chat_answer(server, claude, oai):
    """System blocks and a text turn; greedy, the same text and counts as chat."""
    choice, usage = _chat(oai, server, [{"role": "system", "content": "Be brief.\nAnswer in English."},
                                        *QUESTION], max_tokens=8)
    m = claude.messages.create(model=server.model, max_tokens=8, extra_body=GREEDY,
                               system=[{"type": "text", "text": "Be brief."},
                                       {"type": "text", "text": "Answer in English."}],
                               messages=QUESTION, metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.model == server.model
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == choice.message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert m.usage.output_tokens == usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    count = claude.messages.count_tokens(model=server.model, messages=QUESTION, system=[
        {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English."}])
    assert count.input_tokens == usage.prompt_tokens


def test_a_stop_sequence_is_named(server, claude, oai):
    choice, _ = _chat(oai, server, QUESTION, max_tokens=10)
    words = choice.message.content.split()
    assert len(words) >= 4, choice.message.content
    stop = " " + words[2]
    m = claude.messages.create(model=server.model, max_tokens=10, extra_body=GREEDY,
                               messages=QUESTION, stop_sequences=["\u00a7\u00a7", stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == choice.message.content[:choice.message.content.index(stop)]
    m = claude.messages.create(model=server.model, max_tokens=3, extra_body=GREEDY,
                               messages=QUESTION, stop_sequences=["\u00a7\u00a7"])
    assert (m.stop_reason, m.stop_sequence, m.usage.output_tokens) == ("max_tokens", None, 3)


def test_a_message_streams_in_the_documented_events(server, claude):
    whole = claude.messages.create(model=server.model, max_tokens=8, extra_body=GREEDY,
                                   messages=QUESTION)
    with claude.messages.stream(model=server.model, max_tokens=8, extra_body=GREEDY,
                                messages=QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason,
                                                              whole.usage.output_tokens)
    body = {"model": server.model, "max_tokens": 8, "messages": QUESTION, **GREEDY}
    names = [name for name, _ in _events(server, "/v1/messages", body, {"x-api-key": KEY})]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_tool_use_round_trip(server, claude):
    """A forced tool call comes back as a tool_use block (whole and streamed);
    its result, sent back, reaches the prompt."""
    forced = {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}}
    drafted = _draft_tokens(server)
    m = claude.messages.create(model=server.model, max_tokens=40, extra_body=GREEDY,
                               messages=QUESTION, **forced)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, SCHEMA)
    with claude.messages.stream(model=server.model, max_tokens=40, extra_body=GREEDY,
                                messages=QUESTION, **forced) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert (streamed.content[0].name, streamed.content[0].input) == (call.name, call.input)
    assert _draft_tokens(server) > drafted  # the calls were speculated (n-gram)

    turns = QUESTION + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                        {"role": "user", "content": [{"type": "tool_result",
                                                      "tool_use_id": call.id,
                                                      "content": "18 C and sunny"}]}]
    asked = claude.messages.count_tokens(model=server.model, messages=QUESTION, tools=[TOOL])
    answered = claude.messages.count_tokens(model=server.model, messages=turns, tools=[TOOL])
    assert answered.input_tokens > asked.input_tokens + 10
    reply = claude.messages.create(model=server.model, max_tokens=8, extra_body=GREEDY,
                                   messages=turns, tools=[TOOL])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == answered.input_tokens
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body,status", [
    ({"messages": QUESTION}, 400),  # no max_tokens
    ({"max_tokens": 0, "messages": QUESTION}, 400),
    ({"max_tokens": 4, "messages": []}, 400),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": []}]}, 400),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, 400),
    ({"max_tokens": 4, "messages": QUESTION + [{"role": "assistant", "content": "The"}]}, 400),
    ({"max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "any"}}, 400),
    ({"max_tokens": 4, "messages": QUESTION, "temperature": 1.5}, 400),
    ({"max_tokens": 4, "messages": QUESTION, "model": "claude-sonnet-4-5"}, 404),
], ids=["no max_tokens", "max_tokens 0", "no messages", "empty content", "image", "prefill", "any without tools",
        "temperature", "unknown model"])
def test_malformed_messages_are_anthropic_errors(server, body, status):
    r = httpx.post(server.url + "/v1/messages", json={"model": server.model, **body},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == status, r.text
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert r.json() == {"type": "error", "error": {"type": kind,
                                                   "message": r.json()["error"]["message"]}}
    assert r.json()["error"]["message"]


def test_anthropic_errors_reach_the_client(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=server.model, max_tokens=4, messages=QUESTION)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", content=b"{not json",
                   headers={"x-api-key": KEY, "content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"


# ---- OpenAI Responses -------------------------------------------------------------------


def test_a_response_is_the_chat_answer(server, oai):
    choice, usage = _chat(oai, server, [{"role": "system", "content": "Be brief."}, *QUESTION],
                          max_tokens=8)
    r = oai.responses.create(model=server.model, instructions="Be brief.",
                             input=QUESTION[0]["content"], max_output_tokens=8, temperature=0,
                             store=False)
    assert r.object == "response" and r.model == server.model
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == choice.message.content
    assert r.status == {"length": "incomplete", "stop": "completed"}[choice.finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens,
                                                             usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert oai.models.retrieve(server.model).id == server.model


def test_a_response_echoes_the_sampling_applied(server, oai):
    """A field the body left out took the server's default (--top-p), and
    that is what the response says, not the API's own default."""
    r = oai.responses.create(model=server.model, input="Hi", max_output_tokens=1,
                             temperature=0)
    assert (r.temperature, r.top_p) == (0.0, 0.95)
    r = oai.responses.create(model=server.model, input="Hi", max_output_tokens=1,
                             temperature=0, top_p=0.5)
    assert r.top_p == 0.5


def test_a_response_streams_in_the_documented_events(server, oai):
    whole = oai.responses.create(model=server.model, input=QUESTION, max_output_tokens=8,
                                 temperature=0)
    done = "response.completed" if whole.status == "completed" else "response.incomplete"
    with oai.responses.stream(model=server.model, input=QUESTION, max_output_tokens=8,
                              temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", done]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output[0].content[0].text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_function_calling_round_trip(server, oai):
    """A forced call comes back as a function_call item (whole and streamed);
    the call and its output, sent back as items, reach the prompt."""
    forced = {"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "get_weather"}}
    r = oai.responses.create(model=server.model, input=QUESTION, max_output_tokens=40,
                             temperature=0, **forced)
    assert [item.type for item in r.output] == ["function_call"] and r.status == "completed"
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    with oai.responses.stream(model=server.model, input=QUESTION, max_output_tokens=40,
                              temperature=0, **forced) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert (final.output[0].name, final.output[0].arguments) == (call.name, call.arguments)

    turns = QUESTION + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                         "arguments": call.arguments},
                        {"type": "function_call_output", "call_id": call.call_id,
                         "output": "18 C and sunny"}]
    reply = oai.responses.create(model=server.model, input=turns, tools=[FUNCTION],
                                 max_output_tokens=6, temperature=0)
    assert reply.usage.input_tokens > r.usage.input_tokens + 10
    assert reply.status in ("completed", "incomplete")


def test_an_agent_loop_of_two_tool_round_trips(server, oai):
    """As the Agents SDK runs a loop with ``store: false``: every turn sends
    the whole item list back (the user's message, each function_call and its
    function_call_output). Two forced calls, then an answer: each request is
    answered, each call's arguments fit the schema, and each turn after the
    first reads the earlier turns from the prompt cache."""
    items = list(QUESTION)
    usages = []
    for city_turn in range(2):
        r = oai.responses.create(model=server.model, input=items, tools=[FUNCTION],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40, temperature=0, store=False)
        call = r.output[0]
        assert call.type == "function_call" and r.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
        usages.append(r.usage)
        items += [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                   "arguments": call.arguments},
                  {"type": "function_call_output", "call_id": call.call_id,
                   "output": f"{18 + city_turn} C and sunny"}]
    reply = oai.responses.create(model=server.model, input=items, tools=[FUNCTION],
                                 max_output_tokens=8, temperature=0, store=False)
    usages.append(reply.usage)
    assert reply.status in ("completed", "incomplete")
    assert [o.type for o in reply.output][:1] in (["message"], ["function_call"])
    for before, after in zip(usages, usages[1:]):
        assert after.input_tokens > before.input_tokens
        assert after.input_tokens_details.cached_tokens >= before.input_tokens - 8, (before, after)


def test_text_format_follows_the_schema(server, oai):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = oai.responses.create(model=server.model, input=QUESTION, max_output_tokens=40,
                             temperature=0, text={"format": {
                                 "type": "json_schema", "name": "weather", "schema": schema}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("body,param", [
    ({"input": "Hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": "Hi", "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": "web_search"}]}]}, "tools"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({}, "input"),
], ids=["previous_response_id", "background", "image", "hosted tool in a namespace",
        "max_output_tokens",
        "schema missing", "no input"])
def test_malformed_responses_are_openai_errors(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": server.model, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and error["type"] == "invalid_request_error"
    assert error["message"] and param in (error["param"] or "")


def _codex_request(server, **fields) -> dict:
    """Codex CLI 0.169.0's first request (``codex exec``, a custom provider with
    ``wire_api = "responses"``), captured from the client: a long developer
    prompt, function tools, a ``namespace`` tool, a hosted ``web_search``,
    ``include``, ``reasoning.summary``, ``prompt_cache_key``, ``client_metadata``."""
    from pathlib import Path

    body = json.loads((Path(__file__).parents[1] / "fixtures" /
                       "codex_0.169.0_first_request.json").read_text())
    return {**body, "model": server.model, **fields}


@pytest.mark.slow  # Codex's whole first request through SmolLM2: minutes on 2 cores
def test_codex_first_request_is_answered(server):
    """Whole and streamed, with speculation on; the streamed one (the same
    prompt again) comes from the prompt cache; web_search is left out and
    named; the stream ends in response.completed with the usage Codex reads."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = _codex_request(server, max_output_tokens=6, temperature=0, stream=False)
    r = httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=600)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["status"] in ("completed", "incomplete") and whole["output"]
    assert whole["metadata"] == {"ignored_tools": "web_search"}
    assert [t["type"] for t in whole["tools"]] == [t["type"] for t in body["tools"]]
    events = _events(server, "/v1/responses", {**body, "stream": True}, headers)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    usage = events[-1][1]["response"]["usage"]
    assert usage["input_tokens"] == whole["usage"]["input_tokens"] > 3000
    assert usage["input_tokens_details"]["cached_tokens"] > 3000
    added = [data["item"]["id"] for kind, data in events if kind == "response.output_item.added"]
    deltas = [data["item_id"] for kind, data in events if kind.endswith(".delta")]
    assert deltas and set(deltas) <= set(added)  # every delta belongs to an item added before


def test_claude_code_first_request_is_understood(server):
    """Claude Code 2.1.328's first request (captured from the client; its
    default configuration): system blocks with ``cache_control``, a system
    message mid-conversation, 22 tools, adaptive ``thinking``,
    ``context_management``, ``output_config``. Counted here without
    generating (a 21k-token prefill); generated in the slow client test."""
    from pathlib import Path

    body = json.loads((Path(__file__).parents[1] / "fixtures" /
                       "claude_code_2.1.328_first_request.json").read_text())
    body.pop("max_tokens")
    r = httpx.post(server.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                   json={**body, "model": server.model}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] > 15000


NAMESPACED = {"type": "namespace", "name": "mcp__weather__", "description": "Weather tools",
              "tools": [{**FUNCTION, "strict": False}]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}


def test_a_namespaced_function_is_called_by_its_own_name(server, oai):
    """The model sees mcp__weather__get_weather; the call comes back as
    get_weather in namespace mcp__weather__, and goes back in as such."""
    forced = {"tools": [NAMESPACED, {"type": "web_search"}],
              "tool_choice": {"type": "function", "name": "mcp__weather__get_weather"}}
    r = oai.responses.create(model=server.model, input=QUESTION, max_output_tokens=40,
                             temperature=0, **forced)
    call = r.output[0].model_dump()
    assert (call["type"], call["name"], call["namespace"]) == (
        "function_call", "get_weather", "mcp__weather__")
    jsonschema.validate(json.loads(call["arguments"]), SCHEMA)
    turns = QUESTION + [{k: call[k] for k in ("type", "call_id", "name", "namespace",
                                              "arguments")},
                        {"type": "function_call_output", "call_id": call["call_id"],
                         "output": [{"type": "input_text", "text": "18 C"}]}]
    reply = oai.responses.create(model=server.model, input=turns, tools=[NAMESPACED],
                                 max_output_tokens=4, temperature=0)
    assert reply.usage.input_tokens > r.usage.input_tokens + 10


def test_a_custom_tool_call_is_its_text(server):
    """A freeform tool is called with text (custom_tool_call, input), whole
    and streamed with custom_tool_call_input events, and its call and output
    go back in as items."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": server.model, "input": "Add a line 'x = 1' to a.py", "tools": [PATCH],
            "tool_choice": {"type": "custom", "name": "apply_patch"},
            "max_output_tokens": 60, "temperature": 0}
    r = httpx.post(server.url + "/v1/responses", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    call = r.json()["output"][0]
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch", call
    assert call["input"] and not call["input"].lstrip().startswith("{")
    events = _events(server, "/v1/responses", body, headers)
    streamed = "".join(d["delta"] for k, d in events
                       if k == "response.custom_tool_call_input.delta")
    done = [d["item"] for k, d in events if k == "response.output_item.done"]
    assert streamed == call["input"] == done[0]["input"]
    turns = [{"role": "user", "content": body["input"]},
             {k: call[k] for k in ("type", "call_id", "name", "input")},
             {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done"}]
    r = httpx.post(server.url + "/v1/responses", headers=headers, timeout=120,
                   json={**body, "input": turns, "tool_choice": "auto", "max_output_tokens": 4})
    assert r.status_code == 200, r.text


# ---- one pipeline: a client that leaves cancels its request ----------------------------


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"max_tokens": 2000}), ("/v1/responses", {"max_output_tokens": 2000})])
def test_a_client_that_leaves_mid_stream_cancels(server, path, body):
    key = {"x-api-key": KEY}
    count = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]
    request = {"model": server.model, "stream": True, **body,
               **({"messages": count} if path == "/v1/messages" else {"input": count})}
    with httpx.stream("POST", server.url + path, json=request, headers=key, timeout=60) as r:
        for line in r.iter_lines():
            if "delta" in line:
                break
    assert server.wait_idle(timeout=20)["sequences"] == 0


# ---- reasoning: a chat answer's reasoning deltas become thinking blocks, reasoning items --


def _played(answer, events, done):
    """Every chunk of an answer fed ``events`` then ``done``."""
    chunks = answer.first_chunks()
    for event in events:
        chunks += answer.text_chunks(event)
    return chunks + answer.done_chunks(done)


REASONED = [("Let me", ""), (" think.", ""), (" Done.", "Hello"), ("", " there")]


def _reasoned_events():
    from mlx_lm_server.serving.request import TextEvent

    return [TextEvent(text, reasoning=reasoning) for reasoning, text in REASONED]


def test_reasoning_is_a_thinking_block():
    from mlx_lm_server.http.anthropic_answer import MessagesAnswer
    from mlx_lm_server.http.openai_answer import ChatAnswer
    from mlx_lm_server.serving.request import DoneEvent

    done = DoneEvent("stop", 5, 9, reasoning_tokens=6)
    chunks = _played(MessagesAnswer(ChatAnswer("m", False), "m", 5, [], None),
                     _reasoned_events(), done)
    names = [name for name, _ in chunks]
    assert names == ["message_start", "ping", "content_block_start"] + \
        ["content_block_delta"] * 3 + ["content_block_stop", "content_block_start"] + \
        ["content_block_delta"] * 2 + ["content_block_stop", "message_delta", "message_stop"]
    starts = [data["content_block"] for name, data in chunks if name == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""},
                      {"type": "text", "text": ""}]
    deltas = [(data["index"], data["delta"]) for name, data in chunks
              if name == "content_block_delta"]
    assert deltas[2:4] == [(0, {"type": "thinking_delta", "thinking": " Done."}),
                           (1, {"type": "text_delta", "text": "Hello"})]
    whole = MessagesAnswer(ChatAnswer("m", False), "m", 5, [], None).whole(
        "Hello there", [], done, reasoning="Let me think. Done.")
    assert whole["content"] == [{"type": "thinking", "thinking": "Let me think. Done.",
                                 "signature": ""}, {"type": "text", "text": "Hello there"}]
    plain = MessagesAnswer(ChatAnswer("m", False), "m", 5, [], None).whole(
        "Hello there", [], DoneEvent("stop", 5, 3))
    assert plain["content"] == [{"type": "text", "text": "Hello there"}]


def test_reasoning_is_a_reasoning_item():
    from mlx_lm_server.http.openai_answer import ChatAnswer
    from mlx_lm_server.http.responses_answer import ResponsesAnswer
    from mlx_lm_server.http.responses_schema import ResponsesRequest
    from mlx_lm_server.serving.request import DoneEvent

    body = ResponsesRequest(model="m", input="Hi")
    done = DoneEvent("stop", 5, 9, reasoning_tokens=6)
    chunks = _played(ResponsesAnswer(ChatAnswer("m", False), "m", body), _reasoned_events(), done)
    names = [name for name, _ in chunks]
    assert names[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert names.count("response.reasoning_text.delta") == 3
    assert names.count("response.output_text.delta") == 2
    final = chunks[-1][1]["response"]
    assert [(item["type"], item["content"][0]["text"]) for item in final["output"]] == [
        ("reasoning", "Let me think. Done."), ("message", "Hello there")]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 6}
    whole = ResponsesAnswer(ChatAnswer("m", False), "m", body).whole(
        "Hello there", [], done, reasoning="Let me think. Done.")
    without_ids = [[{k: v for k, v in item.items() if k != "id"} for item in r["output"]]
                   for r in (whole, final)]
    assert without_ids[0] == without_ids[1] and whole["status"] == "completed"


class _Pieces:
    """A tokenizer whose token i decodes to ``pieces[i]``."""

    def __init__(self, *pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("ids,expected", [
    ([0, 1, 2, 3], ("end_turn", None)),  # " END" earlier (in the reasoning, say), then EOS
    ([0, 2, 1], ("stop_sequence", " END")),
    ([0, 4, 5], ("stop_sequence", " END")),  # across the last two tokens
    ([0, 2, 6], ("stop_sequence", "!")),  # the first to end in the last token
], ids=["eos", "stop", "straddling", "first"])
def test_the_stop_sequence_is_the_one_ending_in_the_last_token(ids, expected):
    from mlx_lm_server.http.anthropic_answer import MessagesAnswer
    from mlx_lm_server.http.openai_answer import ChatAnswer
    from mlx_lm_server.serving.request import DoneEvent, TextEvent

    tokenizer = _Pieces("Think", " END", " more", "<eos>", " E", "ND", "! END")
    answer = MessagesAnswer(ChatAnswer("m", False), "m", 5, ["\u00a7", " END", "!"], tokenizer)
    answer.on_text(TextEvent("", token_ids=ids))
    body = answer.whole("", [], DoneEvent("stop", 5, len(ids)))
    assert (body["stop_reason"], body["stop_sequence"]) == expected


# ---- a failure mid-request, in each API's shape ------------------------------------------


class _FailingScheduler:
    """Answers every request with some text, then an error."""

    stopping = False

    def submit(self, request):
        import asyncio

        from mlx_lm_server.serving.request import ErrorEvent, RequestHandle, TextEvent

        handle = RequestHandle(request, asyncio.get_running_loop())
        handle.events.put_nowait(TextEvent("Hel", token_ids=[1]))
        handle.events.put_nowait(ErrorEvent("the step failed", code="step_failed"))
        return handle

    def cancel(self, handle):
        pass


@pytest.fixture(scope="module")
def failing_app(smollm2_path):
    from fastapi.testclient import TestClient
    from mlx_lm.utils import load_tokenizer

    from mlx_lm_server.config import ServerConfig
    from mlx_lm_server.http.routes import create_app
    from mlx_lm_server.http.service import Service

    service = Service(ServerConfig(model=str(smollm2_path)), load_tokenizer(smollm2_path),
                      _FailingScheduler(), max_context=2048)
    with TestClient(create_app(service)) as http:
        yield http, service.config.model_id


def test_a_failure_mid_request_is_an_error_in_each_api(failing_app):
    http, model = failing_app
    messages = {"model": model, "max_tokens": 8, "messages": QUESTION}
    r = http.post("/v1/messages", json=messages)
    assert r.status_code == 500 and r.json() == {"type": "error", "error": {
        "type": "api_error", "message": "the step failed"}}
    r = http.post("/v1/messages", json={**messages, "stream": True})
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    assert blocks[-1] == 'event: error\ndata: {"type": "error", "error": {"type": "api_error", ' \
        '"message": "the step failed"}}' and "[DONE]" not in r.text
    r = http.post("/v1/responses", json={"model": model, "input": "Hi"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "step_failed"
    r = http.post("/v1/responses", json={"model": model, "input": "Hi", "stream": True})
    events = [json.loads(b.split("data: ", 1)[1]) for b in r.text.split("\n\n") if b.strip()]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "step_failed" and events[-1]["response"]["status"] == "failed"
    assert "[DONE]" not in r.text


def test_sampling_fields_left_out_stay_left_out():
    """A field the client did not send takes the server's default (--temp...)."""
    from mlx_lm_server.http.anthropic_schema import MessagesRequest
    from mlx_lm_server.http.responses_schema import ResponsesRequest

    sampling = {"temperature", "top_p", "top_k"}
    plain = MessagesRequest(model="m", max_tokens=4, messages=QUESTION).to_chat()
    assert not plain.model_fields_set & sampling
    given = MessagesRequest(model="m", max_tokens=4, messages=QUESTION, temperature=0.5,
                            top_k=3).to_chat()
    assert given.model_fields_set & sampling == {"temperature", "top_k"}
    assert (given.temperature, given.top_k) == (0.5, 3)
    assert not ResponsesRequest(model="m", input="Hi").to_chat().model_fields_set & sampling
    given = ResponsesRequest(model="m", input="Hi", top_p=0.5).to_chat()
    assert given.model_fields_set & sampling == {"top_p"} and given.top_p == 0.5
