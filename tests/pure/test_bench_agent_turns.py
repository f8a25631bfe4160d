"""``scripts/bench/bench_agent_turns.py`` without a model: a turn that does
not end in time is reported with what it streamed and the server's
``/health`` read while it was still open (a replay that only waited said
nothing of where a stalled turn stood), and ``--tools`` shortens the
captured request."""

import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import bench_agent_turns  # noqa: E402

HEALTH = {"status": "ok", "batch": {"waiting": 0, "prefilling": 0, "decoding": 1}}


def _endless_stream():
    """A message that starts and then streams one text delta every 50 ms,
    never ending (it gives up after 5 s, so that a replay without a deadline
    fails rather than hangs)."""
    start = {"type": "message_start", "message": {"content": []}}
    yield f"event: message_start\ndata: {json.dumps(start)}\n\n".encode()
    for _ in range(100):
        time.sleep(0.05)
        delta = {"type": "content_block_delta", "index": 0,
                 "delta": {"type": "text_delta", "text": "x"}}
        yield f"event: content_block_delta\ndata: {json.dumps(delta)}\n\n".encode()


def _server(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
        return httpx.Response(200, json=HEALTH)
    return httpx.Response(200, content=_endless_stream(),
                          headers={"content-type": "text/event-stream"})


def test_a_turn_past_its_time_is_reported_with_the_servers_health():
    body = bench_agent_turns.first_request("claude", "m", 32)
    with httpx.Client(transport=httpx.MockTransport(_server)) as client:
        start = time.perf_counter()
        result = bench_agent_turns.turn(client, "http://server", "claude", body, timeout=0.5)
    assert time.perf_counter() - start < 5
    assert result["stalled"] == HEALTH
    assert result["text"].startswith("x") and result["events"] >= 2
    assert "prompt" not in result  # no usage: the turn never ended


def test_tools_keeps_only_the_tools_named():
    full = bench_agent_turns.first_request("claude", "m", 32)
    short = bench_agent_turns.first_request("claude", "m", 16, tools=["Read", "Bash", "Edit"])
    assert len(full["tools"]) == 22
    assert short["tools"] == [t for t in full["tools"] if t["name"] in ("Bash", "Edit", "Read")]
    assert [t["name"] for t in short["tools"]] == ["Bash", "Edit", "Read"]
    assert short["max_tokens"] == 16 and short["stream"] and short["model"] == "m"
    assert short["messages"] == full["messages"] and short["system"] == full["system"]
