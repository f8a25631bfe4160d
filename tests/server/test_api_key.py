"""``--api-key``: every route but ``/health`` answers only a client that sends
the key (``Authorization: Bearer KEY`` or ``x-api-key: KEY``); any other
gets a 401 error object, a streaming request before its stream starts."""

import json

import httpx
import openai
import pytest

KEY = "sk-local-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_server(smollm2_path):
    from conftest import LiveServer

    server = LiveServer(smollm2_path, api_key=KEY, max_tokens=2)
    yield server
    server.close()


def _requests(model) -> list[tuple[str, str, dict]]:
    """Every route the app serves but /health, streamed and not."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    comp = {"model": model, "prompt": "Hi", "max_tokens": 2}
    return [("GET", "/v1/models", None), ("GET", "/metrics", None),
            ("GET", "/v1/spec_decode/metrics", None)] + [
        ("POST", path, {**body, "stream": stream})
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp))
        for stream in (False, True)]


def _send(server, method, path, body, headers):
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong-key"}, {"x-api-key": "wrong-key"},
    {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}, {"Authorization": "Bearer"},
    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
    {"api-key": KEY}, {"Authorization": "Bearer wrong-key", "x-api-key": "wrong-key"},
], ids=["none", "wrong bearer", "wrong x-api-key", "basic", "no scheme", "empty bearer",
        "longer", "shorter", "other header", "both wrong"])
def test_without_the_key_every_route_is_a_401(keyed_server, headers):
    for method, path, body in _requests(keyed_server.model):
        r = _send(keyed_server, method, path, body, headers)
        assert r.status_code == 401, (path, body, r.text)
        assert not r.headers["content-type"].startswith("text/event-stream"), path
        assert r.json() == {"error": {
            "message": r.json()["error"]["message"], "type": "authentication_error",
            "param": None, "code": "invalid_api_key"}}
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(keyed_server.url + "/v1/nothing", headers=headers, timeout=10)
    assert r.status_code == 401  # an unknown route says nothing before the key


@pytest.mark.parametrize("headers", [
    {"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"x-api-key": KEY},
    {"Authorization": "Bearer wrong-key", "x-api-key": KEY},
], ids=["bearer", "lower case", "x-api-key", "either"])
def test_with_the_key_every_route_answers(keyed_server, headers):
    for method, path, body in _requests(keyed_server.model):
        r = _send(keyed_server, method, path, body, headers)
        assert r.status_code == 200, (path, body, r.text)
        if body and body["stream"]:
            lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and "error" not in json.loads(lines[-2][6:])
        elif body:
            assert r.json()["usage"]["completion_tokens"] > 0


def test_health_is_open(keyed_server):
    r = httpx.get(keyed_server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_the_openai_client_sends_its_api_key(keyed_server):
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(
        model=keyed_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.usage.completion_tokens > 0
    stream = client.completions.create(model=keyed_server.model, prompt="Hi", max_tokens=2,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)
    wrong = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.code == "invalid_api_key"


def test_without_api_key_no_key_is_asked_for(live_server):
    r = httpx.get(live_server.url + "/v1/models", timeout=10)
    assert r.status_code == 200
