"""Speculation metrics on a real run: consistent, stop-aware, parseable; the controller live."""

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_spec_engine import SOURCE, _run

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.control.controller import DynamicSpecController
from mlx_lm_server.spec_decode.engine import SpecDecodeEngine
from mlx_lm_server.spec_decode.proposer.ngram import NGramProposer

JSON_KEYS = {
    "mode", "enabled", "speculating", "k", "acceptance_rate", "mean_accepted_length",
    "acceptance_per_position", "totals", "time_per_step_ms", "decode_tokens_per_second",
}


@pytest.fixture(scope="module")
def spec_server(smollm2_path):
    from conftest import LiveServer

    # Fixed k: whether the adaptive controller speculates follows this machine's
    # timings, and these tests need speculation to count (the controller's own
    # decisions are tested with a fixed cost curve below).
    server = LiveServer(smollm2_path, spec=SpecDecodeConfig(
        mode="ngram", num_speculative_tokens=6, dynamic=False, adaptive_k=False))
    yield server
    server.close()


def _chat(server, text, **kw):
    return {"model": server.model, "messages": [{"role": "user", "content": text}],
            "temperature": 0, **kw}


def test_metrics_are_consistent_and_exclude_tokens_after_a_stop(spec_server):
    s = spec_server
    copy = "Repeat the following code exactly:\n\n" + SOURCE
    first = httpx.post(s.url + "/v1/chat/completions", json=_chat(s, copy, max_tokens=80),
                       timeout=300).json()
    text = first["choices"][0]["message"]["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 8]
    bodies = [
        _chat(s, copy, max_tokens=80),
        _chat(s, copy, max_tokens=80, stop=[stop]),  # stop inside an accepted run
        _chat(s, "Write one sentence about the sea.", max_tokens=30),
        _chat(s, copy, max_tokens=7),
    ]

    async def run():
        async with httpx.AsyncClient(base_url=s.url, timeout=300) as c:
            return await asyncio.gather(*[c.post("/v1/chat/completions", json=b) for b in bodies])

    responses = [first] + [r.json() for r in asyncio.run(run())]
    s.wait_idle()
    usages = [r["usage"] for r in responses]
    for u in usages:
        sd = u["spec_decode"]
        assert set(sd) == {"draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length"}
        assert sd["accepted_tokens"] <= sd["draft_tokens"]
        assert sd["accepted_tokens"] < u["completion_tokens"]
    assert responses[2]["choices"][0]["finish_reason"] == "stop"
    assert responses[2]["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert sum(u["spec_decode"]["accepted_tokens"] for u in usages) > 10

    m = httpx.get(s.url + "/v1/spec_decode/metrics", timeout=10).json()
    assert set(m) == JSON_KEYS
    totals = m["totals"]
    assert totals["emitted_tokens"] == sum(u["completion_tokens"] for u in usages)
    assert totals["emitted_tokens"] == totals["steps"] + totals["accepted_tokens"]
    assert totals["accepted_tokens"] == sum(u["spec_decode"]["accepted_tokens"] for u in usages)
    assert totals["draft_tokens"] == sum(u["spec_decode"]["draft_tokens"] for u in usages)
    assert m["mean_accepted_length"] == pytest.approx(
        1 + totals["accepted_tokens"] / totals["drafts"], abs=1e-3)
    assert m["enabled"] and m["mode"] == "ngram"
    assert set(m["time_per_step_ms"]) == {"propose", "verify", "rollback"}
    assert sum(int(n) for n in m["k"]["distribution"].values()) > 0
    per_pos = m["acceptance_per_position"]
    assert per_pos == sorted(per_pos, reverse=True)  # a later position needs every earlier one

    text = httpx.get(s.url + "/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = {n: families[n].samples[0].value for n in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
    assert value["spec_decode_num_drafts"] == totals["drafts"]
    assert value["spec_decode_num_draft_tokens"] == totals["draft_tokens"]
    assert value["spec_decode_num_accepted_tokens"] == totals["accepted_tokens"]
    per_pos_samples = {s_.labels["position"]: s_.value
                       for s_ in families["spec_decode_num_accepted_tokens_per_pos"].samples}
    assert sum(per_pos_samples.values()) == totals["accepted_tokens"]
    for name in ("num_requests_running", "num_requests_waiting", "generation_tokens",
                 "request_success", "time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert name in families, name


def test_metrics_without_speculation(live_server):
    m = httpx.get(live_server.url + "/v1/spec_decode/metrics", timeout=10).json()
    assert set(m) == JSON_KEYS and m["mode"] == "none" and not m["enabled"]
    body = {"model": live_server.model, "prompt": "Hi", "max_tokens": 3}
    r = httpx.post(live_server.url + "/v1/completions", json=body, timeout=60).json()
    assert "spec_decode" not in r["usage"]
    text = httpx.get(live_server.url + "/metrics", timeout=10).text
    assert "spec_decode_num_drafts_total" in text


def test_controller_switches_off_on_unpredictable_text_and_back_on(smollm2):
    """With a fixed cost curve (timings on a shared machine are noise), the gain
    rule turns speculation off for a story and on again for a copy task."""
    model, tokenizer = smollm2
    controller = DynamicSpecController(6, alpha=0.5, warmup=1, probe_interval=4)
    controller.cost = lambda batch_size, k: 1.0 + 0.15 * k
    engine = SpecDecodeEngine(model, SpecDecodeConfig(mode="ngram", num_speculative_tokens=6),
                              NGramProposer(1, 4), controller)
    s = make_scheduler(model, tokenizer, engine=engine)
    s.start()
    greedy = SamplingParams(temperature=0)

    def chat(text):
        return tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False)

    try:
        _run(s, [GenerationRequest(chat("Tell me a story about a dragon who loves tea."), 60, greedy)])
        last = engine.steps.last_decision
        assert not last.speculating, last.reason
        assert last.reason.startswith(("off", "probe"))
        # a text that continues by repeating itself: n-gram lookup predicts it
        loop = tokenizer.encode("the cat sat on the mat. " * 12)
        _run(s, [GenerationRequest(loop, 80, greedy)])
        last = engine.steps.last_decision
        assert last.speculating, last.reason
        assert last.k > 0
    finally:
        s.shutdown()
        s.join(10)


def test_streaming_with_speculation_matches_non_streaming(spec_server):
    """Multi-token steps reach the stream in order."""
    import json

    s = spec_server
    body = _chat(s, "Repeat the following code exactly:\n\n" + SOURCE, max_tokens=64)
    plain = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300).json()
    pieces = []
    with httpx.stream("POST", s.url + "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:]))
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert pieces[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_logprobs_of_accepted_drafts_are_their_own_positions(spec_server, live_server):
    """Each token's logprob comes from the distribution it was drawn at, also
    for tokens that were accepted drafts: the same values as without
    speculation (float32, one request at a time)."""
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    body = {"messages": [{"role": "user", "content": f"Repeat exactly: {text}\n{text}"}],
            "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    spec = httpx.post(spec_server.url + "/v1/chat/completions", timeout=120,
                      json={"model": spec_server.model, **body}).json()
    plain = httpx.post(live_server.url + "/v1/chat/completions", timeout=120,
                       json={"model": live_server.model, **body}).json()
    assert spec["usage"]["spec_decode"]["accepted_tokens"] > 0
    a, b = (r["choices"][0]["logprobs"]["content"] for r in (spec, plain))
    assert [e["token"] for e in a] == [e["token"] for e in b]
    for x, y in zip(a, b):
        assert abs(x["logprob"] - y["logprob"]) < 1e-3, (x, y)
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
