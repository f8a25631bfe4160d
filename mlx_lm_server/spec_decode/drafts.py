"""What a step's drafts are, below everything that makes or judges them:
the proposal (``ProposalResult``: fixed-shape ``[B, k]`` tokens padded with
``PLACEHOLDER_TOKEN``, q, tree links and chances), a row's context, and the
small helpers that pad and merge rows. The proposers, the tree layout, the
verifier and the grammar all speak it; it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

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
    # (``proposer/mixed.py``); reported per request and in the metrics.
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
