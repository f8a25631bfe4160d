"""How likely a drafted node is to be kept, measured on the traffic.

A tree spends its nodes on the paths likeliest to be kept, and a drafter's
own probabilities are a poor word for that: a confident MTP layer's first
guess is kept more often than its probability says and its second guess
less (EAGLE-2's raw scores spent a copy head's nodes on siblings: 0.88x a
chain's tokens a verification), a weak head's second guess may be worth a
deeper node. So a node's score is the rate at which nodes like it were
kept: the same depth, the same rank among its siblings (the drafter's
first, second, ... guess) and the same bin of the drafter's probability for
it (bins finer near 0 and 1: a copy head's 0.999 and 0.9 are kept at
very different rates), counted against the target's own greedy choices. A path's score is the
product of its nodes' rates: the chance the whole path is kept, so the
tree of the ``budget`` best nodes is the one with the longest expected
accepted length the drafter's candidates allow. Until a cell has counts
the rate of its rank and bin over every depth stands in, and until that
has counts the bin's middle probability (``PRIOR`` pseudo-counts each):
a deep cell fills slowly, and a head's first steps should not wait for it.

The counting needs nothing from the verifier: trees are drafted for greedy
rows only, and a greedy row's next tokens are the target's choices however
they were emitted, so a row's last tree is walked against its context at
the row's next proposal (``settle``). The table is ``DEPTHS * RANKS * BINS``
floats, looked up on the device (``cells``): nothing vocabulary-sized.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

DEPTHS = 4  # depths 1, 2, 3, and 4 and deeper
RANKS = 8  # a tree's width is at most 8 (--spec-tree-width)
# The drafter's probability: bin i holds [EDGES[i], EDGES[i + 1]).
EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.85, 0.95, 0.99, 0.999)
BINS = len(EDGES)
PRIOR = 2.0  # pseudo-counts of the bin's middle probability in each cell


def cells(logprobs: mx.array, depth: int) -> mx.array:
    """The table cells of ``[..., width]`` children at ``depth`` (1: the
    root's), likeliest first as ``top_children`` gives them."""
    width = logprobs.shape[-1]
    p = mx.exp(logprobs.astype(mx.float32))[..., None]
    bins = (p >= mx.array(EDGES[1:])).astype(mx.int32).sum(axis=-1)
    ranks = mx.arange(width, dtype=mx.int32) * BINS
    return (min(depth, DEPTHS) - 1) * RANKS * BINS + ranks + bins


class KeptRates:
    """One drafter's kept rates by (depth, rank, probability bin), and the
    trees its rows drafted last, waiting to be counted."""

    def __init__(self):
        self.tried = np.zeros(DEPTHS * RANKS * BINS)
        self.kept = np.zeros(DEPTHS * RANKS * BINS)
        self._log_rates = None
        self._drafted: dict = {}  # uid -> (context length, tokens, parents, cells)

    def log_rates(self) -> mx.array:
        """``[DEPTHS * RANKS * BINS]`` log kept rates, on the device."""
        if self._log_rates is None:
            middle = np.diff(EDGES + (1.0,)) / 2 + EDGES
            tried, kept = (a.reshape(DEPTHS, RANKS, BINS) for a in (self.tried, self.kept))
            pooled = (kept.sum(0) + PRIOR * middle) / (tried.sum(0) + PRIOR)  # every depth
            rates = ((kept + PRIOR * pooled) / (tried + PRIOR)).reshape(-1)
            self._log_rates = mx.array(np.log(rates).astype(np.float32))
        return self._log_rates

    def drafted(self, uid: int, context_len: int, tree) -> None:
        """Row ``uid`` drafted ``tree`` (``draft_tree.Tree``: its tokens,
        parents as input positions and cells) from a context of
        ``context_len`` tokens, its pending one last."""
        self._drafted[uid] = (context_len, tree.tokens, tree.parents, tree.cells)

    def settle(self, uids: Sequence[int], contexts: Sequence) -> None:
        """Count each row's last tree against the tokens its context gained
        since (the target's choices from the tree's root on)."""
        for uid, context in zip(uids, contexts):
            last = self._drafted.get(uid)
            if last is None or len(context) <= last[0]:
                continue
            start, tokens, parents, node_cells = self._drafted.pop(uid)
            tried = walk(tokens, parents, node_cells, context[start:start + len(tokens) + 1])
            self.count([c for c, _ in tried], [kept for _, kept in tried])

    def count(self, tried: Sequence[int], kept: Sequence[bool]) -> None:
        """Nodes of these cells were tried, and these of them kept."""
        np.add.at(self.tried, tried, 1)
        np.add.at(self.kept, tried, kept)
        self._log_rates = None

    def forget(self, uid: int) -> None:
        self._drafted.pop(uid, None)


def walk(tokens: Sequence[int], parents: Sequence[int], node_cells: Sequence[int],
         chosen: Sequence[int]) -> list:
    """``(cell, kept)`` of every node a greedy verification tried: the
    root's children, then the children of each node kept, down the path of
    the target's ``chosen`` tokens."""
    out = []
    at = 0  # the input position of the last kept node (0: the root)
    for target in chosen:
        children = [j for j, p in enumerate(parents) if p == at]
        out += [(node_cells[j], tokens[j] == target) for j in children]
        match = next((j for j in children if tokens[j] == target), None)
        if match is None:
            break
        at = match + 1
    return out
