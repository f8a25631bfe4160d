"""Trees of drafts: one flat layout, and the verdict on a tree for the whole batch.

A row's drafts are ``N`` nodes in tree order (every parent before its
children, siblings by rank: the likeliest first). Position 0 of the
verification input is the root, the row's pending token; node ``j`` is
input position ``j + 1`` and ``parents[j]`` is its parent's input position
(``0``: the root). A chain is the tree whose ``parents[j] == j``; every
function here takes it unchanged.

From the parent links follow, host side (``N`` is tens of nodes, never the
vocabulary): each node's depth (its RoPE position past the row's cache) and
the ancestor mask (a node attends to the row's cache, its ancestors and
itself: never a sibling or a cousin; ``kv/rows.tree_row_mask`` makes it the
pass's attention mask, and the adapter's ``node_positions`` its positions).
After the pass:

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

The accepted path's input positions (``path``) say which of the pass's
cache entries and hidden states to keep, in order: ``0, path[1], ...``; for
a chain they are ``0..n`` and nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .drafts import PLACEHOLDER_TOKEN


# ---- the layout, host side ----------------------------------------------------


def chain_parents(B: int, K: int) -> np.ndarray:
    """[B, K] the parent links of chains: node j follows node j - 1."""
    return np.broadcast_to(np.arange(K, dtype=np.int32), (B, K)).copy()


def is_chain(parents: np.ndarray) -> bool:
    return bool((parents == np.arange(parents.shape[1], dtype=parents.dtype)).all())


@dataclass
class TreeLayout:
    """What a batch of trees means for a verification pass (host arrays)."""

    depth: np.ndarray  # [B, N+1] int32: input position n's depth (root: 0)
    ancestors: np.ndarray  # [B, N+1, N+1] bool: [b, i, j] j is i or an ancestor of i
    num_nodes: np.ndarray  # [B] int32

    @property
    def max_depth(self) -> int:
        return int(self.depth.max(initial=0))


def layout(parents: np.ndarray, num_nodes: Sequence[int]) -> TreeLayout:
    """Depths and ancestor masks of ``[B, N]`` parent links. Nodes past a
    row's ``num_nodes`` are placeholders: they hang off the root (so they
    never sit on an accepted path: their token is never a target choice)
    and see only the root."""
    B, N = parents.shape
    num_nodes = np.asarray(num_nodes, dtype=np.int32)
    parents = np.where(np.arange(N)[None] < num_nodes[:, None], parents, 0).astype(np.int32)
    if (parents > np.arange(N)[None]).any() or (parents < 0).any():
        raise ValueError("a node's parent must come before it (tree order)")
    depth = np.zeros((B, N + 1), np.int32)
    anc = np.zeros((B, N + 1, N + 1), bool)
    anc[:, 0, 0] = True
    rows = np.arange(B)
    for j in range(N):  # tree order: a parent's row is complete before its children's
        p = parents[:, j]
        depth[:, j + 1] = depth[rows, p] + 1
        anc[:, j + 1] = anc[rows, p]
        anc[:, j + 1, j + 1] = True
    return TreeLayout(depth, anc, num_nodes)


def repeated_siblings(tokens: np.ndarray, parents: np.ndarray, num: Sequence[int]) -> list:
    """The rows of ``[B, N]`` trees where a node has two children of one token:
    the verdict takes siblings for distinct tokens, so no such tree may reach a pass."""
    valid = np.arange(tokens.shape[1])[None] < np.asarray(num)[:, None]  # [B, N]
    same = (tokens[:, :, None] == tokens[:, None, :]) & (parents[:, :, None] == parents[:, None, :])
    same &= valid[:, :, None] & valid[:, None, :] & ~np.eye(tokens.shape[1], dtype=bool)
    return np.flatnonzero(same.any(axis=(1, 2))).tolist()  # same: [B, N, N]


def tree_from_paths(paths: Sequence[Sequence[int]], budget: int) -> tuple[list, list]:
    """Merge continuations (likeliest first) into one trie of at most
    ``budget`` nodes: ``(tokens, parents)`` in tree order. A shared prefix is
    one node; a path is cut where the budget runs out. The tree order is the
    order nodes were first reached, so siblings keep the paths' ranks."""
    tokens: list = []
    parents: list = []
    children: dict = {}  # (parent input position, token) -> input position
    for path in paths:
        at = 0
        for t in path:
            key = (at, int(t))
            if key not in children:
                if len(tokens) >= budget:
                    break
                tokens.append(int(t))
                parents.append(at)
                children[key] = len(tokens)
            at = children[key]
    return tokens, parents


def best_first(paths: Sequence[Sequence[int]], weights: Sequence[float], budget: int,
               decay: float = 0.8) -> tuple[list, list]:
    """The ``budget`` likeliest nodes of the trie of ``paths``: a node's
    score is the weight of the paths through it (its empirical probability,
    SuffixDecoding's count) times ``decay`` per depth (deeper guesses are
    less sure), so a branch the paths agree on goes deep and a disagreement
    spreads the budget over the alternatives. Ties keep the paths' order.
    Returns ``(tokens, parents)`` in tree order."""
    total = float(sum(weights)) or 1.0
    node_of: dict = {}  # (parent input position in the trie, token) -> trie node
    trie_parent, trie_token, score, depth = [], [], [], []
    for path, w in zip(paths, weights):
        at = -1
        for d, t in enumerate(path):
            key = (at, int(t))
            if key not in node_of:
                node_of[key] = len(trie_token)
                trie_parent.append(at)
                trie_token.append(int(t))
                score.append(0.0)
                depth.append(d + 1)
            at = node_of[key]
            score[at] += w / total
    # A child never outscores its parent, so taking nodes by score (then by
    # first appearance) keeps every chosen node's parent chosen before it.
    order = sorted(range(len(trie_token)), key=lambda i: (-score[i] * decay ** depth[i], i))
    chosen = sorted(order[:budget], key=lambda i: (depth[i], -score[i], i))
    position = {-1: 0}
    tokens, parents = [], []
    for i in chosen:
        position[i] = len(tokens) + 1
        tokens.append(trie_token[i])
        parents.append(position[trie_parent[i]])
    return tokens, parents


def kept_path(tokens: Sequence[int], parents: Sequence[int], emitted: Sequence[int]) -> list:
    """The nodes (indices into ``tokens``) a greedy verification keeps when
    the target goes on to emit ``emitted``: the longest root path equal to
    its start. Host side, for replays and shadow drafts (the server's own
    verdict is ``greedy_tree_verify``)."""
    kept, at = [], 0
    for t in emitted:
        nxt = next((j for j in range(len(tokens)) if parents[j] == at and tokens[j] == t), None)
        if nxt is None:
            break
        kept.append(nxt)
        at = nxt + 1
    return kept


def first_path(tokens: Sequence[int], parents: Sequence[int]) -> list:
    """The tree's first root path, each node's first child (the likeliest):
    the chain a row drafts where it cannot branch."""
    chain, at = [], 0
    for j, p in enumerate(parents):
        if p == at:
            chain.append(tokens[j])
            at = j + 1
    return chain


def as_chains(tokens: np.ndarray, parents: np.ndarray, num: Sequence[int],
              rows: Sequence[int]) -> tuple[np.ndarray, list, Optional[np.ndarray]]:
    """``rows`` of a batch of trees made chains (their first paths):
    ``(tokens, num, parents)``, parents None when every row is then a chain."""
    tokens, num, parents = tokens.copy(), list(num), parents.copy()
    K = tokens.shape[1]
    for i in rows:
        chain = first_path(tokens[i, : num[i]].tolist(), parents[i, : num[i]].tolist())
        tokens[i] = PLACEHOLDER_TOKEN
        tokens[i, : len(chain)] = chain
        parents[i] = np.arange(K)
        num[i] = len(chain)
    return tokens, num, (None if is_chain(parents) else parents)


def best_nodes(parents: Sequence[int], chances: Sequence[float], n: int) -> list:
    """The ``n`` nodes whose paths are likeliest kept, in tree order. A
    child's chance is never above its parent's and ties go to the earlier
    node, so every chosen node's parent is chosen."""
    order = sorted(range(len(parents)), key=lambda j: (-chances[j], j))
    return sorted(order[:n])


def cut_trees(tokens: np.ndarray, parents: np.ndarray, chances: np.ndarray,
              num: Sequence[int], n: int) -> tuple[np.ndarray, list, np.ndarray]:
    """Each row's tree cut to its ``n`` likeliest nodes (``best_nodes``):
    ``(tokens, num, parents)``, parents re-pointed at the kept nodes."""
    tokens, num, parents = tokens.copy(), list(num), parents.copy()
    K = tokens.shape[1]
    for i in range(len(num)):
        if num[i] <= n:
            continue
        keep = best_nodes(parents[i, : num[i]].tolist(), chances[i, : num[i]].tolist(), n)
        position = {0: 0, **{j + 1: m + 1 for m, j in enumerate(keep)}}
        row_tokens = tokens[i, keep]
        row_parents = [position[int(parents[i, j])] for j in keep]
        tokens[i] = PLACEHOLDER_TOKEN
        tokens[i, :n] = row_tokens
        parents[i] = np.arange(K)
        parents[i, :n] = row_parents
        num[i] = n
    return tokens, num, parents


def expected_tokens(chances: np.ndarray, num: Sequence[int]) -> np.ndarray:
    """``[N]``: the tokens a batch of trees is expected to emit when each row
    is cut to its 1, 2, ... N likeliest nodes: a token a row whatever is
    kept, plus every kept node's chance."""
    N = chances.shape[1]
    c = np.where(np.arange(N)[None] < np.asarray(num)[:, None], chances, 0.0)
    return len(num) + np.cumsum(-np.sort(-c, axis=1), axis=1).sum(axis=0)


def sibling_ranks(parents: Sequence[int], kept: Sequence[int]) -> list:
    """Each kept node's rank among its parent's children (0: the first, the
    drafter's likeliest); a chain of first guesses keeps only rank 0, so
    the other ranks are what branching bought."""
    seen: dict = {}
    rank = []
    for p in parents:
        rank.append(seen.get(p, 0))
        seen[p] = rank[-1] + 1
    return [rank[j] for j in kept]


def path_positions(kept: Sequence[Sequence[int]]) -> np.ndarray:
    """[B, D+1] the input positions a verdict keeps (``kept_path``'s nodes
    per row): the root, then each kept node, padded by repeating the last."""
    D = max((len(k) for k in kept), default=0)
    out = np.zeros((len(kept), D + 1), np.int32)
    for i, k in enumerate(kept):
        row = [0] + [j + 1 for j in k]
        out[i, : len(row)] = row
        out[i, len(row):] = row[-1]
    return out


def pad_trees(trees: Sequence[tuple[list, list]], N: int) -> tuple[np.ndarray, np.ndarray,
                                                                     np.ndarray]:
    """Rows of ``(tokens, parents)`` as ``[B, N]`` arrays padded with
    placeholders (hanging off the root), and ``num_nodes [B]``."""
    B = len(trees)
    tokens = np.full((B, N), PLACEHOLDER_TOKEN, np.int32)
    parents = np.zeros((B, N), np.int32)
    num = np.zeros(B, np.int32)
    for i, (t, p) in enumerate(trees):
        n = min(len(t), N)
        tokens[i, :n] = t[:n]
        parents[i, :n] = p[:n]
        num[i] = n
    return tokens, parents, num


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
class TreeVerdict:
    """What a tree pass kept, per row."""

    output: mx.array  # [B, D+1] the accepted drafts, the final token, then placeholders
    num_accepted: mx.array  # [B]
    path: mx.array  # [B, D+1] input positions of the kept entries (path[:, 0] == 0)


def _verdict(tokens: mx.array, anc: mx.array, depth: mx.array, accepted: mx.array,
             final_at, D: int) -> TreeVerdict:
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
    return TreeVerdict(out, n.astype(mx.int32), path)


def _parent_values(values: mx.array, parents: mx.array) -> mx.array:
    """[B, N] ``values[b, parents[b, j]]`` for [B, N+1] ``values``."""
    return mx.take_along_axis(values, parents, axis=1)


def greedy_tree_verify(
    target_ids: mx.array,  # [B, N+1] the target's argmax at each input position
    tokens: mx.array,  # [B, N] int32
    parents: mx.array,  # [B, N] int32 input positions
    tree: TreeLayout,
) -> TreeVerdict:
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
) -> TreeVerdict:
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
