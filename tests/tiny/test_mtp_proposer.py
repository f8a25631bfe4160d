"""``--spec-decode mtp``: the checkpoint's own MTP layer drafts, under
continuous batching, losslessly.

Two tiny qwen3_5 checkpoints carry ``mtp.*`` weights in the Hugging Face
layout: a one-layer model whose MTP layer copies it (``build_mtp_copy``: its
drafts are right about a third of the time, so drafts are both kept and
refused), and a random hybrid (gated-delta layers between attention layers)
whose head's drafts are all refused. Greedy output must be the target's
token for token, sampled output must keep the target's distribution, and the
head's KV cache must always equal a fresh pass of the head over the
target's own (hidden state, next token) pairs.
"""

import math

import mlx.core as mx
import pytest
from test_draft_model import _stop
from test_hybrid_caches import _exact_distribution
from test_spec_engine import _run
from tiny_models import build, build_mtp_copy

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.proposer.head import HeadProposer

GREEDY = SamplingParams(temperature=0)
TEXTS = ["hello there my friend", "def f(x): return", "one two three four five",
         "the cat sat on the mat and", "a b c d e f g", "print('hi')"]


@pytest.fixture(scope="module")
def copy_path(tmp_path_factory, smollm2_path):
    return build_mtp_copy(tmp_path_factory.mktemp("mtp-copy"), smollm2_path)


@pytest.fixture(scope="module")
def copy_model(copy_path):
    from mlx_lm import load

    return load(str(copy_path))


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, smollm2_path):
    return build("qwen3_5_mtp", tmp_path_factory.mktemp("mtp-hybrid"), smollm2_path,
                 scale=2.0, seed=3)


def _scheduler(model, tokenizer, path, mode="mtp", k=3, **kw):
    config = SpecDecodeConfig(mode=mode, num_speculative_tokens=k, **{
        "dynamic": False, "adaptive_k": False, "calibration_seconds": 0, **kw})
    engine = make_engine(model, config, tokenizer, str(path)) if mode != "none" else None
    s = make_scheduler(model, tokenizer, max_batch_size=16, max_queued_requests=2048,
                       engine=engine)
    s.start()
    return s


def _greedy(model, tokenizer, path, mode, prompts, stagger, max_tokens=40, **config_fields):
    """Greedy outputs of ``prompts`` (staggered) through ``mode``, and the
    token counts; ``config_fields``: more of the speculation config."""
    s = _scheduler(model, tokenizer, path, mode, **config_fields)
    try:
        reqs = [GenerationRequest(p, max_tokens + 5 * (i % 3), GREEDY)
                for i, p in enumerate(prompts)]
        out = [ids for ids, _, _ in _run(s, reqs, stagger)]
        if mode != "none":  # a proposer that raised would leave the step plain
            assert s.spec_stats.snapshot()["totals"]["fault_steps"] == 0
        return out, s.spec_stats.tokens
    finally:
        _stop(s)


@pytest.mark.parametrize("batch,stagger", [(1, 0.0), (6, 0.1)])
def test_greedy_output_is_the_targets_with_the_heads_drafts(copy_model, copy_path, batch,
                                                           stagger):
    """Rows join while others draft, drafts are kept and refused: every
    token is the plain model's."""
    model, tokenizer = copy_model
    prompts = [tokenizer.encode(t) for t in TEXTS[:batch]]
    plain, _ = _greedy(model, tokenizer, copy_path, "none", prompts, stagger)
    ours, counts = _greedy(model, tokenizer, copy_path, "mtp", prompts, stagger)
    assert ours == plain
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, counts
    assert counts.accepted_per_pos[1] > 0, counts  # chained drafts kept too


def test_a_hybrid_target_rolls_back_its_recurrent_layers_past_the_heads_drafts(hybrid_path):
    """qwen3_5 with gated-delta layers: the random head's drafts are all
    refused, and the output stays the plain model's."""
    from mlx_lm import load

    model, tokenizer = load(str(hybrid_path))
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    plain, _ = _greedy(model, tokenizer, hybrid_path, "none", prompts, 0.1, 24)
    ours, counts = _greedy(model, tokenizer, hybrid_path, "mtp", prompts, 0.1, 24)
    assert ours == plain
    assert counts.num_draft_tokens > 100, counts


def _logits_without_cache(model, tokens):
    """Next-token logits from a whole-sequence forward (upstream's one-layer
    qwen3_5 cannot build its mask over a plain ``KVCache``)."""
    return model(mx.array([tokens]))[0, -1]


class CheckedProposer(HeadProposer):
    """Before every proposal, each row's head cache against a fresh pass of
    the head over the target's pairs (f_j, x_{j+1}), from the row's first
    decode step to the last pair fed. ``features(tokens)``: the target's
    features [1, T, F] over a sequence, computed afresh."""

    def __init__(self, head, embed, to_logits, features, prompts, hidden_layers=None):
        super().__init__(head, embed, to_logits, hidden_layers)
        self.features = features
        self.prompts = [list(p) for p in prompts]
        self.checked = 0
        self.worst = 0.0
        self.problems = []
        self.firsts = set()

    def propose(self, uids, contexts, k):
        self._drop_chained()
        for row, uid in enumerate(self.uids):
            context = contexts[list(uids).index(uid)].tolist()
            waiting = self.waiting_len[uid]
            cache = self.cache[0]
            pad = int(cache.left_padding[row].item())
            keys = cache.keys[row:row + 1, :, pad:cache.ends[row]]
            last = len(context) - 2 - waiting  # the last position paired in the cache
            first = last - (cache.ends[row] - pad) + 1
            self.firsts.add(first)  # 0: the prompt's pairs were fed from its first token
            hidden = self.features(context[:-1])
            fresh = self.head.make_cache()
            self.head(self.embed(mx.array([context[first + 1:last + 2]])),
                      hidden[:, first:last + 1], fresh)
            expected = fresh[0].keys[..., :fresh[0].offset, :]
            # Recorded, not raised: the engine takes a proposer's exception
            # as a failed proposal and decodes the step plainly.
            if keys.shape != expected.shape:
                self.problems.append((uid, keys.shape, expected.shape))
                continue
            self.worst = max(self.worst, mx.abs(keys - expected).max().item())
            self.checked += 1
        return super().propose(uids, contexts, k)


def test_the_heads_cache_equals_a_fresh_pass_over_the_targets_pairs(copy_model, copy_path):
    """After drafts kept and refused, rows joining and leaving: the head's
    cache holds exactly the pairs of the target's hidden states and the
    tokens that followed them, never its own chained guesses."""
    from mlx_lm_server.spec_decode.heads.mtp import load_mtp_head

    model, tokenizer = copy_model
    prompts = [tokenizer.encode(t) for t in TEXTS]
    proposer = CheckedProposer(
        load_mtp_head(model, str(copy_path)), mlx_lm_adapter.token_embedding(model),
        mlx_lm_adapter.output_projection(model),
        lambda tokens: mlx_lm_adapter.text_model(model).model(mx.array([tokens])),
        prompts)
    counts = run_checked(model, tokenizer, "mtp", proposer, prompts)
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens


def run_checked(model, tokenizer, mode, proposer, prompts, firsts=frozenset({0}),
                max_tokens=30, prefill_step_size=2048, **config_fields):
    """Greedy requests, staggered, through an engine with ``proposer`` (row
    i: ``max_tokens + 7 * (i % 3)`` tokens); asserts the checks held
    (``firsts``: the positions the rows' head caches start at). Returns the
    token counts."""
    from mlx_lm_server.spec_decode.engine import SpecDecodeEngine

    config = SpecDecodeConfig(mode=mode, num_speculative_tokens=3, dynamic=False,
                              adaptive_k=False, calibration_seconds=0, **config_fields)
    s = make_scheduler(model, tokenizer, max_batch_size=16, max_queued_requests=64,
                       prefill_step_size=prefill_step_size,
                       engine=SpecDecodeEngine(model, config, proposer))
    s.start()
    try:
        _run(s, [GenerationRequest(p, max_tokens + 7 * (i % 3), GREEDY)
                 for i, p in enumerate(prompts)], 0.1)
        counts = s.spec_stats.tokens
    finally:
        _stop(s)
    assert counts.num_draft_tokens > 0
    assert not proposer.problems, proposer.problems[:5]
    assert proposer.checked > 50, proposer.checked
    assert proposer.firsts == set(firsts), proposer.firsts
    assert proposer.worst < 1e-4, proposer.worst
    return counts


def test_sampled_tokens_keep_the_exact_distribution(tmp_path, smollm2_path):
    """Temperature 1.5, top_k 2, three tokens from 600 seeded requests: the
    head samples its drafts from its own q, the rejection sampler keeps the
    target's distribution. TV below 0.09 over 8 outcomes (sampling error
    about 0.04). The copy model over the tokenizer's first 2,048 tokens."""
    from mlx_lm import load

    path = build_mtp_copy(tmp_path / "small", smollm2_path, vocab=2048)
    model, tokenizer = load(str(path))
    prompt = tokenizer.encode("one two")  # the head's first drafts are kept now and then
    params = dict(temperature=1.5, top_k=2)
    s = _scheduler(model, tokenizer, path, k=2)
    n = 600
    try:
        reqs = [GenerationRequest(prompt, 4, SamplingParams(seed=i, **params)) for i in range(n)]
        counts = {}
        for ids, _, _ in _run(s, reqs):
            counts[tuple(ids[:3])] = counts.get(tuple(ids[:3]), 0) + 1
        tokens = s.spec_stats.tokens
    finally:
        _stop(s)
    assert tokens.num_draft_tokens >= n, tokens  # the head drafted for the third token
    assert 0 < tokens.num_accepted_tokens < tokens.num_draft_tokens, tokens
    exact = _exact_distribution(model, prompt, 3, 2, 1.5, _logits_without_cache)
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    assert tv < 0.09, (tv, counts, exact)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)


def test_prompt_lookup_and_the_head_share_the_batch(copy_model, copy_path):
    """``ngram,mtp``: rows that copy take prompt-lookup drafts, the others
    the head's, verified in the same passes; output unchanged."""
    model, tokenizer = copy_model
    prompts = [tokenizer.encode(t) for t in TEXTS]
    plain, _ = _greedy(model, tokenizer, copy_path, "none", prompts, 0.1)
    s = _scheduler(model, tokenizer, copy_path, mode="ngram,mtp")
    try:
        reqs = [GenerationRequest(p, 40 + 5 * (i % 3), GREEDY) for i, p in enumerate(prompts)]
        ours = [ids for ids, _, _ in _run(s, reqs, 0.1)]
        by = s.spec_stats.snapshot()["totals"]["by_proposer"]
    finally:
        _stop(s)
    assert ours == plain
    assert by["mtp"]["accepted_tokens"] > 0, by


def test_a_row_kept_off_for_long_drafts_as_if_fresh_over_its_last_pairs(copy_model, copy_path):
    """A row the controller keeps off keeps at most ``2 * CATCH_UP`` pairs
    waiting, whatever its length; its next proposal restarts its head cache
    over the last ``CATCH_UP`` of them: the same drafts as a fresh row given
    only those, and a cache of exactly those pairs."""
    from mlx_lm_server.spec_decode.heads.mtp import load_mtp_head
    from mlx_lm_server.spec_decode.proposer.head import CATCH_UP

    model, tokenizer = copy_model
    head = load_mtp_head(model, str(copy_path))
    inner = mlx_lm_adapter.text_model(model).model
    tokens = (tokenizer.encode(" ".join(TEXTS)) * 40)[:4 * CATCH_UP + 20]
    hidden = inner(mx.array([tokens]))  # [1, T, H]: the target's pairs, computed once

    def proposer():
        return HeadProposer(head, mlx_lm_adapter.token_embedding(model),
                            mlx_lm_adapter.output_projection(model))

    kept_off = proposer()
    kept_off.add_sequence(0, 8)
    kept_off.observe_target([0], hidden[:, :8], [8])  # the prompt
    kept_off.propose([0], [mx.array(tokens[:9])], [2])  # the row enters the head's cache
    kept_off.observe_verification([0], [0])
    longest = 0
    for t in range(8, len(tokens) - 1):  # plain steps: one pair each, no proposal
        kept_off.observe_target([0], hidden[:, t:t + 1], [1])
        longest = max(longest, kept_off.waiting_len[0])
    assert CATCH_UP < longest <= 2 * CATCH_UP
    context = [mx.array(tokens)]
    ours = kept_off.propose([0], context, [3])
    assert kept_off.cache[0].offset - kept_off.chained == CATCH_UP

    fresh = proposer()
    fresh.add_sequence(0, CATCH_UP)
    fresh.observe_target([0], hidden[:, -1 - CATCH_UP:-1], [CATCH_UP])
    theirs = fresh.propose([0], context, [3])
    assert ours.draft_tokens.tolist() == theirs.draft_tokens.tolist()

    # A long prompt's features are not held for the row's life: a copy of their tail is.
    prompt = mx.random.normal((1, 20_000, hidden.shape[-1]))
    mx.eval(prompt)
    held = mx.get_active_memory()
    fresh.add_sequence(1, prompt.shape[1])
    fresh.observe_target([1], prompt, [prompt.shape[1]])
    del prompt
    mx.eval(fresh.waiting[1])
    assert mx.get_active_memory() < held - 0.9 * 20_000 * hidden.shape[-1] * 4
