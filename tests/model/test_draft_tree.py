"""A learned head's tree of drafts (``proposer/draft_tree.py``).

Every candidate the batched expansion scores must score what the head
gives its root path fed alone, as a chain into a plain cache: that pins
the tree's mask over the head's cache (a node sees its ancestors, never a
sibling or a cousin), each node's position (its depth, not its place in
the cache) and the parent state each node is fed with. Through the engine,
greedy output with the head's trees is the plain model's, and the target
keeps drafts that were not the head's first guess.
"""

import mlx.core as mx
import numpy as np
import pytest
from test_draft_model import _stop
from test_mtp_proposer import GREEDY, TEXTS, _greedy, _scheduler, copy_model, copy_path  # noqa: F401
from test_spec_engine import _run
from tiny_models import build

from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode.drafts import Context
from mlx_lm_server.spec_decode.heads.mtp import load_mtp_head
from mlx_lm_server.spec_decode.proposer.draft_tree import Tree, choose, expand, grown_depth
from mlx_lm_server.spec_decode.proposer.head import HeadProposer


def test_the_budget_keeps_the_likeliest_nodes_in_tree_order():
    # candidates: 0 (-0.1) and 1 (-1.0) off the root; 2 (-0.3), 3 (-2.0) under 0;
    # 4 (-1.2) under 1; 5 (-0.3, as likely as its parent) under 2.
    tokens = np.array([10, 11, 12, 13, 14, 15])
    scores = np.array([-0.1, -1.0, -0.3, -2.0, -1.2, -0.3])
    parents = np.array([-1, -1, 0, 0, 1, 2])
    assert choose(tokens, scores, parents, 4) == ([10, 11, 12, 15], [0, 0, 1, 3], [0, 1, 2, 5])
    assert choose(tokens, scores, parents, 1) == ([10], [0], [0])
    # Siblings likeliest first, whatever order they were found in.
    assert choose(tokens, np.array([-1.0, -0.5, -2, -2, -2, -2]), parents, 2) == \
        ([11, 10], [0, 0], [1, 0])


@pytest.fixture(scope="module")
def random_head(tmp_path_factory, smollm2_path):
    """A random qwen3_5 target and MTP layer: the head reads its hidden-state
    input (a copy head ignores it)."""
    from mlx_lm import load

    path = build("qwen3_5_mtp", tmp_path_factory.mktemp("tree-head"), smollm2_path,
                 scale=2.0, seed=5)
    model, tokenizer = load(str(path))
    return model, tokenizer, load_mtp_head(model, str(path))


def _features(model, tokens):
    return mlx_lm_adapter.text_model(model).model(mx.array([tokens]))


def _random_rates(seed):
    """A kept-rate table far from any drafter's probabilities."""
    from mlx_lm_server.spec_decode.proposer.node_scores import BINS, DEPTHS, RANKS

    rng = np.random.default_rng(seed)
    return mx.array(np.log(rng.uniform(0.05, 0.95, DEPTHS * RANKS * BINS)).astype(np.float32))


def _log_softmax(logits):
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _path(parents, c):
    path = []
    while c >= 0:
        path.append(c)
        c = int(parents[c])
    return path[::-1]


@pytest.mark.parametrize("width,depth", [(2, 4), (3, 3)])
def test_every_candidate_scores_its_root_path_fed_alone(random_head, width, depth):
    model, tokenizer, head = random_head
    embed = mlx_lm_adapter.token_embedding(model)
    project = head.projection(mlx_lm_adapter.output_projection(model))
    proposer = HeadProposer(head, embed, project, tree_width=width)
    prompts = [tokenizer.encode(t) for t in TEXTS[:3]]  # ragged: different lengths
    contexts = []
    for uid, p in enumerate(prompts):
        proposer.add_sequence(uid, len(p), GREEDY)
        proposer.observe_target([uid], _features(model, p[:-1]), [len(p) - 1])
        contexts.append(Context(p[:-1], p[-1]))
    states = proposer._feed(list(range(3)), contexts, [0, 1, 2])
    rates = _random_rates(width)
    tokens, scores, logprobs, parents, found = (np.array(a) for a in expand(
        states, project, proposer._feed_depth, width, depth, rates))
    assert proposer.chained == width * (depth - 1)
    for row, p in enumerate(prompts):
        # The row alone: its pairs into a plain cache, then each path as a chain.
        cache = head.make_cache()
        start = head(embed(mx.array([p[1:]])), _features(model, p[:-1]), cache)[:, -1]
        base = cache[0].offset
        for c in range(tokens.shape[1]):
            for layer in cache:
                layer.trim(layer.offset - base)
            state, score = start, 0.0
            for node in _path(parents[row], c):
                score += rates[int(found[row, node])].item()
                if node != c:
                    state = head(embed(mx.array([[int(tokens[row, node])]])), state[:, None],
                                 cache)[:, 0]
            own = _log_softmax(project(state))[0, int(tokens[row, c])].item()
            assert own == pytest.approx(float(logprobs[row, c]), abs=2e-3), (row, c)
            assert score == pytest.approx(float(scores[row, c]), abs=1e-4), (row, c)


def test_a_budget_above_k_grows_trees_as_deep_as_k_and_enough_to_fill_it():
    assert grown_depth(8, 3, None) == 8  # no budget: as deep as the nodes
    assert grown_depth(12, 3, 4) == 4  # 3 + 3 * 9 candidates fill 12 nodes
    assert grown_depth(32, 3, 2) == 5  # 2 deep offers 12 candidates: 5 deep, 39
    assert grown_depth(4, 3, 6) == 4  # never deeper than the nodes
    assert grown_depth(2, 3, 1) == 1


@pytest.mark.parametrize("budget", [None, 12])
def test_greedy_output_with_the_heads_trees_is_the_targets(copy_model, copy_path,  # noqa: F811
                                                           monkeypatch, budget):
    """Rows join while others draft trees: every token is the plain model's,
    and some kept drafts were a node's second or later child. A budget of
    12 nodes over k=4 spends them on siblings: trees 4 deep, not 12."""
    from mlx_lm_server.spec_decode.proposer import head

    depths, real = [], head.expand
    monkeypatch.setattr(head, "expand", lambda *a: depths.append(a[4]) or real(*a))
    model, tokenizer = copy_model
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    plain, _ = _greedy(model, tokenizer, copy_path, "none", prompts, 0.1)
    s = _scheduler(model, tokenizer, copy_path, "mtp", k=4, tree_width=3, tree_budget=budget)
    try:
        reqs = [GenerationRequest(p, 40 + 5 * (i % 3), GREEDY) for i, p in enumerate(prompts)]
        assert [ids for ids, _, _ in _run(s, reqs, 0.1)] == plain
        steps = s.spec_stats.steps
        assert s.spec_stats.snapshot()["totals"]["fault_steps"] == 0
    finally:
        _stop(s)
    assert steps.tree_steps > 0 and steps.tree_off_first > 0, (steps.tree_steps,
                                                                steps.tree_accepted)
    assert max(depths) == 4, depths
    if budget:
        assert steps.tree_nodes > 4 * steps.tree_rows  # nodes past k


def test_trees_cut_to_what_the_pass_pays_for_keep_the_targets_output(copy_model, copy_path,  # noqa: F811
                                                                      monkeypatch):
    """With k adaptive the head's trees are cut, step by step, to the nodes
    whose chance of being kept pays for their share of the pass
    (``tree_step.priced_nodes``): unlikely siblings go, and every token is
    still the plain model's."""
    from mlx_lm_server.spec_decode import tree_step

    cut, real = [], tree_step.cut_trees
    monkeypatch.setattr(tree_step, "cut_trees", lambda *a: cut.append(a[-1]) or real(*a))
    model, tokenizer = copy_model
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    plain, _ = _greedy(model, tokenizer, copy_path, "none", prompts, 0.1)
    s = _scheduler(model, tokenizer, copy_path, "mtp", k=8, tree_width=3, adaptive_k=True)
    try:
        reqs = [GenerationRequest(p, 40 + 5 * (i % 3), GREEDY) for i, p in enumerate(prompts)]
        assert [ids for ids, _, _ in _run(s, reqs, 0.1)] == plain
        steps = s.spec_stats.steps
    finally:
        _stop(s)
    assert steps.tree_steps > 0 and cut, (steps.tree_steps, len(cut))
    assert steps.tree_nodes < 8 * steps.tree_rows


def test_every_draft_model_candidate_scores_its_root_path_fed_alone(smollm2, monkeypatch):
    """SpecExec's side: the draft model's tree, grown over its own ragged
    cache, scores each candidate as the model fed the context and the
    candidate's root path in one whole-sequence pass."""
    from mlx_lm_server.spec_decode.proposer import draft_model

    model, tokenizer = smollm2
    grown = []
    monkeypatch.setattr(draft_model, "trees", lambda candidates, budgets: grown.append(
        candidates) or [Tree([], [], [], [])] * len(budgets))
    proposer = draft_model.DraftModelProposer(model, tree_width=3)
    prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
    for uid, p in enumerate(prompts):
        proposer.add_sequence(uid, len(p), GREEDY)
    proposer.propose([0, 1, 2], [Context(p[:-1], p[-1]) for p in prompts], [5, 5, 5])
    tokens, _, logprobs, parents, _ = (np.array(a) for a in grown[0])
    for row, p in enumerate(prompts):
        # Every candidate's context and path, right-padded, in one causal pass.
        paths = [[int(tokens[row, n]) for n in _path(parents[row], c)]
                 for c in range(tokens.shape[1])]
        width = len(p) + max(map(len, paths))
        lp = _log_softmax(model(mx.array([(p + path + [0] * width)[:width] for path in paths])))
        for c, path in enumerate(paths):
            own = lp[c, len(p) + len(path) - 2, path[-1]].item()
            assert own == pytest.approx(float(logprobs[row, c]), abs=2e-3), (row, c)
    # Every node leaves the draft's cache at the verification; the kept come back as lag.
    ends = list(proposer.cache[0].ends)
    proposer.observe_verification([0, 1, 2], [1, 0, 2])
    assert proposer.cache[0].ends == [e - 3 * 4 for e in ends]
    assert [proposer.fed[u] for u in range(3)] == [len(p) for p in prompts]


@pytest.mark.parametrize("bits", [None, pytest.param(4, marks=pytest.mark.slow)])
def test_greedy_output_with_the_draft_models_trees_is_the_targets(smollm2, smollm2_path, bits):
    """SmolLM2 drafted for by itself (or its 4-bit copy: slow on a CPU), in
    trees: the output is plain decoding's (up to float near-ties of the
    batched passes); with the 4-bit draft some kept drafts were a node's
    second or later child."""
    from test_draft_model import _scheduler as draft_scheduler
    from test_spec_engine import _assert_same_or_near_tie

    model, tokenizer = smollm2
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    reqs = [GenerationRequest(p, 24 + 4 * (i % 3), GREEDY) for i, p in enumerate(prompts)]
    plain = _scheduler(model, tokenizer, smollm2_path, "none")
    trees = draft_scheduler(model, tokenizer, smollm2_path, smollm2_path,
                            num_speculative_tokens=6, dynamic=False, adaptive_k=False,
                            tree_width=3, draft_model_quantize=bits)
    try:
        base, ours = _run(plain, reqs, 0.1), _run(trees, reqs, 0.1)
        for p, (a, _, _), (b, _, _) in zip(prompts, base, ours):
            _assert_same_or_near_tie(model, p, a, b)
        steps = trees.spec_stats.steps
        assert trees.spec_stats.snapshot()["totals"]["fault_steps"] == 0
    finally:
        _stop(plain, trees)
    assert steps.tree_steps > 0 and steps.tree_accepted > 0
    if bits:
        assert steps.tree_off_first > 0, (steps.tree_steps, steps.tree_accepted)
