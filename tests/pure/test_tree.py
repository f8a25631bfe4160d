"""Trees of drafts (``spec_decode/tree.py``): the layout, and the verdict
against brute force (every root path walked on its own) and against the
exact target distribution."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_server.kv.rows import tree_row_mask
from mlx_lm_server.spec_decode.drafts import PLACEHOLDER_TOKEN
from mlx_lm_server.spec_decode.tree import (
    chain_parents,
    is_chain,
    layout,
    pad_trees,
    sibling_ranks,
    tree_from_paths,
)
from mlx_lm_server.spec_decode.tree_verdict import greedy_tree_verify, tree_rejection_sample
from mlx_lm_server.spec_decode.verifier import greedy_verify

# root -> a(1), b(2); a -> c(3), d(4); c -> e(5); b -> f(6)
TOKENS = [10, 11, 12, 13, 14, 15]
PARENTS = [0, 0, 1, 1, 3, 2]


def test_layout_gives_depths_and_ancestors_of_a_tree():
    tree = layout(np.array([PARENTS]), [6])
    assert tree.depth[0].tolist() == [0, 1, 1, 2, 2, 3, 2]
    anc = tree.ancestors[0]
    assert np.flatnonzero(anc[5]).tolist() == [0, 1, 3, 5]  # e: root, a, c, itself
    assert np.flatnonzero(anc[6]).tolist() == [0, 2, 6]  # f never sees a, c, d, e
    assert not anc[4, 3]  # d does not see its sibling c
    assert tree.max_depth == 3


def test_layout_refuses_a_child_before_its_parent():
    with pytest.raises(ValueError, match="tree order"):
        layout(np.array([[0, 3, 1]]), [3])


def test_placeholders_past_a_rows_nodes_hang_off_the_root():
    tokens, parents, num = pad_trees([(TOKENS[:2], PARENTS[:2]), (TOKENS, PARENTS)], 6)
    assert num.tolist() == [2, 6]
    assert (tokens[0, 2:] == PLACEHOLDER_TOKEN).all()
    tree = layout(parents, num)
    assert tree.depth[0].tolist() == [0, 1, 1, 1, 1, 1, 1]


def test_paths_merge_into_a_trie_within_the_budget():
    tokens, parents = tree_from_paths([[5, 6, 7], [5, 6, 8], [5, 9], [4, 4]], budget=5)
    assert tokens == [5, 6, 7, 8, 9]
    assert parents == [0, 1, 2, 2, 1]
    tokens, parents = tree_from_paths([[1, 2, 3, 4]], budget=10)
    assert parents == [0, 1, 2, 3] and is_chain(np.array([parents]))


def test_a_kept_nodes_rank_counts_its_earlier_siblings():
    # node indices: a 0, b 1, c 2, d 3 (a's second child), e 4, f 5
    assert sibling_ranks(PARENTS, [0, 3]) == [0, 1]
    assert sibling_ranks(PARENTS, [0, 2, 4]) == [0, 0, 0]
    assert sibling_ranks(PARENTS, [1, 5]) == [1, 0]
    assert sibling_ranks([0, 0, 0, 3], [2, 3]) == [2, 0]  # the root's third child
    assert sibling_ranks([0, 1, 2, 3], [0, 1, 2, 3]) == [0, 0, 0, 0]  # a chain


def test_the_mask_shows_a_node_its_cache_its_ancestors_and_itself():
    tree = layout(np.array([PARENTS, list(range(6))]), [6, 6])
    ends, left = [4, 2], mx.array([1, 0])
    mask = np.array(tree_row_mask(ends, left, mx.array(tree.ancestors), 12))[:, 0]  # [B, 7, 12]
    # row 0, node e (input 5) at buffer 4 + 5: cache 1..3, then inputs 0, 1, 3, 5
    assert np.flatnonzero(mask[0, 5]).tolist() == [1, 2, 3, 4 + 0, 4 + 1, 4 + 3, 4 + 5]
    # row 1 is a chain: causal over its cache 0..1 and inputs 0..n
    for n in range(7):
        assert np.flatnonzero(mask[1, n]).tolist() == list(range(2 + n + 1))


def _walk(tokens, parents, num, choice):
    """Brute force: from the root, follow the child equal to the target's choice."""
    at, kept, path = 0, [], [0]
    while True:
        kids = [j for j in range(num) if parents[j] == at]
        nxt = [j for j in kids if tokens[j] == choice[at]]
        if not nxt:
            return kept + [int(choice[at])], path
        at = nxt[0] + 1
        kept.append(tokens[nxt[0]])
        path.append(at)


def _random_tree(rng, N, V):
    parents, tokens = [], []
    for j in range(N):
        p = int(rng.integers(0, j + 1))
        used = {tokens[i] for i in range(j) if parents[i] == p}
        free = [t for t in range(V) if t not in used]
        if not free:
            break
        parents.append(p)
        tokens.append(int(rng.choice(free)))
    return tokens, parents


def test_greedy_keeps_the_longest_path_of_target_choices_as_brute_force_does():
    rng = np.random.default_rng(0)
    V, N, B = 4, 9, 64
    trees = [_random_tree(rng, int(rng.integers(0, N + 1)), V) for _ in range(B)]
    tokens, parents, num = pad_trees(trees, N)
    tree = layout(parents, num)
    # Target choices biased toward the drafts so long paths occur.
    choice = rng.integers(0, V, size=(B, N + 1)).astype(np.int32)
    for b, (t, p) in enumerate(trees):
        for j in range(len(t)):
            if rng.random() < 0.6:
                choice[b, p[j]] = t[j]
    verdict = greedy_tree_verify(mx.array(choice), mx.array(tokens), mx.array(parents), tree)
    out = np.array(verdict.output)
    n = np.array(verdict.num_accepted)
    path = np.array(verdict.path)
    longest = 0
    for b, (t, p) in enumerate(trees):
        want, want_path = _walk(t, p, len(t), choice[b])
        assert n[b] == len(want) - 1
        assert out[b, : len(want)].tolist() == want
        assert (out[b, len(want):] == PLACEHOLDER_TOKEN).all()
        assert path[b, : len(want_path)].tolist() == want_path
        longest = max(longest, n[b])
    assert longest >= 3


def test_a_chain_is_verified_as_the_chain_verifier_does():
    rng = np.random.default_rng(1)
    B, K, V = 16, 6, 3
    draft = rng.integers(0, V, size=(B, K)).astype(np.int32)
    num = rng.integers(0, K + 1, size=B).astype(np.int32)
    draft[np.arange(K)[None] >= num[:, None]] = PLACEHOLDER_TOKEN
    target = rng.integers(0, V, size=(B, K + 1)).astype(np.int32)
    want_out, want_n = greedy_verify(mx.array(target), mx.array(draft), mx.array(num))
    parents = chain_parents(B, K)
    verdict = greedy_tree_verify(mx.array(target), mx.array(draft), mx.array(parents),
                                 layout(parents, num))
    assert np.array(verdict.num_accepted).tolist() == np.array(want_n).tolist()
    assert np.array(verdict.output).tolist() == np.array(want_out).tolist()
    n = np.array(verdict.num_accepted)
    for b in range(B):  # a chain's kept entries are its first n + 1: nothing moves
        assert np.array(verdict.path)[b, : n[b] + 1].tolist() == list(range(n[b] + 1))


def _probs(rng, rows, V):
    p = rng.dirichlet(np.ones(V) * 0.7, size=rows).astype(np.float32)
    return p


def test_sampling_a_tree_gives_the_target_distribution_exactly():
    """Draws of (first token, second token) through one tree, compared with
    p(x1) * p(x2 | x1) where the tree holds x1 (else one token leaves)."""
    V = 5
    rng = np.random.default_rng(2)
    # root -> 0, 1, 2 (ranks); node 0 -> 3, 4; node 1 -> 0
    tokens = [0, 1, 2, 3, 4, 0]
    parents = [0, 0, 0, 1, 1, 2]
    P = _probs(rng, 7, V)  # p at every input position
    B = 200_000
    tree = layout(np.array([parents] * B), [6] * B)
    mx.random.seed(3)
    verdict = tree_rejection_sample(
        mx.broadcast_to(mx.array(P)[None], (B, 7, V)), mx.array([tokens] * B),
        mx.array([parents] * B), tree, mx.random.uniform(shape=(B, 6)),
        mx.random.gumbel(shape=(B, V)))
    out = np.array(verdict.output)
    n = np.array(verdict.num_accepted)
    node_of_first = {0: 1, 1: 2, 2: 3}  # root child token -> its input position
    observed = np.zeros((V, V + 1))
    for x1, x2, k in zip(out[:, 0], out[:, 1], n):
        observed[x1, x2 if k >= 1 else V] += 1
    expected = np.zeros((V, V + 1))
    for x1 in range(V):
        if x1 in node_of_first:
            expected[x1, :V] = P[0, x1] * P[node_of_first[x1]]
        else:
            expected[x1, V] = P[0, x1]
    observed /= B
    # Total variation over 30 cells; 200k draws put the noise near 0.005.
    assert 0.5 * np.abs(observed - expected).sum() < 0.012
    assert n.max() == 2  # the tree's depth-2 nodes were reached


def test_a_sampled_tree_keeps_only_root_paths_and_its_verdicts_agree():
    rng = np.random.default_rng(4)
    V, N, B = 6, 8, 256
    trees = [_random_tree(rng, N, V) for _ in range(B)]
    tokens, parents, num = pad_trees(trees, N)
    tree = layout(parents, num)
    P = mx.array(rng.dirichlet(np.ones(V) * 0.3, size=(B, N + 1)).astype(np.float32))
    mx.random.seed(5)
    verdict = tree_rejection_sample(P, mx.array(tokens), mx.array(parents), tree,
                                    mx.random.uniform(shape=(B, N)),
                                    mx.random.gumbel(shape=(B, V)))
    out, n, path = (np.array(a) for a in (verdict.output, verdict.num_accepted, verdict.path))
    for b in range(B):
        at = 0
        for d in range(n[b]):  # each kept token is the child at the path's next position
            j = path[b, d + 1] - 1
            assert parents[b, j] == at and tokens[b, j] == out[b, d]
            at = j + 1
        kids = [tokens[b, j] for j in range(num[b]) if parents[b, j] == at]
        assert out[b, n[b]] not in kids  # every child of the last node was rejected


def test_a_sibling_is_tried_only_when_every_earlier_one_was_rejected():
    """Root children a, b (ranks 1, 2); b has a child. With both tests passing
    on their own numbers, a was kept first: b and its subtree never count."""
    V = 4
    tokens, parents = [0, 1, 2], [0, 0, 2]
    P = np.full((1, 4, V), 0.25, np.float32)
    tree = layout(np.array([parents]), [3])
    verdict = tree_rejection_sample(mx.array(P), mx.array([tokens]), mx.array([parents]), tree,
                                    mx.array([[0.1, 0.1, 0.1]]), mx.zeros((1, V)))
    assert np.array(verdict.num_accepted).tolist() == [1]
    assert np.array(verdict.output)[0, 0] == 0
    assert np.array(verdict.path)[0, :2].tolist() == [0, 1]


def test_best_first_spends_the_budget_where_the_paths_agree():
    from mlx_lm_server.spec_decode.tree import best_first

    # One path: a chain, cut at the budget.
    assert best_first([[1, 2, 3, 4]], [1.0], 3) == ([1, 2, 3], [0, 1, 2])
    # Three paths agree on [1, 2], two of them continue with 3: depth there.
    tokens, parents = best_first([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]], [1, 1, 1], 5,
                                 decay=1.0)
    assert tokens == [1, 2, 3, 4, 5] and parents == [0, 1, 2, 3, 3]  # 9, 4, 5 tie: path order
    # Without decay a heavier path is taken whole before a lighter one.
    tokens, _ = best_first([[1, 2, 3], [7, 8]], [3, 1], 4, decay=1.0)
    assert tokens == [1, 7, 2, 3]  # tree order: depth 1 (by score), then deeper
    # Every node's parent comes before it, whatever the budget.
    rng = np.random.default_rng(6)
    paths = [list(rng.integers(0, 3, size=6)) for _ in range(8)]
    for budget in range(1, 20):
        tokens, parents = best_first(paths, list(rng.random(8)), budget)
        assert len(tokens) <= budget
        layout(np.array([parents]), [len(parents)])  # raises if out of order


def test_a_row_that_cannot_branch_drafts_its_trees_first_path():
    from mlx_lm_server.spec_decode.tree import as_chains, first_path

    assert first_path(TOKENS, PARENTS) == [10, 12, 14]  # a, c, e
    tokens, parents, num = pad_trees([(TOKENS, PARENTS), (TOKENS, PARENTS)], 7)
    t, n, p = as_chains(tokens, parents, num, [1])
    assert n == [6, 3] and t[1, :3].tolist() == [10, 12, 14] and p is not None
    assert (t[0] == tokens[0]).all()
    t, n, p = as_chains(tokens, parents, num, [0, 1])
    assert p is None and n == [3, 3]


# Each node's chance that its whole path is kept (a child's never above its parent's).
CHANCES = [0.9, 0.3, 0.6, 0.2, 0.5, 0.25]


def test_a_tree_cut_to_its_likeliest_nodes_stays_a_tree():
    from mlx_lm_server.spec_decode.tree import cut_trees

    tokens, parents, num = pad_trees([(TOKENS, PARENTS), (TOKENS[:2], PARENTS[:2])], 6)
    chances = np.array([CHANCES, CHANCES[:2] + [0] * 4], np.float32)
    t, n, p = cut_trees(tokens, parents, chances, num, 3)
    # a (0.9), c (0.6), e (0.5): one path; the second row has only two nodes
    assert n == [3, 2] and t[0, :3].tolist() == [10, 12, 14] and p[0, :3].tolist() == [0, 1, 2]
    assert (t[0, 3:] == PLACEHOLDER_TOKEN).all() and (t[1] == tokens[1]).all()
    t, n, p = cut_trees(tokens, parents, chances, num, 5)  # a, b, c, e, f: d (0.2) goes
    assert t[0, :5].tolist() == [10, 11, 12, 14, 15] and p[0, :5].tolist() == [0, 0, 1, 3, 2]
    layout(p[:1, :5], [5])  # every parent before its child


def test_the_pass_is_sized_by_what_its_nodes_are_expected_to_emit_a_second():
    from mlx_lm_server.spec_decode.tree import expected_tokens
    from mlx_lm_server.spec_decode.tree_step import priced_nodes

    chances = np.array([CHANCES, [0.95, 0.9, 0, 0, 0, 0]], np.float32)
    expected = expected_tokens(chances, [6, 2])
    assert expected[0] == pytest.approx(2 + 0.9 + 0.95)
    assert expected[2] == pytest.approx(2 + 0.9 + 0.6 + 0.5 + 0.95 + 0.9)
    assert expected[5] == pytest.approx(2 + sum(CHANCES) + 0.95 + 0.9)
    # A GPU: a pass over 7 tokens costs about what one does, every node pays.
    assert priced_nodes(chances, [6, 2], lambda n: 1.0 + 0.01 * n) == 6
    # A CPU: each node costs a fifth of a step; past the likeliest they do not pay.
    rates = [(expected[n - 1] / (1.0 + 0.2 * n), n) for n in range(1, 7)]
    assert priced_nodes(chances, [6, 2], lambda n: 1.0 + 0.2 * n) == max(rates)[1] < 6
    assert priced_nodes(chances, [6, 2], lambda n: None) is None  # no price yet


def test_trees_or_chains_go_to_whichever_emitted_more_a_second():
    from mlx_lm_server.spec_decode.tree_step import TreeChoice

    def blocks(choice, rates, n):
        """``n`` blocks of steps whose tokens a second depend on the width."""
        seen = []
        for _ in range(n):
            seen.append(choice.width)
            for _ in range(TreeChoice.BLOCK):
                choice.observe(rates[choice.width], 1.0)
        return seen

    # Trees first, then chains, then the better, the other once every EXPLORE_EVERY blocks.
    seen = blocks(TreeChoice(4, fixed=False), {4: 3.0, 1: 2.0}, 17)
    assert seen[:2] == [4, 1]
    assert seen.count(1) == 3 and seen[8] == 1 and seen[16] == 1, seen
    seen = blocks(TreeChoice(4, fixed=False), {4: 2.0, 1: 3.0}, 17)
    assert seen[:2] == [4, 1] and seen.count(4) == 3, seen
    # Traffic changes: chains win at first, then trees do; the exploring block sees it.
    choice = TreeChoice(4, fixed=False)
    blocks(choice, {4: 2.0, 1: 3.0}, 9)
    assert blocks(choice, {4: 5.0, 1: 3.0}, 10)[-1] == 4
    # Fixed speculation drafts the configured width every step; width 1 is chains.
    assert set(blocks(TreeChoice(4, fixed=True), {4: 1.0, 1: 9.0}, 4)) == {4}
    assert set(blocks(TreeChoice(1, fixed=False), {1: 1.0}, 4)) == {1}


# Row 1: the root's children 10 and 10; row 2: 13 twice under node a.
REPEATED = [(TOKENS, PARENTS), ([10, 10, 12], [0, 0, 1]), ([10, 13, 13, 13], [0, 1, 1, 0])]


def test_siblings_that_repeat_a_token_are_found():
    from mlx_lm_server.spec_decode.tree import repeated_siblings

    tokens, parents, num = pad_trees(REPEATED, 6)
    assert repeated_siblings(tokens, parents, num) == [1, 2]
    assert repeated_siblings(tokens[:1], parents[:1], num[:1]) == []
    # The same token under two parents (cousins), and placeholders, are fine.
    assert repeated_siblings(*pad_trees([([10, 11, 13, 13], [0, 0, 1, 2])], 6)) == []


def test_a_tree_whose_siblings_repeat_a_token_never_reaches_a_pass():
    """The verdict takes a node's children for distinct tokens (every
    proposer dedupes them; greedy finds the kept path again from its
    tokens): a proposal that repeats one is refused where the step shapes
    its trees, before any pass."""
    from types import SimpleNamespace

    from mlx_lm_server.spec_decode.drafts import ProposalResult
    from mlx_lm_server.spec_decode.tree_step import shape_trees

    proposal = ProposalResult.from_trees(REPEATED, 6)
    batch = SimpleNamespace(prompt_cache=[], model=None)  # refused before either is read
    rows = [SimpleNamespace(processors=[], constraint=None)] * 3
    with pytest.raises(AssertionError, match=r"rows \[1, 2\] draft one token twice"):
        shape_trees(batch, rows, proposal, "lossless")


def test_chains_asked_for_a_tree_budget_are_cut_to_their_k():
    from mlx_lm_server.spec_decode.tree_step import cut_chains

    tokens = np.array([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]], np.int32)
    parents = np.array([[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]], np.int32)  # a chain, then a tree
    out, num = cut_chains(tokens, [5, 5], parents, [2, 2])
    assert num == [2, 5] and out[0].tolist() == [5, 6, -1, -1, -1] and out[1].tolist() == [5, 6, 7, 8, 9]
    out, num = cut_chains(tokens, [5, 1], None, [3, 3])  # every row a chain
    assert num == [3, 1] and out[0].tolist() == [5, 6, 7, -1, -1]


def test_a_merged_rows_unmeasured_tree_is_neither_priced_nor_cut(monkeypatch):
    """Row 0 a measured tree, row 1 drafted by a source that measures
    nothing (NaN chances, a merged proposal): pricing cuts row 0 only."""
    from types import SimpleNamespace

    from mlx_lm_server.spec_decode.drafts import ProposalResult
    from mlx_lm_server.spec_decode.tree_step import shape_trees

    proposal = ProposalResult.from_trees(
        [([5, 6, 7, 8], [0, 0, 1, 2], [0.9, 0.1, 0.05, 0.01]), ([5, 6, 7, 8], [0, 1, 2, 3])], 4)
    proposal.chances[1] = np.nan
    batch = SimpleNamespace(prompt_cache=[], model=None)
    rows = [SimpleNamespace(processors=[], constraint=None)] * 2

    def cost(n):  # a node past the first costs a whole step: one node pays
        return 1.0 + (n - 1)

    # Both rows may branch: pricing alone decides.
    monkeypatch.setattr("mlx_lm_server.spec_decode.tree_step.chain_rows", lambda *a: [])
    tokens, num, parents = shape_trees(batch, rows, proposal, "auto", cost)
    assert num == [1, 4]
    assert tokens[1].tolist() == [5, 6, 7, 8] and tokens[0].tolist()[:1] == [5]
