"""The prompt cache: later requests sharing a prefix prefill only the rest,
with the same output, with and without speculation, on the real SmolLM2."""

import httpx
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_spec_engine import SOURCE, _run

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.prompt_cache import PromptCache
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig


def _scheduler(model, tokenizer, mode, cache=True, **spec):
    engine = None
    if mode != "none":
        config = SpecDecodeConfig(mode=mode, dynamic=False, adaptive_k=False,
                                  num_speculative_tokens=4, **spec)
        engine = make_engine(model, config, tokenizer, "target")
    s = make_scheduler(model, tokenizer, max_batch_size=8, engine=engine,
                  prompt_cache=PromptCache(10, 1 << 32) if cache else None)
    s.start()
    return s


def _stop(s):
    s.shutdown()
    s.join(10)


def _turns(tokenizer, first_reply: list[int]) -> list[list[int]]:
    """A first prompt, and a second that extends it by the reply and a new question."""
    first = tokenizer.encode("Repeat this code exactly:\n" + SOURCE[:400])
    second = first + first_reply + tokenizer.encode("\nNow again, once more:\n" + SOURCE[:120])
    return [first, second]


@pytest.mark.parametrize("mode", ["none", "ngram", "draft"])
def test_a_follow_up_prefills_only_what_is_new_with_the_same_output(smollm2, smollm2_path, mode):
    model, tokenizer = smollm2
    spec = {"draft_model_path": str(smollm2_path)} if mode == "draft" else {}
    cached, fresh = _scheduler(model, tokenizer, mode, **spec), \
        _scheduler(model, tokenizer, mode, cache=False, **spec)
    greedy = SamplingParams(temperature=0)
    try:
        first = _turns(tokenizer, [])[0]
        (reply, _, done1), = _run(cached, [GenerationRequest(first, 24, greedy)])
        second = _turns(tokenizer, reply)[1]
        (got, _, done2), = _run(cached, [GenerationRequest(second, 24, greedy)])
        (want, _, _), = _run(fresh, [GenerationRequest(second, 24, greedy)])
        # Sent again as is: all but its last token comes from the cache.
        (again, _, done3), = _run(cached, [GenerationRequest(second, 24, greedy)])
    finally:
        _stop(cached)
        _stop(fresh)
    assert done1.cached_tokens == 0
    # The first request's whole sequence (prompt and reply) was cached.
    assert done2.cached_tokens >= len(first) + len(reply) - 1, (done2.cached_tokens, len(first))
    assert done3.cached_tokens == len(second) - 1
    assert got == want == again
    if mode != "none":
        assert done2.spec_decode["draft_tokens"] > 0


def test_the_cache_never_shares_an_entry_with_a_live_sequence(smollm2):
    """Two simultaneous requests with the same cached prefix each get their own
    copy: both answer as without the cache, and the entry is still intact."""
    model, tokenizer = smollm2
    s, fresh = _scheduler(model, tokenizer, "ngram"), _scheduler(model, tokenizer, "ngram",
                                                                  cache=False)
    prefix = tokenizer.encode("Repeat this code exactly:\n" + SOURCE[:300])
    greedy = SamplingParams(temperature=0)
    try:
        _run(s, [GenerationRequest(prefix, 8, greedy)])
        reqs = [GenerationRequest(prefix + tokenizer.encode(tail), 16, greedy)
                for tail in ("\nFirst:", "\nSecond, please:")]
        got = _run(s, reqs)
        want = _run(fresh, reqs)
        (again, _, done), = _run(s, [reqs[0]])
    finally:
        _stop(s)
        _stop(fresh)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert all(g[2].cached_tokens >= len(prefix) - 1 for g in got)
    assert again == want[0][0] and done.cached_tokens > len(prefix)


def _kv(model, tokens):
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_entries_are_evicted_by_count_and_by_bytes_least_recent_first(smollm2):
    model, _ = smollm2
    seqs = [[10 + i, 20, 30, 40, 50] for i in range(3)]
    size = sum(c.nbytes for c in _kv(model, seqs[0]))

    by_count = PromptCache(max_entries=2, max_bytes=1 << 40)
    for t in seqs:
        by_count.store(t, _kv(model, t))
    assert len(by_count) == 2
    assert by_count.fetch(seqs[0] + [60])[1] == 0  # the oldest went first
    assert by_count.fetch(seqs[2] + [60])[1] == len(seqs[2])

    by_bytes = PromptCache(max_entries=10, max_bytes=2 * size)
    for t in seqs:
        by_bytes.store(t, _kv(model, t))
    assert len(by_bytes) == 2 and by_bytes.nbytes <= 2 * size
    assert by_bytes.fetch(seqs[0] + [60])[1] == 0


def test_a_fetched_cache_is_a_private_copy(smollm2):
    model, _ = smollm2
    tokens = [5, 6, 7, 8, 9]
    pc = PromptCache(4, 1 << 40)
    pc.store(tokens, _kv(model, tokens))
    a, n = pc.fetch(tokens + [10])
    assert n == len(tokens)
    model(mx.array([[10, 11, 12]]), cache=a)  # a live sequence extends its copy
    b, m = pc.fetch(tokens + [10])
    assert m == len(tokens) and b[0].offset == len(tokens) and a[0].offset == len(tokens) + 3
    assert pc.queried_tokens == 12 and pc.hit_tokens == 10


def test_usage_and_metrics_report_cached_tokens(live_server):
    body = {"model": live_server.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say the alphabet: " + SOURCE[:200]}]}
    first = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    second = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == second["usage"]["prompt_tokens"] - 1
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    text = httpx.get(live_server.url + "/metrics", timeout=10).text
    hits = [line for line in text.splitlines() if line.startswith("prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= cached


def test_a_prompt_equal_to_a_stored_sequence_prefills_its_last_token_again(smollm2):
    """A completions client continuing where its last request ended sends
    exactly the sequence the cache holds (prompt and the reply's fed tokens).
    The entry must be cut back by one token, so that token is prefilled again
    to give the next logits: fed twice, the model would see it twice."""
    model, tokenizer = smollm2
    cached, fresh = _scheduler(model, tokenizer, "none"), \
        _scheduler(model, tokenizer, "none", cache=False)
    greedy = SamplingParams(temperature=0)
    try:
        first = tokenizer.encode("Repeat this code exactly:\n" + SOURCE[:300])
        (reply, _, done1), = _run(cached, [GenerationRequest(first, 12, greedy)])
        assert done1.finish_reason == "length"
        # Every emitted token was fed (a step feeds the token it emits), so
        # the entry holds the prompt and the whole reply.
        stored = first + reply
        (got, _, done2), = _run(cached, [GenerationRequest(stored, 16, greedy)])
        (want, _, _), = _run(fresh, [GenerationRequest(stored, 16, greedy)])
    finally:
        _stop(cached)
        _stop(fresh)
    assert done2.cached_tokens == len(stored) - 1
    assert got == want
