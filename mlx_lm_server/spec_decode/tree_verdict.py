"""The verdict on a batch of trees (``tree.py``'s layout), for the whole
batch at once on the device:

- temperature 0: a node is *correct* when its token is the target's argmax
  at its parent. Siblings are distinct tokens, so the nodes whose every
  ancestor is correct form one root path; the deepest ends the accepted run
  and the target's argmax there is the final token (the greedy output of
  plain decoding, exactly);
- temperature > 0: at each node its children are tried in rank order, each
  a deterministic (one-hot) draft against what is left of p: child ``c_r``
  is kept with probability ``p(c_r) / (1 - p(c_1) - ... - p(c_{r-1}))``.
  The token that leaves a node is then distributed exactly as p at that
  node (SpecInfer / SpecTr's multi-candidate rule with one-hot q); where
  every child is rejected, the final token is drawn from p with all of them
  removed, renormalised (a leaf: the bonus token, from p). Each node's test
  depends only on its own parent's p and its own uniform, so every test is
  computed at once and the path falls out of the ancestor mask, as for
  greedy.

The accepted path's input positions (``Verdict.path``) say which of the
pass's cache entries and hidden states to keep, in order: ``0, path[1],
...``; a chain's verdict has none (``0..n``: nothing moves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .drafts import PLACEHOLDER_TOKEN
from .tree import TreeLayout


# ---- the verdict ----------------------------------------------------------------


def _deepest(accepted: mx.array, depth: mx.array) -> tuple[mx.array, mx.array]:
    """The deepest accepted input position of each row, and its depth (the
    number of drafts kept)."""
    score = mx.where(accepted, depth + 1, 0)  # [B, N+1]
    deepest = mx.argmax(score, axis=1)  # [B]
    n = mx.take_along_axis(depth, deepest[:, None], axis=1)[:, 0]
    return deepest, n


def _root_path(anc: mx.array, depth: mx.array, deepest: mx.array, D: int) -> mx.array:
    """[B, D+1]: the input position at each depth on the root path to
    ``deepest`` (past its depth: ``deepest`` again, harmless to gather)."""
    on = mx.take_along_axis(anc, deepest[:, None, None], axis=1)[:, 0]  # [B, N+1]
    at = (depth[:, None, :] == mx.arange(D + 1)[None, :, None]) & on[:, None, :]  # [B, D+1, N+1]
    found = at.any(axis=2)
    idx = mx.argmax(at, axis=2).astype(mx.int32)
    return mx.where(found, idx, deepest[:, None].astype(mx.int32))


@dataclass
class Verdict:
    """What a verification pass kept, per row: chains and trees alike."""

    output: mx.array  # [B, D+1] the accepted drafts, the final token, then placeholders
    num_accepted: mx.array  # [B]
    # [B, D+1] input positions of the kept entries (path[:, 0] == 0), for a
    # tree; None for chains, whose kept entries are 0..n already.
    path: Optional[mx.array] = None


def _verdict(tokens: mx.array, anc: mx.array, depth: mx.array, accepted: mx.array,
             final_at, D: int) -> Verdict:
    deepest, n = _deepest(accepted, depth)
    path = _root_path(anc, depth, deepest, D)
    with_root = mx.concatenate([mx.full((tokens.shape[0], 1), PLACEHOLDER_TOKEN, mx.int32),
                                tokens], axis=1)
    path_tokens = mx.take_along_axis(with_root, path, axis=1)  # [B, D+1]; [:, 0] the root
    final = final_at(deepest)  # [B]
    pos = mx.arange(D + 1)[None]
    drafts = mx.concatenate([path_tokens[:, 1:], mx.full((tokens.shape[0], 1),
                                                         PLACEHOLDER_TOKEN, mx.int32)], axis=1)
    out = mx.where(pos < n[:, None], drafts, PLACEHOLDER_TOKEN)
    out = mx.where(pos == n[:, None], final[:, None].astype(mx.int32), out)
    return Verdict(out, n.astype(mx.int32), path)


def _parent_values(values: mx.array, parents: mx.array) -> mx.array:
    """[B, N] ``values[b, parents[b, j]]`` for [B, N+1] ``values``."""
    return mx.take_along_axis(values, parents, axis=1)


def greedy_tree_verify(
    target_ids: mx.array,  # [B, N+1] the target's argmax at each input position
    tokens: mx.array,  # [B, N] int32
    parents: mx.array,  # [B, N] int32 input positions
    tree: TreeLayout,
) -> Verdict:
    """Temperature 0: the longest root path of the target's own choices."""
    B, N = tokens.shape
    valid = mx.arange(N)[None] < mx.array(tree.num_nodes)[:, None]
    correct = (tokens == _parent_values(target_ids, parents)) & valid
    correct = mx.concatenate([mx.ones((B, 1), mx.bool_), correct], axis=1)  # the root
    anc = mx.array(tree.ancestors)
    accepted = ~(anc & ~correct[:, None, :]).any(axis=2)  # every ancestor correct
    D = max(tree.max_depth, 0)
    return _verdict(tokens, anc, mx.array(tree.depth), accepted,
                    lambda at: mx.take_along_axis(target_ids, at[:, None], axis=1)[:, 0], D)


def tree_rejection_sample(
    target_probs: mx.array,  # [B, N+1, V] p at each input position
    tokens: mx.array,  # [B, N]
    parents: mx.array,  # [B, N]
    tree: TreeLayout,
    uniforms: mx.array,  # [B, N] one per node, for its own test
    gumbels: mx.array,  # [B, V] for the final draw
) -> Verdict:
    """Temperature > 0, exact: children tried in rank order as one-hot drafts
    against the residual of p at their parent (see the module docstring)."""
    B, N = tokens.shape
    V = target_probs.shape[-1]
    valid = mx.arange(N)[None] < mx.array(tree.num_nodes)[:, None]
    safe = mx.maximum(tokens, 0)
    # p at the parent, of each node's own token: [B, N]
    p_parent = mx.take_along_axis(target_probs, parents[..., None], axis=1)  # [B, N, V]
    p_own = mx.take_along_axis(p_parent, safe[..., None], axis=2)[..., 0]
    p_own = mx.where(valid, p_own, 0.0)
    # Mass of the earlier siblings (same parent, lower rank): [B, N]
    same = (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :]
    earlier = same & (mx.arange(N)[None, :] < mx.arange(N)[:, None])[None]
    before = (earlier * p_own[:, None, :]).sum(axis=2)
    chosen = (uniforms * mx.maximum(1.0 - before, 0.0) < p_own) & (p_own > 0) & valid
    # Only the first chosen sibling counts: one passing after another is never tried.
    chosen = chosen & ~(earlier & chosen[:, None, :]).any(axis=2)
    chosen = mx.concatenate([mx.ones((B, 1), mx.bool_), chosen], axis=1)
    anc = mx.array(tree.ancestors)
    accepted = ~(anc & ~chosen[:, None, :]).any(axis=2)
    par = mx.concatenate([mx.full((B, 1), -1, mx.int32), mx.where(valid, parents, -1)], axis=1)

    def final_at(deepest):
        p = mx.take_along_axis(target_probs, deepest[:, None, None], axis=1)[:, 0]  # [B, V]
        # Every child of the deepest accepted node was tried and rejected.
        kids = (par == deepest[:, None])  # [B, N+1]
        with_root = mx.concatenate([mx.zeros((B, 1), mx.int32), safe], axis=1)
        residual = mx.where(_marked(with_root, kids, V), 0.0, p)
        residual = mx.where(residual.sum(axis=1, keepdims=True) <= 0, p, residual)
        return mx.argmax(mx.log(residual) + gumbels, axis=1).astype(mx.int32)

    return _verdict(tokens, anc, mx.array(tree.depth), accepted, final_at, tree.max_depth)


def _marked(index: mx.array, on: mx.array, V: int) -> mx.array:
    """[B, V] bool: True at ``index[b, j]`` wherever ``on[b, j]`` (the
    others write to a spare column that is cut off)."""
    B = index.shape[0]
    where = mx.where(on, index, V)
    hit = mx.zeros((B, V + 1), mx.bool_)
    return mx.put_along_axis(hit, where, mx.ones(where.shape, mx.bool_), axis=1)[:, :V]
