"""What a step's drafts are, below everything that makes or judges them:
the proposal (``ProposalResult``: fixed-shape ``[B, k]`` tokens padded with
``PLACEHOLDER_TOKEN``, q, tree links and chances), a row's context, and the
small helpers that pad and merge rows. The proposers, the tree layout, the
verifier and the grammar all speak it; it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

# Fills draft slots past a sequence's proposal length.
PLACEHOLDER_TOKEN = -1


@dataclass
class ProposalResult:
    draft_tokens: np.ndarray  # [B, k] int32, PLACEHOLDER_TOKEN past num_proposed
    num_proposed: np.ndarray  # [B] int32
    # [B, k, vocab] draft distribution q, or None for deterministic (one-hot) drafts.
    draft_probs: Optional[object] = None
    # [B] the proposer each row's draft came from, where several take part
    # (``proposer/per_row.py``); reported per request and in the metrics.
    sources: Optional[list] = None
    # [B, k] int32: a tree of drafts (``tree.py``): each node's parent's
    # input position (0: the pending token). None: every row a chain.
    parents: Optional[np.ndarray] = None
    # [B, k] float: each node's chance that its whole path is kept, where the
    # proposer measures it (``proposer/node_scores.py``); the engine prices trees by it.
    # NaN on a row whose source measures none (merged rows): not priced.
    chances: Optional[np.ndarray] = None

    @classmethod
    def from_trees(cls, trees: Sequence[tuple], k: int) -> "ProposalResult":
        """Rows of ``(tokens, parents)`` in tree order, or ``(tokens,
        parents, chances)``; all chains: no parents."""
        out = cls.from_lists([t[0] for t in trees], k)
        parents = np.broadcast_to(np.arange(k, dtype=np.int32), out.draft_tokens.shape).copy()
        for i, tree in enumerate(trees):
            parents[i, : len(tree[1])] = tree[1][:k]
        if (parents == np.arange(k, dtype=np.int32)).all():
            return out
        out.parents = parents
        if any(len(tree) > 2 for tree in trees):
            out.chances = np.zeros(out.draft_tokens.shape, np.float32)
            for i, tree in enumerate(trees):
                if len(tree) > 2:
                    out.chances[i, : len(tree[2])] = tree[2][:k]
        return out

    @classmethod
    def from_lists(cls, drafts: Sequence[Sequence[int]], k: int) -> "ProposalResult":
        out = np.full((len(drafts), k), PLACEHOLDER_TOKEN, dtype=np.int32)
        lengths = np.zeros(len(drafts), dtype=np.int32)
        for i, d in enumerate(drafts):
            d = list(d)[:k]
            out[i, : len(d)] = d
            lengths[i] = len(d)
        return cls(out, lengths)


def row_chances(chances: Optional[np.ndarray], B: int, K: int) -> np.ndarray:
    """A proposal's chances as ``[B, K]``, NaN where it measured none."""
    out = np.full((B, K), np.nan, np.float32)
    if chances is not None:
        width = min(K, chances.shape[1])
        out[:, :width] = chances[:, :width]
    return out


def merge_chances(rows: np.ndarray, ours: Optional[np.ndarray], theirs: Optional[np.ndarray],
                  K: int) -> Optional[np.ndarray]:
    """The chances of a proposal whose ``rows`` [B] come from one source
    (``ours``) and the rest from another (``theirs``): each row keeps its
    own source's, so that merging never leaves a measured tree unpriced;
    None where neither measured any."""
    if ours is None and theirs is None:
        return None
    B = len(rows)
    return np.where(rows[:, None], row_chances(ours, B, K), row_chances(theirs, B, K))


class Context:
    """A sequence's tokens plus its pending token, without copying the history.

    Copying an 8k-token history for 32 sequences every step would cost more
    than proposing; a proposer reads only the tail it has not seen yet.
    """

    __slots__ = ("history", "pending")

    def __init__(self, history: list[int], pending: int):
        self.history = history
        self.pending = pending

    def __len__(self) -> int:
        return len(self.history) + 1

    def __getitem__(self, i):
        n = len(self.history)
        if isinstance(i, slice):
            start, stop, step = i.indices(n + 1)
            if step != 1:
                raise ValueError("Context slices must be contiguous")
            head = self.history[start : min(stop, n)]
            return head + [self.pending] if start <= n < stop else head
        if i < 0:
            i += n + 1
        if i == n:
            return self.pending
        return self.history[i]

    def tolist(self) -> list[int]:
        return self.history + [self.pending]


def pad_columns(draft_np, K: int):
    """[B, k] drafts padded with placeholders to [B, K]."""
    B, k = draft_np.shape
    if k >= K:
        return draft_np[:, :K]
    return np.concatenate([draft_np, np.full((B, K - k), PLACEHOLDER_TOKEN, draft_np.dtype)], 1)


def links(parents: Optional[np.ndarray], B: int, K: int) -> np.ndarray:
    """A proposal's parent links as ``[B, K]``: chains where it drafted chains."""
    out = np.broadcast_to(np.arange(K, dtype=np.int32), (B, K)).copy()
    if parents is not None:
        width = min(K, parents.shape[1])
        out[:, :width] = parents[:, :width]
    return out


def _q_or_one_hot(q, tokens: np.ndarray, V: int, dtype):
    """A side's ``[B, K, V]`` q, padded to K drafts, or one-hot on its
    tokens where it drafts deterministically (no q)."""
    K = tokens.shape[1]
    if q is None:
        return (mx.arange(V)[None, None, :] == mx.array(tokens)[:, :, None]).astype(dtype)
    return q[:, :K] if q.shape[1] >= K else mx.pad(q, [(0, 0), (0, K - q.shape[1]), (0, 0)])


def merge_rows(take: np.ndarray, ours: ProposalResult, theirs: ProposalResult,
               K: int) -> ProposalResult:
    """One proposal from two sources' proposals for the same rows: row i is
    ``ours``'s where ``take[i]``, else ``theirs``'s, and keeps everything its
    source said of it: its tokens (padded to ``K``), its q (one-hot where
    its source drafts deterministically, so rejection sampling stays exact),
    its tree links (a chain where its source drafted chains; None when every
    row is one), its chances (NaN where its source measured none: not
    priced) and its source's name (``sources``)."""
    B = len(take)
    tokens = np.where(take[:, None], pad_columns(ours.draft_tokens, K),
                      pad_columns(theirs.draft_tokens, K))
    num = np.where(take, ours.num_proposed, theirs.num_proposed).astype(np.int32)
    q = None
    sampled = [p for p in (ours.draft_probs, theirs.draft_probs) if p is not None]
    if sampled and (take.all() or not take.any()):  # one side's rows alone: its q as it is
        side = ours if take.all() else theirs
        if side.draft_probs is not None:
            q = _q_or_one_hot(side.draft_probs, tokens, 0, None)
    elif sampled:
        V, dtype = sampled[0].shape[-1], sampled[0].dtype
        q = mx.where(mx.array(take)[:, None, None],
                     _q_or_one_hot(ours.draft_probs, tokens, V, dtype),
                     _q_or_one_hot(theirs.draft_probs, tokens, V, dtype))
    parents = np.where(take[:, None], links(ours.parents, B, K), links(theirs.parents, B, K))
    tree = not (parents == np.arange(K, dtype=np.int32)).all()
    sources = None
    if ours.sources is not None or theirs.sources is not None:
        mine, other = ours.sources or [None] * B, theirs.sources or [None] * B
        sources = [mine[i] if t else other[i] for i, t in enumerate(take)]
    return ProposalResult(tokens, num, q, sources, parents if tree else None,
                          merge_chances(take, ours.chances, theirs.chances, K) if tree else None)
