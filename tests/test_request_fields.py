"""Request fields upstream mlx_lm.server's clients send: ``logit_bias``, the
penalties' context sizes and ``chat_template_kwargs``, with speculation on."""

import httpx
import pytest

from mlx_lm_server.spec_decode.config import SpecDecodeConfig

from test_spec_engine import SOURCE


def _complete(server, **fields):
    body = {"model": server.model, "prompt": "Repeat this code exactly:\n" + SOURCE[:300],
            "max_tokens": 12, "temperature": 0, **fields}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    return r


@pytest.fixture(scope="module")
def ngram_server(smollm2_path):
    from conftest import LiveServer

    server = LiveServer(smollm2_path, spec=SpecDecodeConfig(
        mode="ngram", num_speculative_tokens=4, dynamic=False, adaptive_k=False,
        calibration_seconds=0))
    yield server
    server.close()


def _first_text(server, **fields) -> str:
    """The first generated token's own text (``text`` may trim a leading space)."""
    r = _complete(server, max_tokens=1, logprobs=1, **fields)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"][0]


def test_logit_bias_moves_the_greedy_token_it_targets(ngram_server):
    tokenizer = ngram_server.tokenizer
    plain = _first_text(ngram_server)
    same = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) == plain]
    banned = _first_text(ngram_server, logit_bias={str(t): -100 for t in same})
    assert banned != plain
    assert _first_text(ngram_server, logit_bias={"1234": 100}) == tokenizer.decode([1234])


@pytest.mark.parametrize("fields", [
    {"logit_bias": {"30": 5.0, "31": -5.0}},
    {"repetition_penalty": 1.3, "repetition_context_size": 3},
    {"presence_penalty": 0.8, "presence_context_size": 64},
    {"frequency_penalty": 0.8, "frequency_context_size": 2},
])
def test_each_field_gives_the_same_text_with_speculation_on_and_off(ngram_server, fields):
    on = _complete(ngram_server, max_tokens=24, **fields).json()
    off = _complete(ngram_server, max_tokens=24, spec_decode=False, **fields).json()
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert on["usage"]["spec_decode"]["draft_tokens"] > 0


def test_context_sizes_change_what_the_penalty_sees(ngram_server):
    """A repetition penalty that looks at 1 token lets the copy go on; one that
    looks at 200 bends it away."""
    near = _complete(ngram_server, max_tokens=24, repetition_penalty=2.0,
                     repetition_context_size=1).json()["choices"][0]["text"]
    far = _complete(ngram_server, max_tokens=24, repetition_penalty=2.0,
                    repetition_context_size=200).json()["choices"][0]["text"]
    assert near != far


def test_seeded_sampling_with_the_fields_is_reproducible(ngram_server):
    fields = dict(temperature=0.9, seed=11, logit_bias={"30": 3.0}, presence_penalty=0.5,
                  presence_context_size=8, max_tokens=16)
    a, b = (_complete(ngram_server, **fields).json()["choices"][0]["text"] for _ in range(2))
    assert a == b


@pytest.mark.parametrize("fields,param", [
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias"),
    ({"repetition_context_size": 0}, "repetition_context_size"),
])
def test_bad_fields_are_a_400(live_server, fields, param):
    r = _complete(live_server, **fields)
    assert r.status_code == 400, r.text
    assert param in str(r.json()["error"]["param"])


def test_chat_template_kwargs_reach_the_template(live_server):
    body = {"model": live_server.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    ok = httpx.post(live_server.url + "/v1/chat/completions", timeout=60,
                    json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text
    bad = httpx.post(live_server.url + "/v1/chat/completions", timeout=60,
                     json={**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
