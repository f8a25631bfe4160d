"""What a verification step does with trees of drafts (``tree.py``): which
rows may branch, the one pass over every row's tree, and the kept root
paths moved into place. The engine calls these where a chain's step would
do the same with a prefix."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..kv import hold_trees, keep_paths, make_rollbackable, set_tree
from ..runtime import mlx_lm_adapter
from .tree import TreeLayout, kept_path, off_first, path_positions


def chain_rows(batch, rows: Sequence, proposal, verify_mode: str) -> list:
    """The rows that draft chains although the proposer branched: a tree
    needs every layer to hold one (ragged attention), a row without logits
    processors (whose context grows along one path) or grammar, and one-hot
    drafts under the lossless or greedy rule. ``rows``: the engine's records."""
    every = list(range(len(rows)))
    if proposal.draft_probs is not None or verify_mode == "threshold" \
            or not hold_trees(make_rollbackable(batch.prompt_cache)):
        return every
    return [i for i, row in enumerate(rows) if row.processors or row.constraint is not None]


def tree_pass(model, inputs: mx.array, caches: list, tree: TreeLayout) -> mx.array:
    """The target over every row's tree at once: each node attends to its
    ancestors (``set_tree``) and sits at its depth (``node_positions``)."""
    depths = mlx_lm_adapter.node_positions(model)
    set_tree(caches, mx.array(tree.ancestors))
    depths[0] = mx.array(tree.depth)
    try:
        return model(inputs, cache=caches)  # [B, N+1, V]
    finally:
        depths[0] = None


def keep_kept_paths(caches: list, plan, out_rows: list, accepted: list) -> tuple[mx.array, int]:
    """Each row's kept root path (found from its verdict's tokens, so every
    rank finds the same) moved into the pass's first positions; the rest is
    then rolled back as a chain's. Returns the path's input positions
    ``[B, D+1]`` (to pick the pass's logits and hidden states along) and how
    many kept drafts were not their parent's first child."""
    parents = [plan.parents[i, :n].tolist() for i, n in enumerate(plan.num_drafts)]
    kept = [kept_path(plan.drafts[i, :len(p)].tolist(), p, out_rows[i][:accepted[i]])
            for i, p in enumerate(parents)]
    path = mx.array(path_positions(kept))
    keep_paths(caches, path, plan.drafts.shape[1] + 1)
    return path, sum(off_first(p, k) for p, k in zip(parents, kept))
