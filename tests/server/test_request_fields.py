"""Request fields upstream mlx_lm.server's clients send: ``logit_bias``, the
penalties' context sizes and ``chat_template_kwargs``, with speculation on."""

from dataclasses import replace

import httpx
import numpy as np
import pytest
from test_spec_engine import SOURCE

from mlx_lm_server.spec_decode.config import SpecDecodeConfig


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
    ({"adapters": "adapters/other"}, "adapters"),  # served without: a request cannot choose
    ({"draft_model": "models/other"}, "draft_model"),
])
def test_bad_fields_are_a_400(live_server, fields, param):
    r = _complete(live_server, **fields)
    assert r.status_code == 400, r.text
    assert param in str(r.json()["error"]["param"])


def test_adapters_and_draft_model_naming_what_is_served_are_honoured(live_server,
                                                                   smollm2_path):
    """mlx_lm.server's per-request fields, naming what the model is served
    with (here: no adapters, so only the draft model can be named, as the
    served folder itself is no draft model): the request is answered."""
    from mlx_lm_server.http.openai_schema import CompletionRequest
    from mlx_lm_server.http.service import Service

    config = replace(live_server.config, spec=replace(
        live_server.config.spec, mode="draft", draft_model_path=str(smollm2_path)))
    service = Service(config, live_server.tokenizer, None, max_context=None)
    request, _ = service.prepare(CompletionRequest(
        model=live_server.model, prompt="hi", max_tokens=2,
        draft_model=str(smollm2_path) + "/"))
    assert request.prompt_tokens


def test_chat_template_kwargs_reach_the_template(live_server, smollm2_path):
    """A template that reads a variable renders differently with it (SmolLM2's
    own template reads none, so the real tokenizer gets one that does), and
    keys the server sets itself are a 400."""
    from mlx_lm.utils import load_tokenizer

    from mlx_lm_server.http.openai_schema import ChatCompletionRequest
    from mlx_lm_server.http.service import Service

    tokenizer = load_tokenizer(smollm2_path)
    tokenizer._tokenizer.chat_template = (
        "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}")
    service = Service(live_server.config, tokenizer, None, max_context=None)

    def prompt(kwargs):
        request, _ = service.prepare(ChatCompletionRequest(
            model=live_server.model, messages=[{"role": "user", "content": "Hi"}],
            chat_template_kwargs=kwargs))
        return tokenizer.decode(request.prompt_tokens)

    assert prompt({"enable_thinking": True}) == "<think>Hi"
    assert prompt({"enable_thinking": False}) == prompt(None) == "Hi"
    body = {"model": live_server.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    ok = httpx.post(live_server.url + "/v1/chat/completions", timeout=60,
                    json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text
    bad = httpx.post(live_server.url + "/v1/chat/completions", timeout=60,
                     json={**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


# ---- XTC: sampled exactly, never speculated ------------------------------------


def _xtc_exact(logprobs: np.ndarray, p: float, threshold: float, special=()) -> np.ndarray:
    """(1 - p) softmax(l) + p softmax(l without every choice above the
    threshold but the least likely one, specials kept)."""
    probs = np.exp(logprobs - logprobs.max())
    probs /= probs.sum()
    above = probs > threshold
    excluded = above & (probs > probs[above].min()) if above.any() else above
    excluded[list(special)] = False
    kept = np.where(excluded, 0.0, probs)
    return (1 - p) * probs + p * kept / kept.sum()


def test_the_xtc_sampler_draws_from_the_exact_distribution():
    """8,000 seeded draws against the exact mixture; TV below 0.02 (sampling
    error about 0.01; without the exclusion it would be 0.25)."""
    import mlx.core as mx

    from mlx_lm_server.decoding.sampling import SamplingParams, make_sampler

    logprobs = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    params = SamplingParams(temperature=1.0, seed=3, xtc_probability=0.6, xtc_threshold=0.12,
                            xtc_special_tokens=(1,))
    sampler = make_sampler(params)
    lp = mx.array(logprobs[None], dtype=mx.float32)
    n = 8000
    counts = np.bincount([sampler(lp).item() for _ in range(n)], minlength=6)
    exact = _xtc_exact(logprobs, 0.6, 0.12, special=(1,))
    tv = 0.5 * np.abs(counts / n - exact).sum()
    assert tv < 0.02, (tv, counts / n, exact)


@pytest.mark.slow  # long by nature (280 requests); scripts/mutants.py runs it
def test_an_xtc_request_is_sampled_with_xtc_inside_verification_steps(smollm2):
    """XTC rows never draft, but their tokens are drawn inside the verification
    steps their neighbours' drafts cause. With XTC always on (probability 1)
    the second token's distribution must exclude the top choices there too:
    240 seeded two-token requests among copying ones, TV below 0.12 against
    the exact distribution (top_k 2: 4 outcomes; sampling error about 0.045;
    measured 0.037, and 0.16 with the exclusion left out of verification)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from test_prompt_cache import _stop
    from test_spec_engine import _run

    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.serving.request import GenerationRequest
    from mlx_lm_server.spec_decode import make_engine

    model, tokenizer = smollm2
    s = make_scheduler(model, tokenizer, max_batch_size=32, max_queued_requests=1024,
                  engine=make_engine(model, SpecDecodeConfig(
                      mode="ngram", num_speculative_tokens=4, dynamic=False, adaptive_k=False),
                      tokenizer, "target"))
    s.start()
    prompt = tokenizer.encode("My favourite fruit is")
    copy = tokenizer.encode("Repeat this code exactly:\n" + SOURCE[:300] + "\n")
    xtc = dict(temperature=1.0, top_k=2, xtc_probability=1.0, xtc_threshold=0.1)

    def dist(tokens):
        logits = model(mx.array([tokens]), cache=make_prompt_cache(model))[0, -1]
        lp = np.asarray((logits - mx.logsumexp(logits)).astype(mx.float32))
        probs = _xtc_exact(lp, 1.0, 0.1)
        top = np.argsort(-np.where(probs > 0, lp, -np.inf))[:2]
        w = probs[top] / probs[top].sum()
        return dict(zip(top.tolist(), w.tolist()))

    exact = {(a, b): p * q for a, p in dist(prompt).items()
             for b, q in dist(prompt + [a]).items()}
    n = 240
    reqs = []
    for i in range(n):
        reqs.append(GenerationRequest(prompt, 2, SamplingParams(seed=i, **xtc)))
        if i % 6 == 0:
            reqs.append(GenerationRequest(copy, 32, SamplingParams(temperature=0)))
    try:
        out = _run(s, reqs)
    finally:
        _stop(s)
    counts = {}
    for (ids, _, done), req in zip(out, reqs):
        if req.max_tokens == 2:
            counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
            assert done.spec_decode["draft_tokens"] == 0
            assert done.spec_decode["disabled_by"] == "xtc_probability"
    assert s.spec_stats.tokens.num_drafts > 0  # the copying neighbours verified drafts
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    assert tv < 0.12, (tv, counts, exact)


def test_xtc_over_http_is_reproducible_and_checked(ngram_server, live_server):
    fields = dict(temperature=1.0, seed=5, xtc_probability=0.5, xtc_threshold=0.1, max_tokens=12)
    a, b = (_complete(ngram_server, **fields).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["spec_decode"]["disabled_by"] == "xtc_probability"
    r = _complete(live_server, xtc_threshold=0.6)
    assert r.status_code == 400 and r.json()["error"]["param"] == "xtc_threshold"


def test_values_float32_cannot_carry_are_taken_at_their_limit():
    """A top-p or temperature that rounds to 0 in float32, or a top-k past the
    vocabulary, once masked every token (NaN draws, a 500): each now means
    what its limit means."""
    import mlx.core as mx

    from mlx_lm_server.decoding.sampling import SamplingParams, make_sampler, sampling_logits

    x = mx.random.normal((1, 50), key=mx.random.key(3))
    logprobs = x - mx.logsumexp(x, -1, keepdims=True)
    top = mx.argmax(logprobs, -1).item()
    assert SamplingParams(temperature=1e-300).greedy
    only_top = sampling_logits(SamplingParams(temperature=2.0, top_p=1e-300), logprobs)
    assert mx.isfinite(only_top).sum().item() == 1 and mx.argmax(only_top, -1).item() == top
    whole = sampling_logits(SamplingParams(top_k=10**9), logprobs)
    assert mx.allclose(whole, logprobs).item()
    sampler = make_sampler(SamplingParams(temperature=2.0, top_p=1e-300, seed=0))
    assert [sampler(logprobs).item() for _ in range(5)] == [top] * 5
