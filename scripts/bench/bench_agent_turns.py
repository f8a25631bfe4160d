"""An agent client's conversation replayed against a running server, turn
after turn: time to first token and the prompt tokens the prompt cache
served, per turn.

Turn 1 is the client's own first request, captured from it and kept in
``tests/fixtures/`` (Claude Code 2.1.328: a 5.5k-character system prompt, a
9k-character system message, 22 tools, ``cache_control`` blocks, adaptive
``thinking``; Codex 0.169.0: a 17.7k-character developer prompt, function,
namespace and hosted tools). Each later turn is the conversation so far,
the server's last answer as the assistant's turn, and a short user message,
as the client would send it: the system prompt and tools are the same bytes
every turn, so from turn 2 on the prompt cache should serve all but the new
messages.

    .venv/bin/mlx-lm-server --model models/qwen2.5-coder-0.5b-instruct --port 8090 &
    .venv/bin/python scripts/bench/bench_agent_turns.py http://127.0.0.1:8090 \\
        --client claude --turns 5 --max-tokens 32

``--chat`` sends each of Claude Code's turns through ``/v1/chat/completions``
instead, translated as this server translates a Messages request, so that
upstream ``mlx_lm.server`` (no Messages API) is timed on the same prompt
tokens (each turn prints the prompt tokens the server counted).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional

import httpx

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
REQUESTS = {"claude": ("claude_code_2.1.328_first_request.json", "/v1/messages"),
            "codex": ("codex_0.169.0_first_request.json", "/v1/responses"),
            "chat": (None, "/v1/chat/completions")}  # --chat: Claude's turns as chat
FOLLOW_UPS = ["Now list only the Python files.", "Which of them is the largest?",
              "Summarise what it does in one sentence.", "Thanks. Anything else to check?"]


def turn(client: httpx.Client, url: str, kind: str, body: dict,
         timeout: Optional[float] = None) -> dict:
    """One streamed turn: seconds to its first text, its text, its usage.
    One that has not ended within ``timeout`` seconds is ``stalled``, with
    the server's ``/health`` read while the request is still open."""
    start = time.perf_counter()
    first, text, usage, events = None, [], {}, 0
    stalled = None
    with client.stream("POST", url + REQUESTS[kind][1], json=body,
                       timeout=httpx.Timeout(3600, read=timeout)) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read()[:500]!r}")
        try:
            for line in r.iter_lines():
                if timeout is not None and time.perf_counter() - start > timeout:
                    raise httpx.ReadTimeout("the turn's time is up")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                event = json.loads(line[6:])
                delta = _text_delta(kind, event)
                if delta is not None:
                    first = first if first is not None else time.perf_counter() - start
                    text.append(delta)
                usage = _usage(kind, event) or usage
        except httpx.ReadTimeout:
            stalled = health(client, url)
    return {"ttft_s": first if first is not None else time.perf_counter() - start,
            "e2e_s": time.perf_counter() - start, "text": "".join(text), "events": events,
            **({"stalled": stalled} if stalled is not None else {}), **usage}


def health(client: httpx.Client, url: str):
    """The server's ``/health``: its batch, steps and memory (waiting requests)."""
    try:
        return client.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        return f"no answer ({type(e).__name__})"


def _text_delta(kind: str, event: dict):
    if kind == "chat":
        choices = event.get("choices") or [{}]
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning") or (
            "".join(c.get("function", {}).get("arguments") or "" for c in delta["tool_calls"])
            if delta.get("tool_calls") else None)
    if kind == "claude" and event.get("type") == "content_block_delta":
        d = event["delta"]
        return d.get("text", d.get("partial_json", d.get("thinking", "")))
    if kind == "codex" and event.get("type", "").endswith(".delta"):
        return event.get("delta", "")
    return None


def _usage(kind: str, event: dict) -> dict:
    if kind == "chat" and event.get("usage"):
        u = event["usage"]
        return {"prompt": u["prompt_tokens"], "output": u["completion_tokens"],
                "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}
    if kind == "claude" and event.get("type") == "message_delta":
        u = event["usage"]
        return {"prompt": u["input_tokens"] + u["cache_read_input_tokens"],
                "cached": u["cache_read_input_tokens"], "output": u["output_tokens"]}
    if kind == "codex" and event.get("type") in ("response.completed", "response.incomplete"):
        u = event["response"]["usage"]
        return {"prompt": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"],
                "output": u["output_tokens"]}
    return {}


def next_body(kind: str, body: dict, answer: str, follow_up: str) -> dict:
    if kind == "claude":
        messages = body["messages"] + [
            {"role": "assistant", "content": [{"type": "text", "text": answer or "OK."}]},
            {"role": "user", "content": [{"type": "text", "text": follow_up}]}]
    else:
        messages = body["input"] + [
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": answer or "OK."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": follow_up}]}]
    return {**body, ("messages" if kind == "claude" else "input"): messages}


def as_chat(body: dict) -> dict:
    """Claude's Messages request as a streamed chat completion, translated by
    this server's own rules (``http/anthropic_schema.py``): the same prompt
    for a server without the Messages API."""
    from mlx_lm_server.http.anthropic_schema import MessagesRequest

    chat = MessagesRequest.model_validate(body).to_chat().model_dump(mode="json",
                                                                     exclude_unset=True)
    return {**{k: v for k, v in chat.items() if v is not None}, "stream": True,
            "stream_options": {"include_usage": True}}


def first_request(kind: str, model: str, max_tokens: int,
                  tools: Optional[list[str]] = None) -> dict:
    """The client's captured first request, streamed, greedy, ``max_tokens``
    a turn, with only the ``tools`` named (None: all of them)."""
    body = json.loads((FIXTURES / REQUESTS[kind][0]).read_text())
    cap = "max_tokens" if kind == "claude" else "max_output_tokens"
    body = {**body, "model": model, "stream": True, cap: max_tokens, "temperature": 0}
    if tools is not None:
        body["tools"] = [t for t in body["tools"] if t.get("name") in tools]
    return body


def report_stall(n: int, result: dict, timeout: float) -> None:
    """What a stalled turn streamed, and where the server stood."""
    text = (f"{len(result['text'])} characters of text, the first after "
            f"{result['ttft_s']:.2f} s" if result["text"] else "no text")
    print(f"turn {n}: no end within {timeout:.0f} s: {result['events']} events, {text}; "
          f"the server: {json.dumps(result['stalled'])}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", help="the server, e.g. http://127.0.0.1:8090")
    ap.add_argument("--client", choices=["claude", "codex"], default="claude")
    ap.add_argument("--chat", action="store_true",
                    help="Claude's turns through /v1/chat/completions, translated as this "
                         "server translates them (for upstream mlx_lm.server)")
    ap.add_argument("--model", help="the served name (default: the server's /v1/models)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tools", type=lambda s: s.split(","), metavar="NAME,NAME",
                    help="keep only these tools of the request (default: all)")
    ap.add_argument("--turn-timeout", type=float,
                    help="seconds a turn may take; a turn past it is reported and ends the run")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--out", help="write the turns as JSON here")
    args = ap.parse_args()
    if args.chat and args.client != "claude":
        ap.error("--chat replays Claude Code's turns (--client claude)")
    headers = {"Authorization": f"Bearer {args.api_key}", "x-api-key": args.api_key}
    with httpx.Client(timeout=3600, headers=headers) as client:
        model = args.model or client.get(args.url + "/v1/models").json()["data"][0]["id"]
        body = first_request(args.client, model, args.max_tokens, args.tools)
        turns = []
        for n in range(args.turns):
            if args.chat:
                result = turn(client, args.url, "chat", as_chat(body), args.turn_timeout)
            else:
                result = turn(client, args.url, args.client, body, args.turn_timeout)
            turns.append(result)
            if "stalled" in result:
                report_stall(n + 1, result, args.turn_timeout)
                break
            ratio = result["ttft_s"] / turns[0]["ttft_s"]
            print(f"turn {n + 1}: prompt {result.get('prompt')} tokens, {result.get('cached')} "
                  f"from the cache; first token after {result['ttft_s']:.2f} s "
                  f"({ratio:.3f}x turn 1's), {result.get('output')} tokens in "
                  f"{result['e2e_s']:.2f} s", flush=True)
            body = next_body(args.client, body, result["text"], FOLLOW_UPS[n % len(FOLLOW_UPS)])
    if args.out:
        Path(args.out).write_text(json.dumps({"client": args.client, "model": model,
                                              "tools": len(body["tools"]), "turns": turns},
                                             indent=1))
    if turns and "stalled" in turns[-1]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
