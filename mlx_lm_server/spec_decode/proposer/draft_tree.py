"""A drafter's tree of drafts: best-first expansion for the whole batch at once.

A chain feeds each row's likeliest draft back to the drafter and guesses on
from it alone; whatever the drafter thought second likeliest is lost. A
tree keeps it (EAGLE-2 for a learned head, SpecExec for a draft model). At
each depth the ``width`` best nodes of the row's tree so far are fed to the
drafter together, each attending to the row's context and to its own
ancestors only (``kv/rows.tree_row_mask``, the earlier depths already in
the drafter's cache) at its own depth's position (the adapter's
``node_positions``), and each gives its ``width`` likeliest children. The
row's tree is then the ``budget`` best of all those nodes (EAGLE-2's
re-ranking). "Best" is the chance the node's whole path is kept: the
product of the kept rates measured for nodes like each on it
(``node_scores.py``), or without a table the drafter's own probabilities
(EAGLE-2's scores). A child never scores above its parent, so every chosen
node's parent is chosen.

The drafter runs as many times as for a chain of the same depth, ``width``
tokens a row each time. Everything stays on the device until the end: one
transfer of ``[R, width + (depth - 1) width^2]`` candidates a proposal,
whatever the vocabulary; the host orders each row's chosen nodes (tens)
into tree order. Only greedy batches grow trees: a sampled row's chain
carries its q to the rejection sampler, which keeps more than one-hot
siblings would. Only a drafter whose every layer takes a node's depth as
its position grows them (``grows_trees``); another drafts chains.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np

from ...kv import hold_trees, set_tree
from ...runtime import mlx_lm_adapter
from .node_scores import cells

log = logging.getLogger("mlx_lm_server.spec_decode")

# (id, whose) -> model: the refusals said so far
_REFUSED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def holds_positions(model, whose: str) -> bool:
    """Whether a tree pass over ``model`` places each node at its depth (the
    adapter's ``node_positions_refused``). Where it cannot, trees are off
    for ``whose`` (the target, the drafter): said once, in one line, and its
    rows draft chains."""
    reason = mlx_lm_adapter.node_positions_refused(model)
    if reason is not None and _REFUSED.get((id(model), whose)) is not model:
        _REFUSED[(id(model), whose)] = model
        log.warning("trees of drafts off for %s (%s); its rows draft chains", whose, reason)
    return reason is None


def grows_trees(drafter, cache: list) -> bool:
    """Whether ``drafter`` can grow a tree over ``cache``: every layer holds
    one (``hold_trees``) and places each node at its depth."""
    return hold_trees(cache) and holds_positions(drafter, "the drafter")


def top_children(logprobs: mx.array, width: int) -> tuple[mx.array, mx.array]:
    """The ``width`` likeliest tokens of ``[..., V]`` log-probabilities and
    theirs, likeliest first."""
    idx = mx.argpartition(-logprobs, kth=width - 1, axis=-1)[..., :width]
    lp = mx.take_along_axis(logprobs, idx, axis=-1)
    order = mx.argsort(-lp, axis=-1)
    return mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(lp, order, axis=-1)


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _scored(log_rates: Optional[mx.array], logprobs: mx.array, depth: int):
    """Children's scores (what each adds to its path's) and table cells."""
    cell = cells(logprobs, depth)
    return (logprobs if log_rates is None else log_rates[cell]), cell


def expand(states: mx.array, to_logits: Callable, feed: Callable, width: int,
           depth: int, log_rates: Optional[mx.array] = None) -> tuple:
    """Grow every row's tree ``depth`` deep from the head's last states
    ``[R, H]``. ``feed(tokens [R, w], parent_states [R, w, H], ancestors
    [R, w, M], depth)`` runs the head over one depth's nodes (``ancestors``:
    over every node fed so far, these included) and gives their states.
    ``log_rates``: ``KeptRates.log_rates()`` (None: the drafter's own
    log-probabilities score the nodes).

    Returns the candidates ``[R, C]``: tokens, scores (the path's summed
    log rates), the drafter's log-probability of each, parents (an index
    among the candidates, ``-1``: the root, every parent before its
    children) and table cells."""
    R = states.shape[0]
    tok, lp = top_children(_log_softmax(to_logits(states)), width)  # [R, w]
    score, cell = _scored(log_rates, lp, 1)
    tokens, scores, logprobs, found = [tok], [score], [lp], [cell]
    parents = [mx.full((R, width), -1, mx.int32)]
    frontier = mx.broadcast_to(mx.arange(width, dtype=mx.int32), (R, width))
    parent_states = mx.broadcast_to(states[:, None], (R, width, states.shape[-1]))
    ancestors = mx.broadcast_to(mx.eye(width, dtype=mx.bool_), (R, width, width))
    count = width
    for d in range(1, depth):
        fed = feed(tok, parent_states, ancestors, d)  # [R, w, H]
        child_tok, child_lp = top_children(_log_softmax(to_logits(fed)), width)  # [R, w, w]
        child_score, child_cell = _scored(log_rates, child_lp, d + 1)
        child_tok = child_tok.reshape(R, width * width)
        child_score = (score[..., None] + child_score).reshape(R, width * width)
        tokens.append(child_tok)
        scores.append(child_score)
        logprobs.append(child_lp.reshape(R, width * width))
        found.append(child_cell.reshape(R, width * width))
        parents.append(mx.repeat(frontier, width, axis=1))
        if d == depth - 1:
            break
        pick = mx.argsort(-child_score, axis=1)[:, :width].astype(mx.int32)  # [R, w]
        slot = pick // width  # the parent's place in this depth's frontier
        tok = mx.take_along_axis(child_tok, pick, axis=1)
        score = mx.take_along_axis(child_score, pick, axis=1)
        frontier = count + pick
        count += width * width
        parent_states = mx.take_along_axis(fed, slot[..., None], axis=1)
        their = mx.take_along_axis(ancestors, slot[..., None], axis=1)  # [R, w, M]
        ancestors = mx.concatenate(
            [their, mx.broadcast_to(mx.eye(width, dtype=mx.bool_), (R, width, width))], axis=2)
    return tuple(mx.concatenate(a, axis=1) for a in (tokens, scores, logprobs, parents, found))


def grown_depth(nodes: int, width: int, depth: Optional[int]) -> int:
    """How deep to grow a tree of ``nodes`` nodes: as deep as the node count,
    or, given the controller's chain length ``depth`` (a node budget above
    it), that deep: each depth is a drafter pass, and nodes past what the
    chain reaches are rarely kept; but deep enough that the candidates
    (``width + (d - 1) width^2``) fill the budget."""
    if depth is None or depth >= nodes:
        return nodes
    filled = 1 + max(0, -(-(nodes - width) // (width * width)))
    return min(nodes, max(depth, filled))


def choose(tokens: np.ndarray, scores: np.ndarray, parents: np.ndarray,
           budget: int) -> tuple[list, list, list]:
    """One row's tree: its ``budget`` best candidates as ``(tokens,
    parents, candidates)`` in tree order (parents as input positions, 0 the
    root; candidates: each node's index among ``tokens``), siblings best
    first. Ties go to the earlier candidate, so a parent (always earlier)
    outranks a child that scores as well."""
    order = sorted(range(len(tokens)), key=lambda c: (-scores[c], c))[:budget]
    depth = {-1: 0}
    for c in sorted(order):
        depth[c] = depth[int(parents[c])] + 1
    chosen = sorted(order, key=lambda c: (depth[c], -scores[c], c))
    position = {-1: 0}
    out_tokens, out_parents = [], []
    for c in chosen:
        position[c] = len(out_tokens) + 1
        out_tokens.append(int(tokens[c]))
        out_parents.append(position[int(parents[c])])
    return out_tokens, out_parents, chosen


class Tree(NamedTuple):
    """A row's tree of drafts in tree order."""

    tokens: list
    parents: list  # input positions, 0: the root (the pending token)
    chances: list  # each node's chance that its whole path is kept
    cells: list  # each node's kept-rate cell (``node_scores.py``)


def trees(candidates: tuple, budgets: Sequence[int]) -> list[Tree]:
    """Every row's tree from ``expand``'s candidates (one transfer)."""
    tokens, scores, _, parents, found = (np.array(a) for a in candidates)
    out = []
    for i, b in enumerate(budgets):
        t, p, chosen = choose(tokens[i], scores[i], parents[i], b)
        out.append(Tree(t, p, np.exp(scores[i, chosen]).tolist(), found[i, chosen].tolist()))
    return out


def feed_depth(drafter, cache: list, run: Callable, tokens: mx.array, ancestors: mx.array,
               d: int) -> mx.array:
    """``run()`` (the drafter over one depth's nodes ``tokens [R, w]``) with
    each node attending to its row's context and its own ``ancestors``, at
    the position a chain's d-th draft takes: the cache holds ``w`` entries
    a depth by then."""
    assert mlx_lm_adapter.node_positions_refused(drafter) is None, \
        "a drafter that cannot place nodes at their depths drafts chains (grows_trees)"
    depths = mlx_lm_adapter.node_positions(drafter)
    set_tree(cache, ancestors)
    depths[0] = mx.full(tokens.shape, (d - 1) * (1 - tokens.shape[1]), mx.int32)
    try:
        return run()
    finally:
        set_tree(cache, None)
        depths[0] = None
