"""A drafter's tree of drafts: best-first expansion for the whole batch at once.

A chain feeds each row's likeliest draft back to the drafter and guesses on
from it alone; whatever the drafter thought second likeliest is lost. A
tree keeps it (EAGLE-2 for a learned head, SpecExec for a draft model). At
each depth the ``width`` likeliest nodes of the row's tree so far (by the
draft's cumulative probability: the product of the drafter's probabilities
along the path) are fed to the drafter together, each attending to the
row's context and to its own ancestors only (``kv/rows.tree_row_mask``, the
earlier depths already in the drafter's cache) at its own depth's position
(the adapter's ``node_positions``), and each gives its ``width`` likeliest
children. The row's tree is then the ``budget`` likeliest of all those
nodes (EAGLE-2's re-ranking, with the drafter's distribution sharpened:
``SHARPEN``): a child is never likelier than its parent, so every chosen
node's parent is chosen.

The drafter runs as many times as for a chain of the same depth, ``width``
tokens a row each time. Everything stays on the device until the end: one
transfer of ``[R, width + (depth - 1) width^2]`` tokens, scores and parent
links a proposal, whatever the vocabulary; the host orders each row's
chosen nodes (tens) into tree order. Only greedy batches grow trees: a
sampled row's chain carries its q to the rejection sampler, which keeps
more than one-hot siblings would.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ...kv import set_tree
from ...runtime import mlx_lm_adapter


def top_children(logprobs: mx.array, width: int) -> tuple[mx.array, mx.array]:
    """The ``width`` likeliest tokens of ``[..., V]`` log-probabilities and
    theirs, likeliest first."""
    idx = mx.argpartition(-logprobs, kth=width - 1, axis=-1)[..., :width]
    lp = mx.take_along_axis(logprobs, idx, axis=-1)
    order = mx.argsort(-lp, axis=-1)
    return mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(lp, order, axis=-1)


# A greedy verification keeps a node when its token is the target's argmax,
# and a drafter's first guess is that more often than its probability says:
# scores come from its distribution sharpened by this temperature. At 1
# (EAGLE-2's scores) a confident MTP layer's trees spent their nodes on
# siblings and kept 0.88x a chain's tokens a verification at k=4; at 0.5,
# 1.01x (``scripts/bench/bench_trees.py``, BENCHMARKS.md).
SHARPEN = 0.5


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32) / SHARPEN
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def expand(states: mx.array, to_logits: Callable, feed: Callable, width: int,
           depth: int) -> tuple[mx.array, mx.array, mx.array]:
    """Grow every row's tree ``depth`` deep from the head's last states
    ``[R, H]``. ``feed(tokens [R, w], parent_states [R, w, H], ancestors
    [R, w, M], depth)`` runs the head over one depth's nodes (``ancestors``:
    over every node fed so far, these included) and gives their states.

    Returns the candidates ``[R, C]``: tokens, cumulative log-probabilities
    and parents (an index among the candidates, ``-1``: the root), every
    parent before its children."""
    R = states.shape[0]
    tok, score = top_children(_log_softmax(to_logits(states)), width)  # [R, w]
    tokens, scores = [tok], [score]
    parents = [mx.full((R, width), -1, mx.int32)]
    frontier = mx.broadcast_to(mx.arange(width, dtype=mx.int32), (R, width))
    parent_states = mx.broadcast_to(states[:, None], (R, width, states.shape[-1]))
    ancestors = mx.broadcast_to(mx.eye(width, dtype=mx.bool_), (R, width, width))
    count = width
    for d in range(1, depth):
        fed = feed(tok, parent_states, ancestors, d)  # [R, w, H]
        child_tok, child_lp = top_children(_log_softmax(to_logits(fed)), width)  # [R, w, w]
        child_tok = child_tok.reshape(R, width * width)
        child_score = (score[..., None] + child_lp).reshape(R, width * width)
        tokens.append(child_tok)
        scores.append(child_score)
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
    return (mx.concatenate(tokens, axis=1), mx.concatenate(scores, axis=1),
            mx.concatenate(parents, axis=1))


def choose(tokens: np.ndarray, scores: np.ndarray, parents: np.ndarray,
           budget: int) -> tuple[list, list]:
    """One row's tree: its ``budget`` likeliest candidates as ``(tokens,
    parents)`` in tree order (parents as input positions, 0 the root),
    siblings likeliest first. Ties go to the earlier candidate, so a parent
    (always earlier) outranks a child as likely as itself."""
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
    return out_tokens, out_parents


def trees(tokens: mx.array, scores: mx.array, parents: mx.array,
          budgets: Sequence[int]) -> list[tuple[list, list]]:
    """Every row's tree from ``expand``'s candidates (one transfer)."""
    tokens, scores, parents = (np.array(a) for a in (tokens, scores, parents))
    return [choose(tokens[i], scores[i], parents[i], b) for i, b in enumerate(budgets)]


def feed_depth(drafter, cache: list, run: Callable, tokens: mx.array, ancestors: mx.array,
               d: int) -> mx.array:
    """``run()`` (the drafter over one depth's nodes ``tokens [R, w]``) with
    each node attending to its row's context and its own ``ancestors``, at
    the position a chain's d-th draft takes: the cache holds ``w`` entries
    a depth by then."""
    depths = mlx_lm_adapter.node_positions(drafter)
    set_tree(cache, ancestors)
    depths[0] = mx.full(tokens.shape, (d - 1) * (1 - tokens.shape[1]), mx.int32)
    try:
        return run()
    finally:
        set_tree(cache, None)
        depths[0] = None
