"""The server through real HTTP on loopback, with the real SmolLM2 model."""

import asyncio
import json
import random

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash table is in two sentences.",
    "Translate 'good morning' to Spanish.",
    "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n",
    "Tell me a short story about a robot who learns to paint. " * 3,
    "Why is the sky blue?",
    "Name a colour.",
    "Summarise: The mitochondria is the powerhouse of the cell. It produces ATP.",
    "Count from one to ten in words.",
    "What is 12 times 12?",
    "Give me a word that rhymes with cat.",
    "Describe the water cycle. " * 5,
    "Say hello in French.",
]


def _client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _chat(server, prompt, max_tokens, **kw):
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **kw,
    }


async def _stream(client: httpx.AsyncClient, url: str, body: dict, stop_after=None):
    """POST a streaming request; returns (chunks, raw data lines)."""
    chunks, lines = [], []
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if line[6:] != "[DONE]":
                chunks.append(json.loads(line[6:]))
            if stop_after is not None and len(chunks) >= stop_after:
                return chunks, lines
    return chunks, lines


def _content(chunks) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )


def test_models_and_health(live_server):
    import openai

    client = _client(live_server)
    assert [m.id for m in client.models.list().data] == [live_server.model]
    assert client.models.retrieve(live_server.model).id == live_server.model
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such/model")
    assert e.value.body["code"] == "model_not_found"
    assert live_server.health()["status"] == "ok"


def test_openai_client_sync(live_server):
    client = _client(live_server)
    chat = client.chat.completions.create(
        model=live_server.model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    comp = client.completions.create(
        model=live_server.model, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert "Paris" in comp.choices[0].text
    assert comp.choices[0].finish_reason == "length"
    assert comp.usage.completion_tokens == 5
    assert comp.usage.prompt_tokens == len(live_server.tokenizer.encode("The capital of France is"))

    stream = client.chat.completions.create(
        model=live_server.model, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def test_openai_client_async(live_server):
    async def run():
        client = AsyncOpenAI(base_url=live_server.url + "/v1", api_key="none", max_retries=0)
        chat = await client.chat.completions.create(
            model=live_server.model, messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=10, temperature=0,
        )
        stream = await client.completions.create(
            model=live_server.model, prompt="One, two, three,", max_tokens=6, temperature=0,
            stream=True,
        )
        pieces = [c.choices[0].text async for c in stream if c.choices]
        plain = await client.completions.create(
            model=live_server.model, prompt="One, two, three,", max_tokens=6, temperature=0,
        )
        return chat, "".join(pieces), plain

    chat, streamed, plain = asyncio.run(run())
    assert chat.choices[0].message.content
    assert streamed == plain.choices[0].text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_text_equals_non_streamed(live_server, endpoint):
    if endpoint == "chat":
        url, body = "/v1/chat/completions", _chat(live_server, "Describe a cat in one sentence.", 40)
    else:
        url = "/v1/completions"
        body = {"model": live_server.model, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    plain = httpx.post(live_server.url + url, json=body, timeout=120).json()

    async def run():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=120) as c:
            return await _stream(c, url, {**body, "stream_options": {"include_usage": True}})

    chunks, lines = asyncio.run(run())
    assert lines[-1] == "[DONE]"
    if endpoint == "chat":
        streamed = _content(chunks)
        assert streamed == plain["choices"][0]["message"]["content"]
    else:
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert streamed == plain["choices"][0]["text"]
    assert _tokens(chunks[-1]["usage"]) == _tokens(plain["usage"])


def _tokens(usage: dict) -> dict:
    """Usage without the prompt-cache hits, which depend on what ran before
    (a resent prompt finds more of itself cached); those are checked to be
    fewer than the prompt's tokens."""
    usage = dict(usage)
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < usage["prompt_tokens"]
    return usage


def test_concurrent_greedy_equals_alone(live_server):
    """16 mixed requests at once each give exactly what they give alone."""
    rng = random.Random(0)
    bodies = [_chat(live_server, p, rng.randint(4, 24)) for p in PROMPTS]
    alone = [
        httpx.post(live_server.url + "/v1/chat/completions", json=b, timeout=120).json()
        for b in bodies
    ]

    async def run():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=300) as c:
            return await asyncio.gather(
                *[_stream(c, "/v1/chat/completions", {**b, "stream_options": {"include_usage": True}})
                  for b in bodies]
            )

    results = asyncio.run(run())
    for body, single, (chunks, lines) in zip(bodies, alone, results):
        assert lines[-1] == "[DONE]"
        assert _content(chunks) == single["choices"][0]["message"]["content"], body
        usage = chunks[-1]["usage"]
        assert _tokens(usage) == _tokens(single["usage"])
        assert usage["completion_tokens"] <= body["max_tokens"]
        finish = chunks[-2]["choices"][0]["finish_reason"]
        assert (finish == "length") == (usage["completion_tokens"] == body["max_tokens"])
    assert live_server.wait_idle()["sequences"] == 0


def test_cancel_half_of_the_streams(live_server):
    """Clients that vanish mid-stream leave; the others are unaffected. The
    vanishing ones ask for 4,000 tokens with the end of sequence forbidden,
    so only cancellation can end them before the idle check."""
    rng = random.Random(1)
    cut = {i: rng.randint(1, 8) for i in rng.sample(range(16), 8)}
    endless = {str(t): -100 for t in live_server.tokenizer.eos_token_ids}
    bodies = [_chat(live_server, p, 4000, logit_bias=endless) if i in cut
              else _chat(live_server, p, 16) for i, p in enumerate(PROMPTS)]
    alone = {}

    async def run():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=300) as c:
            jobs = [
                _stream(c, "/v1/chat/completions", b, stop_after=cut.get(i))
                for i, b in enumerate(bodies)
            ]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    health = live_server.wait_idle(timeout=10)
    assert health["sequences"] == 0 and health["active"] == 0 and health["queued"] == 0
    for i, body in enumerate(bodies):
        if i in cut:
            continue
        alone[i] = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert _content(results[i][0]) == alone[i]["choices"][0]["message"]["content"]


def test_max_tokens_one_at_64_way_concurrency(live_server):
    async def run():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=120) as c:
            bodies = [_chat(live_server, PROMPTS[i % 16], 1) for i in range(64)]
            return await asyncio.wait_for(
                asyncio.gather(*[c.post("/v1/chat/completions", json=b) for b in bodies]), 120
            )

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses)
    for r in responses:
        body = r.json()
        assert body["usage"]["completion_tokens"] == 1
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert live_server.wait_idle()["sequences"] == 0


def test_a_completion_continues_its_prompt_leading_space_included(live_server, smollm2):
    """A completion's text is its tokens' text: "The capital of France is"
    continues with " Paris", space included (a chat answer's opening space is
    trimmed; a completion's belongs to the text, as OpenAI returns it)."""
    import mlx.core as mx

    model, tokenizer = smollm2
    prompt = "The capital of France is"
    tokens = tokenizer.encode(prompt)
    for _ in range(5):
        tokens.append(model(mx.array([tokens]))[0, -1].argmax().item())
    expected = tokenizer.decode(tokens[len(tokenizer.encode(prompt)):])
    assert expected.startswith(" ")
    r = httpx.post(live_server.url + "/v1/completions", timeout=60, json={
        "model": live_server.model, "prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert r.json()["choices"][0]["text"] == expected


def test_stop_string(live_server):
    base = {"model": live_server.model, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 20, "temperature": 0}
    full = httpx.post(live_server.url + "/v1/completions", json=base, timeout=60).json()
    text = full["choices"][0]["text"]
    stop = text[4:7]
    assert stop and stop in text
    cut = httpx.post(live_server.url + "/v1/completions", json={**base, "stop": [stop, "zzz"]},
                     timeout=60).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]

    async def run():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=60) as c:
            return await _stream(c, "/v1/completions", {**base, "stop": stop})

    chunks, _ = asyncio.run(run())
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: text.index(stop)]


def test_seed_makes_sampling_reproducible(live_server):
    body = _chat(live_server, "Write a sentence about dogs.", 16, temperature=1.0, seed=1234)
    a = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    b = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    c = httpx.post(live_server.url + "/v1/chat/completions", json={**body, "seed": 99}, timeout=60).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["choices"][0]["message"]["content"] != c["choices"][0]["message"]["content"]


def test_logprobs_are_correct(live_server, smollm2):
    """Returned logprobs equal the model's own log-softmax for the same tokens."""
    import mlx.core as mx

    model, tokenizer = smollm2
    prompt = "The capital of France is"
    body = {"model": live_server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "logprobs": 3}
    out = httpx.post(live_server.url + "/v1/completions", json=body, timeout=60).json()
    lp = out["choices"][0]["logprobs"]
    ids = tokenizer.encode(prompt)
    for k, token_lp in enumerate(lp["token_logprobs"]):
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        ref = logits - mx.logsumexp(logits)
        best = int(mx.argmax(ref).item())
        assert token_lp == pytest.approx(ref[best].item(), abs=1e-3)
        assert lp["tokens"][k] == tokenizer.decode([best])
        top = lp["top_logprobs"][k]
        assert len(top) == 3 and max(top.values()) == pytest.approx(token_lp, abs=1e-6)
        ids.append(best)

    chat = httpx.post(live_server.url + "/v1/chat/completions",
                      json=_chat(live_server, "Hi", 3, logprobs=True, top_logprobs=2), timeout=60).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1 and all(len(e["top_logprobs"]) == 2 for e in content)
    assert all(e["logprob"] <= 0 for e in content)


def test_repetition_penalty_changes_output(live_server):
    body = {"model": live_server.model, "prompt": "la la la la la la", "max_tokens": 12, "temperature": 0}
    plain = httpx.post(live_server.url + "/v1/completions", json=body, timeout=60).json()
    penalised = httpx.post(live_server.url + "/v1/completions",
                           json={**body, "repetition_penalty": 1.8}, timeout=60).json()
    assert plain["choices"][0]["text"] != penalised["choices"][0]["text"]
