"""Schema-driven fuzzing of every route, from the app's own OpenAPI document.

Schemathesis generates requests that follow the schema and requests that
break it (wrong types, missing fields, out-of-range values), at least 35 per
route (``--run-slow``: 300), against a real server with n-gram speculation
on. Whatever comes in: never a 5xx, every 4xx an OpenAI error object (on the
Anthropic routes, Anthropic's), and the server still answers a normal
request afterwards.

Schemathesis never draws a lone UTF-16 surrogate (``"\\ud800"``: valid JSON,
as JavaScript strings can hold one, but no text a tokenizer takes), so a
drawn share of the bodies get one in a drawn string (every one must be a 400).
"""

import json
import sys

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

# Settings are fixed at import, before pytest's options are parsed.
EXAMPLES = 300 if "--run-slow" in sys.argv else 35


@pytest.fixture(scope="module")
def fuzzed_server(smollm2_path):
    from conftest import LiveServer

    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    server = LiveServer(smollm2_path, spec=SpecDecodeConfig(mode="ngram"), max_tokens=8)
    yield server
    server.close()


# Every route the app serves; a new route fails the test below until listed here.
ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
          ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
          ("POST", "/v1/responses"),
          ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("GET", "/health"),
          ("GET", "/metrics"),
          ("GET", "/v1/spec_decode/metrics")]

# Routes whose errors are in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json")


def test_every_route_is_fuzzed(api_schema):
    served = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert served == set(ROUTES)


def _num_strings(value) -> int:
    if isinstance(value, str):
        return 1
    if isinstance(value, dict):
        return sum(map(_num_strings, value.values()))
    if isinstance(value, list):
        return sum(map(_num_strings, value))
    return 0


def _spoilt(body, data):
    """``body``, or (drawn) ``body`` with a lone surrogate in the middle of one
    of its string values (depth first)."""
    n = _num_strings(body)
    if n == 0 or data.draw(st.integers(0, 3), label="spoil") != 0:
        return body
    target = data.draw(st.integers(0, n - 1), label="string")
    surrogate = data.draw(st.characters(categories=["Cs"]), label="surrogate")
    seen = iter(range(n))

    def walk(value):
        if isinstance(value, str):
            half = len(value) // 2
            return value[:half] + surrogate + value[half:] if next(seen) == target else value
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(body)


def _short(body, model):
    """Valid lengths stay, but at most 8 tokens, and the served model's name (any other
    is a 404 before the body is looked at): the fuzzing is about input, not generation."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = model
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) \
                    and body[key] > 8:
                body[key] = 8
    return body


@pytest.mark.parametrize("method,path", ROUTES)
def test_no_input_breaks_the_server(api_schema, fuzzed_server, method, path):
    model = fuzzed_server.model
    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.NEGATIVE))

    @given(cases, st.data())
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case, data):
        if case.method == "POST":
            case.body = _short(case.body, model)
        spoilt = _spoilt(case.body, data) if case.method == "POST" else case.body
        if spoilt is case.body:
            response = case.call(timeout=120)
        else:  # schemathesis checks what it sends, and its checker takes no surrogate
            case.body = spoilt
            response = httpx.post(fuzzed_server.url + path, content=json.dumps(spoilt),
                                  headers={"content-type": "application/json"}, timeout=120)
        assert response.status_code < 500, (case.method, case.path, json.dumps(case.body), response.text)
        if response.status_code >= 400:
            body = response.json()
            shape = {"type", "error"} if path in ANTHROPIC_ROUTES else {"error"}
            assert set(body) == shape, body
            assert isinstance(body["error"]["message"], str) and body["error"]["message"]
            assert isinstance(body["error"]["type"], str)

    check()


def test_the_server_still_serves_after_fuzzing(fuzzed_server):
    r = httpx.post(fuzzed_server.url + "/v1/chat/completions", timeout=60, json={
        "model": fuzzed_server.model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    assert fuzzed_server.wait_idle()["sequences"] == 0
