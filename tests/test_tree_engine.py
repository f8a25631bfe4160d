"""Trees of drafts through the engine: the same greedy output as plain
decoding, with branches really verified and really kept."""

import mlx.core as mx
import pytest

from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import GenerationRequest
from parity import assert_same_or_near_tie
from test_spec_engine import _prompts, _run, _scheduler


@pytest.fixture(scope="module")
def tree_schedulers(smollm2):
    model, tokenizer = smollm2
    plain = _scheduler(model, tokenizer, "none")
    trees = _scheduler(model, tokenizer, "ngram", num_speculative_tokens=6, dynamic=False,
                       adaptive_k=False, tree_width=4)
    yield plain, trees
    for s in (plain, trees):
        s.shutdown()
        s.join(10)


@pytest.fixture(scope="module")
def suffix_trees(smollm2):
    model, tokenizer = smollm2
    trees = _scheduler(model, tokenizer, "suffix", num_speculative_tokens=6, dynamic=False,
                       adaptive_k=False, tree_width=4)
    yield trees
    trees.shutdown()
    trees.join(10)


@pytest.mark.parametrize("batch, stagger, mode",
                         [(1, 0.0, "ngram"), (8, 0.1, "ngram"), (1, 0.0, "suffix")])
def test_greedy_output_with_trees_is_plain_decodings(smollm2, tree_schedulers, suffix_trees,
                                                     batch, stagger, mode):
    model, tokenizer = smollm2
    plain, trees = tree_schedulers
    if mode == "suffix":  # the index of earlier outputs branches too
        trees = suffix_trees
    prompts = _prompts(tokenizer)[:batch]
    reqs = [GenerationRequest(p, max_tokens=48, sampling=SamplingParams(temperature=0))
            for p in prompts]
    steps = trees.spec_stats.steps
    before = (steps.tree_steps, steps.tree_accepted)
    if batch == 1:
        prompts = _prompts(tokenizer)[:3]
        reqs = [GenerationRequest(p, max_tokens=48, sampling=SamplingParams(temperature=0))
                for p in prompts]
        base = [_run(plain, [r])[0] for r in reqs]
        ours = [_run(trees, [r])[0] for r in reqs]
    else:
        base, ours = _run(plain, reqs, stagger), _run(trees, reqs, stagger)
    for p, (a, text_a, _), (b, text_b, _) in zip(prompts, base, ours):
        assert_same_or_near_tie(model, p, a, b, mx.float32)
        if a == b:
            assert text_a == text_b
    assert steps.tree_steps > before[0] and steps.tree_accepted > before[1]
    if mode == "suffix":
        assert trees.engine.proposer.stats()["drafts_from_index"] > 0


def test_trees_keep_drafts_a_chain_of_first_guesses_would_lose(smollm2, tree_schedulers):
    """Over the steps above and this one, some accepted draft was a second
    or later sibling: the branches pay, not only the first path."""
    model, tokenizer = smollm2
    _, trees = tree_schedulers
    reqs = [GenerationRequest(p, max_tokens=64, sampling=SamplingParams(temperature=0))
            for p in _prompts(tokenizer)]
    _run(trees, reqs)
    steps = trees.spec_stats.steps
    assert steps.tree_off_first > 0, (steps.tree_steps, steps.tree_accepted)
    trees_body = trees.spec_stats.snapshot()["trees"]  # /v1/spec_decode/metrics
    assert trees_body["accepted_off_first_child"] == steps.tree_off_first
    assert trees_body["steps"] == steps.tree_steps
