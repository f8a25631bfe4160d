"""Tree nodes scored by the rate at which nodes like them were kept
(``proposer/node_scores.py``): what a greedy verification tried, counted
from the context alone, and trees that follow the measured rates."""

import mlx.core as mx
import numpy as np

from mlx_lm_server.spec_decode.drafts import Context
from mlx_lm_server.spec_decode.proposer.draft_tree import Tree, choose, expand
from mlx_lm_server.spec_decode.proposer.node_scores import (
    BINS,
    EDGES,
    RANKS,
    KeptRates,
    cells,
    walk,
)

# root -> a(10), b(11); a -> c(12), d(13); c -> e(14); b -> f(15)
TOKENS = [10, 11, 12, 13, 14, 15]
PARENTS = [0, 0, 1, 1, 3, 2]  # input positions: node j sits at j + 1
CELLS = [100, 101, 102, 103, 104, 105]


def test_walk_tries_the_children_of_every_kept_node_and_stops_where_none_matches():
    assert walk(TOKENS, PARENTS, CELLS, [10, 13, 99]) == [
        (100, True), (101, False), (102, False), (103, True)]  # d has no children
    assert walk(TOKENS, PARENTS, CELLS, [11, 15, 7]) == [(100, False), (101, True), (105, True)]
    assert walk(TOKENS, PARENTS, CELLS, [12, 10]) == [(100, False), (101, False)]
    assert walk(TOKENS, PARENTS, CELLS, [10]) == [(100, True), (101, False)]  # untried below


def test_a_childs_cell_is_its_depth_its_rank_and_its_probability_bin():
    lp = mx.log(mx.array([[0.93, 0.05, 0.005]]))
    bins = [EDGES.index(0.85), EDGES.index(0.05), 0]
    assert cells(lp, 1).tolist() == [[bins[0], BINS + bins[1], 2 * BINS]]
    assert cells(lp, 2).tolist() == [[RANKS * BINS + b + r * BINS for r, b in enumerate(bins)]]
    deepest = 3 * RANKS * BINS  # depths past the table's share its last
    assert cells(mx.log(mx.array([1.0, 0.9995, 0.995])), 9).tolist() == [
        deepest + BINS - 1, deepest + BINS + BINS - 1, deepest + 2 * BINS + BINS - 2]


def test_a_rows_tree_is_counted_once_its_context_has_grown():
    rates = KeptRates()
    history = [1, 2, 3, 4]
    rates.drafted(7, len(history) + 1, Tree(TOKENS, PARENTS, [], [0, BINS, 1, 2, 3, 4]))
    rates.settle([7], [Context(history, 5)])  # not verified yet: nothing to count
    assert rates.tried.sum() == 0
    before = rates.log_rates()
    rates.settle([7], [Context(history + [5, 10, 13], 99)])
    assert rates.tried.sum() == 4 and rates.kept.sum() == 2
    assert rates.kept[0] == 1 and rates.tried[BINS] == 1 and rates.kept[BINS] == 0
    after = rates.log_rates()
    assert after[0].item() > before[0].item() and after[BINS].item() < before[BINS].item()
    rates.settle([7], [Context(history + [5, 10, 13, 4], 99)])  # counted once
    assert rates.tried.sum() == 4


def _fixed_drafter(probs):
    """A drafter whose distribution is ``probs`` over tokens 0..n-1 at every node."""
    logits = mx.log(mx.array(probs))

    def to_logits(states):
        return mx.broadcast_to(logits, states.shape[:-1] + (len(probs),))

    def feed(tokens, parent_states, ancestors, d):
        return parent_states

    return to_logits, feed


def test_trees_follow_the_measured_rates_not_the_drafters_probabilities():
    """A drafter that says 0.6 / 0.3 / 0.1 at every node, and a target that
    keeps its second guess 90% of the time and its first 10%: once counted,
    the tree's budget goes down the second guesses."""
    to_logits, feed = _fixed_drafter([0.6, 0.3, 0.1])
    states = mx.zeros((1, 4))

    def tree(rates):
        candidates = [np.array(a)[0] for a in expand(states, to_logits, feed, 2, 3, rates)]
        tokens, scores, _, parents, _ = candidates
        return choose(tokens, scores, parents, 3)[:2]

    rates = KeptRates()
    assert tree(rates.log_rates()) == ([0, 1, 0], [0, 0, 1])  # the first guesses first
    first, second = cells(mx.log(mx.array([0.6, 0.3])), 1).tolist()
    for depth in range(3):
        offset = depth * RANKS * BINS
        rates.count([offset + first] * 100 + [offset + second] * 100,
                    [n < 10 for n in range(100)] + [n < 90 for n in range(100)])
    assert tree(rates.log_rates()) == ([1, 1, 1], [0, 1, 2])  # second guesses, three deep
    assert tree(None) == ([0, 1, 0], [0, 0, 1])  # the drafter's own word


def test_a_deep_cell_without_counts_borrows_its_ranks_and_bins_rate_from_other_depths():
    rates = KeptRates()
    shallow = cells(mx.log(mx.array([0.4])), 1).item()  # depth 1, rank 0, the bin of 0.4
    deep = shallow + 3 * RANKS * BINS  # depth 4, the same rank and bin
    assert np.exp(rates.log_rates()[deep].item()) == np.exp(rates.log_rates()[shallow].item())
    rates.count([shallow] * 50, [n < 45 for n in range(50)])  # kept 90%, not 40%
    assert np.exp(rates.log_rates()[deep].item()) > 0.8
    assert np.exp(rates.log_rates()[deep + BINS].item()) < 0.5  # rank 1: nothing counted
