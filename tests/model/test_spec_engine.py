"""Speculative decoding on the real SmolLM2 model: same tokens, same distribution.

Requests go straight to the scheduler (no HTTP) so the tests see token ids.
"""

import asyncio
import logging
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from parity import assert_same_or_near_tie

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import DoneEvent, ErrorEvent, GenerationRequest, TextEvent
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig

SOURCE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        if value == "":
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged
'''


def _chat(tokenizer, text):
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                      add_generation_prompt=True),
        add_special_tokens=False,
    )


def _prompts(tokenizer):
    texts = [
        "Repeat the following code exactly:\n\n" + SOURCE,
        "Rename merge_configs to combine_configs and return the whole file:\n\n" + SOURCE,
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        "What is the capital of France?",
        "List the numbers from 1 to 20, separated by commas.",
        "Write a haiku about autumn.",
        "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears.",
        "Summarise in one line: " + SOURCE[:300],
    ]
    return [_chat(tokenizer, t) for t in texts]


def _run(scheduler, requests, stagger=0.0, one_by_one=False):
    """Each request's (token ids, text, done event), the i-th submitted after
    ``i * stagger`` seconds or, ``one_by_one``, once the one before has
    streamed its first tokens: then every prompt is prefilled alone between
    decode steps however slow the machine (timed arrivals bunch up into one
    prefill where steps are slow)."""
    async def one(req, delay, after, started):
        await asyncio.sleep(delay)
        if after is not None:
            await after.wait()
        handle = scheduler.submit(req)
        ids, text = [], []
        try:
            while True:
                event = await handle.events.get()
                if isinstance(event, TextEvent):
                    ids.extend(event.token_ids)
                    text.append(event.text)
                    if ids:
                        started.set()
                elif isinstance(event, ErrorEvent):
                    raise AssertionError(event.message)
                else:
                    assert isinstance(event, DoneEvent)
                    return ids, "".join(text), event
        finally:
            started.set()

    async def main():
        started = [asyncio.Event() for _ in requests]
        return await asyncio.gather(*[
            one(r, i * stagger, started[i - 1] if one_by_one and i else None, started[i])
            for i, r in enumerate(requests)])

    return asyncio.run(main())


def _scheduler(model, tokenizer, mode, **kw):
    spec = SpecDecodeConfig(mode=mode, **kw)
    s = make_scheduler(model, tokenizer, max_batch_size=32, max_queued_requests=1000,
                  engine=make_engine(model, spec))
    s.start()
    return s


@pytest.fixture(scope="module")
def schedulers(smollm2):
    model, tokenizer = smollm2
    plain = _scheduler(model, tokenizer, "none")
    # Fixed k: every step with a draft goes through the verifier. Whether the
    # adaptive controller would speculate here depends on this machine's
    # timings, and these tests are about what verification emits.
    spec = _scheduler(model, tokenizer, "ngram", num_speculative_tokens=6,
                      dynamic=False, adaptive_k=False)
    yield plain, spec
    for s in (plain, spec):
        s.shutdown()
        s.join(10)


def exact_two_token_distribution(model, prompt, top_k):
    """P(t1, t2) at temperature 1 restricted to the top_k tokens, from the model itself."""

    def dist(tokens):
        logits = model(mx.array([tokens]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
        lp = np.asarray(logits - mx.logsumexp(logits))
        top = np.argsort(-lp)[:top_k]
        w = np.exp(lp[top] - lp[top].max())
        return dict(zip(top.tolist(), (w / w.sum()).tolist()))

    return {(t1, t2): p1 * p2 for t1, p1 in dist(prompt).items()
            for t2, p2 in dist(prompt + [t1]).items()}


def _assert_same_or_near_tie(model, prompt, a, b):
    """The converted SmolLM2 computes in float32."""
    assert_same_or_near_tie(model, prompt, a, b, mx.float32)


# Behind --run-slow (25-27 s each on a 2-core CPU): 16 staggered rows with
# joins and leaves run in the default suite on tiny models of every cache
# kind (test_hybrid_caches.py's test_greedy_parity_16_staggered).
@pytest.mark.slow
@pytest.mark.parametrize("stagger", [0.0, 0.15])
def test_greedy_parity_batch_16(smollm2, schedulers, stagger):
    model, tokenizer = smollm2
    plain, spec = schedulers
    prompts = _prompts(tokenizer) * 2
    reqs = [GenerationRequest(p, max_tokens=32 + 8 * (i % 3), sampling=SamplingParams(temperature=0))
            for i, p in enumerate(prompts)]
    base = _run(plain, reqs, stagger)
    ours = _run(spec, reqs, stagger)
    for p, (a, text_a, done_a), (b, text_b, done_b) in zip(prompts, base, ours):
        _assert_same_or_near_tie(model, p, a, b)
        if a == b:
            assert text_a == text_b
            assert done_a.completion_tokens == done_b.completion_tokens == len(a)
            assert done_a.finish_reason == done_b.finish_reason
    counts = spec.spec_stats.tokens
    assert counts.num_accepted_tokens > 50, counts  # speculation really happened
    _wait_empty(spec)


def _wait_empty(scheduler, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while scheduler.stats()["sequences"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert scheduler.stats()["sequences"] == 0


def test_greedy_parity_batch_1(smollm2, schedulers):
    model, tokenizer = smollm2
    plain, spec = schedulers
    before = spec.spec_stats.tokens.num_accepted_tokens
    for p in _prompts(tokenizer)[:3]:
        req = GenerationRequest(p, max_tokens=64, sampling=SamplingParams(temperature=0))
        (a, _, _), = _run(plain, [req])
        (b, _, _), = _run(spec, [req])
        _assert_same_or_near_tie(model, p, a, b)
    assert spec.spec_stats.tokens.num_accepted_tokens > before


def test_debug_logging_tells_each_steps_decision_and_why(smollm2, schedulers, caplog):
    """``--log-level debug``: a line a step, its batch size, k and reason."""
    _, tokenizer = smollm2
    _, spec = schedulers
    caplog.set_level(logging.DEBUG, logger="mlx_lm_server.spec_decode")
    req = GenerationRequest(_prompts(tokenizer)[0], max_tokens=8,
                            sampling=SamplingParams(temperature=0))
    _run(spec, [req])
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step: ")]
    assert steps and all(m.startswith("step: B=1 k=") for m in steps), steps
    assert any(m.startswith("step: B=1 k=6 fixed k") for m in steps), steps


def test_eos_max_tokens_and_stop_inside_drafts(smollm2, schedulers):
    """Stops that fire inside an accepted run emit up to the stop, nothing after."""
    model, tokenizer = smollm2
    plain, spec = schedulers
    prompt = _chat(tokenizer, "Repeat exactly: the cat sat on the mat.")
    greedy = SamplingParams(temperature=0)
    (full, text, done), = _run(plain, [GenerationRequest(prompt, 64, greedy)])
    assert done.finish_reason == "stop"  # ends with EOS, copied from the prompt's <|im_end|>

    cases = [
        GenerationRequest(prompt, 64, greedy),  # EOS inside the accepted run
        GenerationRequest(prompt, 5, greedy),  # max_tokens inside the run
        GenerationRequest(prompt, 64, greedy, stop=[text[6:14]]),  # multi-token stop string
    ]
    for req in cases:
        (a, ta, da), = _run(plain, [req])
        (b, tb, db), = _run(spec, [req])
        assert (a, ta, da.finish_reason, da.completion_tokens) == (b, tb, db.finish_reason, db.completion_tokens)
    (ids, t, d), = _run(spec, [cases[1]])
    assert len(ids) == 5 and d.finish_reason == "length"
    (ids, t, d), = _run(spec, [cases[2]])
    assert d.finish_reason == "stop" and t == text[: text.index(text[6:14])]


# The rejection sampler against the exact distribution: with every filter and
# penalty in test_sampled_tokens_follow_the_filtered_distribution below; at
# temperature 1 / top_k 3 beside a draft model's rows in test_mixed_proposer.py.


def _tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def _check_two_token_distribution(model, tokenizer, spec, params=None, exact=None,
                                  min_drafted=0.5):
    prompt = tokenizer.encode(COUNTING)
    params = params or dict(temperature=1.0, top_k=3)
    exact = exact or exact_two_token_distribution(model, prompt, top_k=3)

    before = spec.spec_stats.tokens.num_drafts
    n = 600
    reqs = [GenerationRequest(prompt, 2, SamplingParams(seed=s, **params)) for s in range(n)]
    counts = {}
    for ids, _, _ in _run(spec, reqs):
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1 / n
    assert spec.spec_stats.tokens.num_drafts - before > min_drafted * n  # drafts were really verified
    tv = _tv(counts, exact)
    assert tv < 0.08, (tv, counts, exact)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)


COUNTING = "one two three one two three one two three one two"


def exact_filtered_two_token_distribution(model, prompt, params: SamplingParams):
    """P(t1, t2) after the request's processors (penalties over the context
    so far) and its sampling filters, from the model itself."""
    from mlx_lm_server.decoding.sampling import make_processors, sampling_logits

    def dist(tokens):
        logits = model(mx.array([tokens]), cache=make_prompt_cache(model))[:, -1].astype(mx.float32)
        for process in make_processors(params):
            logits = process(mx.array(tokens), logits)
        logprobs = logits - mx.logsumexp(logits, -1, keepdims=True)
        probs = np.asarray(mx.softmax(sampling_logits(params, logprobs), -1)[0])
        return {int(t): float(probs[t]) for t in np.flatnonzero(probs > 1e-9)}

    return {(t1, t2): p1 * p2 for t1, p1 in dist(prompt).items()
            for t2, p2 in dist(prompt + [t1]).items()}


# Long by nature (a distribution, 48 s): --run-slow and scripts/mutants.py run it; the
# default run keeps T > 0 through the hybrid, MTP and rejection-sampler distribution tests.
@pytest.mark.slow
def test_sampled_tokens_follow_the_filtered_distribution(smollm2):
    """Temperature 0.8 with top-p, min-p, top-k, a repetition and a presence
    penalty: drafts are judged against the distribution after every filter,
    penalties' context at the first position (the only one two tokens reach;
    ``test_processors_see_the_context_grow_by_each_draft`` checks the rest)."""
    model, tokenizer = smollm2
    # Penalties light enough that " three" (the n-gram draft) stays likely:
    # a stronger one filters it out and nothing is ever drafted.
    # top-p binds before top-k here (without it the second token's
    # distribution is 0.25 away in total variation).
    params = dict(temperature=0.8, top_p=0.5, min_p=0.02, top_k=20,
                  repetition_penalty=1.02, presence_penalty=0.4)
    prompt = tokenizer.encode(COUNTING)
    exact = exact_filtered_two_token_distribution(model, prompt, SamplingParams(**params))
    # The filters and penalties change the distribution by far more than the
    # test's tolerance, so verifying against the unfiltered one would fail.
    loose = exact_filtered_two_token_distribution(
        model, prompt, SamplingParams(temperature=0.8, top_k=4))
    assert _tv(exact, loose) > 0.2, _tv(exact, loose)
    spec = _scheduler(model, tokenizer, "ngram", num_speculative_tokens=6, dynamic=False,
                      adaptive_k=False)
    try:
        # A draft exists when the first token occurred in the prompt (45% is " three").
        _check_two_token_distribution(model, tokenizer, spec, params, exact, min_drafted=0.35)
    finally:
        spec.shutdown()
        spec.join(10)


def test_processors_see_the_context_grow_by_each_draft():
    """A penalty at draft position j must count the j drafts before it: the
    context it sees is the row's tokens so far plus those drafts."""
    from mlx_lm_server.spec_decode.target_probs import process_logits

    seen = []

    def recording(ctx, logits):
        seen.append(ctx.tolist())
        return logits + 1.0

    logits = mx.zeros((2, 3, 5))  # [B, k + 1, V]
    draft = np.array([[7, 8], [9, 9]])
    out = process_logits(logits, [[recording], []], [mx.array([1, 2]), mx.array([3])], draft)
    assert seen == [[1, 2], [1, 2, 7], [1, 2, 7, 8]]
    assert out[0].tolist() == [[1.0] * 5] * 3 and out[1].tolist() == [[0.0] * 5] * 3


def test_seeded_sampling_is_reproducible_with_fixed_speculation(smollm2):
    """With fixed k the steps are the same every run, so a seed gives the same tokens.

    Not claimed: the same tokens inside a different batch, or with the adaptive
    controller, where which path (plain or verified) samples a position can
    change; the distribution is exact either way.
    """
    model, tokenizer = smollm2
    s = _scheduler(model, tokenizer, "ngram", num_speculative_tokens=4, dynamic=False,
                   adaptive_k=False)
    try:
        p = _prompts(tokenizer)[0]
        req = GenerationRequest(p, 32, SamplingParams(temperature=0.8, seed=7))
        (a, _, _), = _run(s, [req])
        (b, _, _), = _run(s, [req])
        (c, _, _), = _run(s, [GenerationRequest(p, 32, SamplingParams(temperature=0.8, seed=8))])
        assert a == b and a != c
        assert s.engine.steps.verify_steps > 0
    finally:
        s.shutdown()
        s.join(10)


def test_repetition_penalty_parity(smollm2, schedulers):
    """Processors see the context grow by one accepted token per position."""
    model, tokenizer = smollm2
    plain, spec = schedulers
    p = _prompts(tokenizer)[0]
    req = GenerationRequest(p, 48, SamplingParams(temperature=0, repetition_penalty=1.3))
    (a, _, _), = _run(plain, [req])
    (b, _, _), = _run(spec, [req])
    _assert_same_or_near_tie(model, p, a, b)


def test_disable_by_batch_size_falls_back_to_plain_steps(smollm2):
    model, tokenizer = smollm2
    s = _scheduler(model, tokenizer, "ngram", disable_by_batch_size=2)
    try:
        reqs = [GenerationRequest(p, 16, SamplingParams(temperature=0)) for p in _prompts(tokenizer)[:4]]
        _run(s, reqs)
        assert s.engine.steps.plain_steps > 0
    finally:
        s.shutdown()
        s.join(10)


def test_plain_steps_after_ragged_verification_run_on_aligned_rows(smollm2, monkeypatch):
    """A verification step leaves rows that kept different numbers of drafts
    ragged; the next plain step (here: a step where no row has a draft) must
    realign them, so that upstream's one-token path runs (see
    ``RaggedKVCache.realign``), and the output stays that of plain decoding."""
    from mlx_lm_server.kv import RaggedKVCache
    from mlx_lm_server.runtime import mlx_lm_adapter

    model, tokenizer = smollm2
    seen = []  # per plain step: whether its attention rows were aligned
    real_plain_step = mlx_lm_adapter.plain_step

    def spy(batch):
        first = next((c for c in batch.prompt_cache if isinstance(c, RaggedKVCache)), None)
        if first is not None:
            seen.append(first.aligned)
        return real_plain_step(batch)

    monkeypatch.setattr(mlx_lm_adapter, "plain_step", spy)
    plain = _scheduler(model, tokenizer, "none")
    spec = _scheduler(model, tokenizer, "ngram", num_speculative_tokens=6, dynamic=False,
                      adaptive_k=False)
    try:
        reqs = [GenerationRequest(p, 40, SamplingParams(temperature=0))
                for p in _prompts(tokenizer)[2:6]]
        expected = [ids for ids, _, _ in _run(plain, reqs)]
        seen.clear()  # the plain scheduler's steps use no RaggedKVCache anyway
        got = [ids for ids, _, _ in _run(spec, reqs)]
    finally:
        for s in (plain, spec):
            s.shutdown()
            s.join(10)
    assert seen and all(seen), seen
    assert spec.spec_stats.tokens.num_drafts > 0
    for p, a, b in zip(reqs, expected, got):
        _assert_same_or_near_tie(model, p.prompt_tokens, a, b)
