"""Trees of drafts through the engine: the same greedy output as plain
decoding, with branches really verified and really kept."""

import mlx.core as mx
import pytest

from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.http.prometheus import ServerMetrics
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode.drafts import ProposalResult
from mlx_lm_server.spec_decode.proposer.base import BaseProposer
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
    # Trees of more nodes than a chain's k (--spec-tree-budget): wider passes.
    trees = _scheduler(model, tokenizer, "suffix", num_speculative_tokens=3, dynamic=False,
                       adaptive_k=False, tree_width=4, tree_budget=8)
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
        assert steps.tree_nodes > 3 * steps.tree_rows, steps  # past k: the budget's nodes


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
    by_rank = trees_body["accepted_by_sibling_rank"]
    assert sum(by_rank.values()) == steps.tree_accepted and by_rank["0"] > 0
    assert steps.tree_steps <= steps.tree_rows <= 8 * steps.tree_steps
    assert 1 <= trees_body["nodes_per_row"] <= 6  # at most k nodes a row
    scraped = ServerMetrics().watch(trees).render().decode()  # /metrics
    for rank, n in by_rank.items():
        assert f'spec_decode_tree_accepted_by_sibling_rank_total{{rank="{rank}"}} {float(n)}' \
            in scraped


def test_a_row_that_cannot_branch_drafts_a_chains_k_not_the_tree_budget(smollm2, suffix_trees):
    """k = 3, trees of 8 nodes: a row with a repetition penalty drafts
    chains (its context grows along one path), and a chain is verified k
    deep, not budget deep; the greedy row beside it still gets its trees."""
    model, tokenizer = smollm2
    engine = suffix_trees.engine
    seen = []  # (row penalised, its drafts verified) each step
    real = engine._verify_step

    def recording(batch, plan):
        uids = list(batch.uids)
        seen.extend((uid == penalised, n) for uid, n in zip(uids, plan.num_drafts))
        return real(batch, plan)

    prompt = _prompts(tokenizer)[0]
    reqs = [GenerationRequest(prompt, max_tokens=40, sampling=SamplingParams(
                temperature=0, repetition_penalty=rp)) for rp in (1.05, 1.0)]
    penalised = None
    engine._verify_step = recording
    try:
        real_add = engine.add_sequence

        def add(uid, params, *a, **k):
            nonlocal penalised
            if params.repetition_penalty != 1.0:
                penalised = uid
            return real_add(uid, params, *a, **k)

        engine.add_sequence = add
        _run(suffix_trees, reqs)
    finally:
        del engine._verify_step, engine.add_sequence
    assert any(p for p, _ in seen) and any(not p for p, _ in seen)
    assert max(n for p, n in seen if p) <= 3, seen
    assert max(n for p, n in seen if not p) > 3  # the greedy row's trees: past k


class TopTwoTree(BaseProposer):
    """Drafts, for every row, a tree over the target's own two likeliest
    tokens, each with its likeliest child (parents ``[0, 0, 1, 2]``). Under
    top-k 3 each sibling may be kept or refused and a third token may come
    from what is left of p, so the sibling rule and the mask decide the
    sampled tokens (positions and the kept path barely move a random 2-layer
    model's first verification: ``test_tree_pass.py`` pins them exactly)."""

    def __init__(self, model):
        self.model = model
        self.seen = {}  # requests share their prompt: few distinct contexts

    def _top2(self, tokens):
        key = tuple(tokens)
        if key not in self.seen:
            self.seen[key] = mx.argsort(-self.model(mx.array([tokens]))[0, -1])[:2].tolist()
        return self.seen[key]

    def propose(self, uids, contexts, k):
        trees = []
        for context in contexts:
            first, second = self._top2(context.tolist())
            trees.append(([first, second, self._top2(context.tolist() + [first])[0],
                           self._top2(context.tolist() + [second])[0]], [0, 0, 1, 2]))
        return ProposalResult.from_trees(trees, 4)

    def add_sequence(self, uid, prompt_len, params=None):
        pass

    def remove_sequence(self, uid):
        pass


def test_sampled_tokens_through_trees_keep_the_exact_distribution(tmp_path, smollm2_path):
    """Temperature 1.5, top_k 3, 800 seeded requests: the second and third
    tokens (the first verification's, through the tree) against their exact
    distribution. TV below 0.09 over 9 outcomes (sampling error alone about
    0.04; a later sibling tried whatever the first did, or tried against p
    instead of what is left of it, moves about 0.1). The tiny qwen3 over
    the tokenizer's first 2,048 tokens."""
    from conftest import write_tiny_qwen3
    from mlx_lm import load
    from test_draft_model import _stop
    from test_hybrid_caches import _exact_distribution

    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig
    from mlx_lm_server.spec_decode.engine import SpecDecodeEngine

    model, tokenizer = load(str(write_tiny_qwen3(tmp_path / "qwen3", smollm2_path, vocab=2048)))
    config = SpecDecodeConfig(mode="ngram", num_speculative_tokens=4, dynamic=False,
                              adaptive_k=False, calibration_seconds=0)
    s = make_scheduler(model, tokenizer, max_batch_size=32, max_queued_requests=1024,
                       engine=SpecDecodeEngine(model, config, TopTwoTree(model)))
    s.start()
    prompt = tokenizer.encode("one two three")
    n = 800
    try:
        # Three tokens: the prefill's, then the tree's verification (the
        # drafter ignores the room left: the engine cuts at the request's end).
        reqs = [GenerationRequest(prompt, 3, SamplingParams(temperature=1.5, top_k=3, seed=i))
                for i in range(n)]
        counts = {}
        for ids, _, _ in _run(s, reqs):
            counts[tuple(ids[1:3])] = counts.get(tuple(ids[1:3]), 0) + 1
        steps = s.spec_stats.steps
    finally:
        _stop(s)
    assert steps.tree_steps >= n // 32 and steps.tree_off_first > 0, steps
    exact = {}
    for seq, p in _exact_distribution(model, prompt, 3, 3, 1.5).items():
        exact[seq[1:]] = exact.get(seq[1:], 0.0) + p
    tv = 0.5 * sum(abs(counts.get(key, 0) / n - exact.get(key, 0.0))
                   for key in set(exact) | set(counts))
    assert tv < 0.09, (tv, counts, exact)
