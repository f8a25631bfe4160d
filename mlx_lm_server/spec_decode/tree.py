"""Trees of drafts: one flat layout, host side (the verdict on a tree is
``tree_verdict.py``).

A row's drafts are ``N`` nodes in tree order (every parent before its
children, siblings by rank: the likeliest first). Position 0 of the
verification input is the root, the row's pending token; node ``j`` is
input position ``j + 1`` and ``parents[j]`` is its parent's input position
(``0``: the root). A chain is the tree whose ``parents[j] == j``.

From the parent links follow, host side (``N`` is tens of nodes, never the
vocabulary): each node's depth (its RoPE position past the row's cache) and
the ancestor mask (a node attends to the row's cache, its ancestors and
itself: never a sibling or a cousin; ``kv/rows.tree_row_mask`` makes it the
pass's attention mask, and the adapter's ``node_positions`` its positions).
Here too: merging continuations into a tree (best first), cutting trees to
their likeliest nodes, and the chains a row drafts where it cannot branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

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

    def rows(self, rows: list) -> "TreeLayout":
        """The layout of some rows of the batch."""
        return TreeLayout(self.depth[rows], self.ancestors[rows], self.num_nodes[rows])


def layout(parents: Optional[np.ndarray], num_nodes: Sequence[int]) -> Optional[TreeLayout]:
    """Depths and ancestor masks of ``[B, N]`` parent links (None, every row
    a chain: None). Nodes past a row's ``num_nodes`` are placeholders: they
    hang off the root (so they never sit on an accepted path: their token is
    never a target choice) and see only the root."""
    if parents is None:
        return None
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


def pad_links(parents: Optional[np.ndarray], K: int) -> Optional[np.ndarray]:
    """A plan's ``[B, K]`` parent links: placeholders past a row's nodes hang
    off the root (None, chains: None)."""
    if parents is None:
        return None
    out = np.zeros((parents.shape[0], K), np.int32)
    width = min(K, parents.shape[1])
    out[:, :width] = np.maximum(parents[:, :width], 0)
    return out


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
