"""``scripts/bench/bench_agent_turns.py --chat`` without a model: Claude
Code's turns sent as chat completions, so that upstream ``mlx_lm.server``
(which has no Messages API) is timed on the prompt this server makes of
them."""

import json
import sys
from pathlib import Path

import httpx

from mlx_lm_server.http.anthropic_schema import MessagesRequest
from mlx_lm_server.http.openai_schema import ChatCompletionRequest
from mlx_lm_server.text.tool_calls import template_messages

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import bench_agent_turns  # noqa: E402


def test_chat_carries_what_the_messages_request_puts_in_the_prompt():
    body = bench_agent_turns.next_body(
        "claude", bench_agent_turns.first_request("claude", "m", 32), "an answer", "go on")
    chat = bench_agent_turns.as_chat(body)
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    sent = ChatCompletionRequest.model_validate(chat)
    made = MessagesRequest.model_validate(body).to_chat()
    # The chat template's inputs: the messages, the tools and the template's arguments.
    assert template_messages(sent.messages) == template_messages(made.messages)
    assert len(sent.messages) == 5 and sent.messages[3].text() == "an answer"
    assert sent.template_tools() == made.template_tools() and len(sent.template_tools()) == 22
    assert sent.chat_template_kwargs == made.chat_template_kwargs == {"enable_thinking": True}
    assert (sent.max_tokens, sent.temperature) == (32, 0)


def _chat_stream(request: httpx.Request) -> httpx.Response:
    assert request.url.path == "/v1/chat/completions"
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"delta": {"content": "Hel"}}]},
              {"choices": [{"delta": {"content": "lo"}}]},
              {"choices": [{"delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 21538, "completion_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": 512}}}]
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_a_chat_turn_reads_its_text_and_usage():
    with httpx.Client(transport=httpx.MockTransport(_chat_stream)) as client:
        result = bench_agent_turns.turn(client, "http://server", "chat", {"messages": []})
    assert result["text"] == "Hello"  # the role chunk's empty content is no text
    assert (result["prompt"], result["cached"], result["output"]) == (21538, 512, 2)
