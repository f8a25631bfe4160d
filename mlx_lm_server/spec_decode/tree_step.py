"""What a verification step does with trees of drafts (``tree.py``): which
rows may branch, how many nodes a tree keeps for what its pass costs, the
one verification pass over every row's drafts (chains and trees alike),
and the pass's outputs along the kept paths. The verdict is
``verifier.py``'s and the commit ``kv.commit``'s, chains and trees alike."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..kv import hold_trees, make_rollbackable, set_tree
from ..runtime import mlx_lm_adapter
from .drafts import PLACEHOLDER_TOKEN
from .proposer.draft_tree import holds_positions
from .tree import (
    TreeLayout,
    as_chains,
    cut_trees,
    expected_tokens,
    repeated_siblings,
    sibling_ranks,
)


def chain_rows(batch, rows: Sequence, sampled: bool, verify_mode: str) -> list:
    """The rows that draft chains although the proposer branched: a tree
    needs every layer to hold one (ragged attention) and to place each node
    at its depth (``holds_positions``: said once where a model cannot), a
    row without logits processors (whose context grows along one path) or
    grammar, and one-hot drafts under the lossless or greedy rule
    (``sampled``: the drafts carry a model's q). ``rows``: the engine's
    records. Asked before drafting too, so that these rows are asked for a
    chain's k, not a tree's budget."""
    every = list(range(len(rows)))
    if sampled or verify_mode == "threshold" \
            or not hold_trees(make_rollbackable(batch.prompt_cache)) \
            or not holds_positions(batch.model, "the target"):
        return every
    return [i for i, row in enumerate(rows) if row.processors or row.constraint is not None]


def shape_trees(batch, rows: Sequence, proposal, verify_mode: str,
                cost: Optional[Callable] = None) -> tuple:
    """The proposal's trees as the pass verifies them: cut to the node count
    expected to emit the most for what the pass costs, where ``cost(n)``
    prices a pass of n drafts a row and the proposer says how likely each
    node is kept (``priced_nodes``; a row whose source measured nothing, NaN
    in a merged proposal, is neither priced nor cut), and made chains where
    a row cannot branch (``chain_rows``). Returns ``(tokens, num, parents)``."""
    tokens, num, parents = proposal.draft_tokens, proposal.num_proposed.tolist(), proposal.parents
    if parents is None:  # chains: nothing to price or to make chains
        return tokens, num, None
    # The verdict takes a node's siblings for distinct tokens (every proposer dedupes).
    assert not repeated_siblings(tokens, parents, num), \
        f"rows {repeated_siblings(tokens, parents, num)} draft one token twice under one node"
    chances = proposal.chances
    if cost is not None and chances is not None and max(num, default=0) > 1:
        measured = [i for i, m in enumerate(num) if m and np.isfinite(chances[i, :m]).all()]
        n = measured and priced_nodes(chances[measured], [num[i] for i in measured], cost)
        if n and n < max(num[i] for i in measured):
            tokens, parents, num = tokens.copy(), parents.copy(), list(num)
            cut = cut_trees(tokens[measured], parents[measured], chances[measured],
                            [num[i] for i in measured], n)
            tokens[measured], parents[measured] = cut[0], cut[2]
            for i, m in zip(measured, cut[1]):
                num[i] = m
    return as_chains(tokens, parents, num,
                     chain_rows(batch, rows, proposal.draft_probs is not None, verify_mode))


def cut_chains(tokens: np.ndarray, num: Sequence[int], parents: Optional[np.ndarray],
               ks: Sequence[int]) -> tuple[np.ndarray, list]:
    """Every row that drafted a chain cut to ``ks[i]`` drafts (the
    controller's k: a node budget is for trees only). ``(tokens, num)``."""
    tokens, num = tokens.copy(), list(num)
    for i, n in enumerate(num):
        chain = parents is None or (parents[i, :n] == np.arange(n)).all()
        if chain and n > ks[i]:
            tokens[i, ks[i]:] = PLACEHOLDER_TOKEN
            num[i] = ks[i]
    return tokens, num


def priced_nodes(chances, num: Sequence[int], cost: Callable) -> Optional[int]:
    """The nodes a row (1 to the most drafted) whose pass emits the most
    expected tokens for its ``cost(n)`` (seconds, or plain steps); None
    while a pass's price is not known. On a GPU a wider pass costs little
    more and every node pays; on a CPU each node costs a share of a step
    and the unlikely ones are cut."""
    expected = expected_tokens(chances, num)
    best, best_rate = None, 0.0
    for n in range(1, max(num) + 1):
        c = cost(n)
        if c is None or c <= 0:
            return None
        if expected[n - 1] / c > best_rate:
            best, best_rate = n, expected[n - 1] / c
    return best


def verification_pass(model, inputs: mx.array, caches: list,
                      tree: Optional[TreeLayout]) -> mx.array:
    """The target over every row's drafts at once, ``[B, N+1, V]``: chains as
    the model runs them, a tree's nodes each attending to its ancestors
    (``set_tree``) at its depth (``node_positions``). The mask stays set
    for ``kv.commit`` (or the fault path) to clear; it is cleared here if the
    pass itself fails."""
    if tree is None:
        return model(inputs, cache=caches)
    depths = mlx_lm_adapter.node_positions(model)
    set_tree(caches, mx.array(tree.ancestors))
    depths[0] = mx.array(tree.depth)
    try:
        return model(inputs, cache=caches)
    except BaseException:
        set_tree(caches, None)
        raise
    finally:
        depths[0] = None


def along(x: mx.array, path: Optional[mx.array]) -> mx.array:
    """``x [B, N+1, ...]`` at a verdict's kept input positions ``path [B, D+1]``
    (None, a chain's: ``x`` as it is, its kept entries first already)."""
    return x if path is None else mx.take_along_axis(x, path[..., None], axis=1)


def kept_ranks(parents: Optional[np.ndarray], path: Optional[list],
               accepted: Sequence[int]) -> Optional[list]:
    """The kept drafts' ranks among their siblings (``sibling_ranks``), all
    rows, from a tree verdict's ``path`` (on the host, as every rank has it);
    None for chains."""
    if parents is None:
        return None
    return [r for i, n in enumerate(accepted)
            for r in sibling_ranks(parents[i].tolist(), [j - 1 for j in path[i][1:n + 1]])]


class TreeChoice:
    """Trees or chains, step by step, from what each emitted per second.

    A tree of k nodes catches a second guess where a chain of k goes deeper
    on the first: which pays depends on the drafter (a confident one is best
    as a chain), the text, and what the drafter's wider steps cost (nothing
    much on a GPU, ``width`` times a chain's on a CPU). So the server
    measures: blocks of ``BLOCK`` verification steps draft trees or chains,
    each block's tokens emitted over its steps' seconds (drafting and
    verifying) feed that arm's average, the better arm drafts, and one block
    in ``EXPLORE_EVERY`` goes to the other so that a change of traffic is
    seen. With speculation fixed (``--spec-decode-dynamic`` off) every step
    drafts trees of the configured width."""

    BLOCK = 16
    EXPLORE_EVERY = 8

    def __init__(self, width: int, fixed: bool):
        self.widest = width
        self.fixed = fixed or width == 1
        self.arm = width  # the block's width: trees first
        self.rate: dict = {}  # width -> tokens a second, averaged over its blocks
        self.blocks = 0
        self._tokens = self._seconds = 0.0
        self._steps = 0

    @property
    def width(self) -> int:
        return self.widest if self.fixed else self.arm

    def observe(self, tokens: int, seconds: float) -> None:
        """A verification step drafted at ``width`` emitted ``tokens`` in ``seconds``."""
        if self.fixed:
            return
        self._tokens += tokens
        self._seconds += seconds
        self._steps += 1
        if self._steps < self.BLOCK:
            return
        rate = self._tokens / max(self._seconds, 1e-9)
        before = self.rate.get(self.arm)
        self.rate[self.arm] = rate if before is None else 0.5 * (before + rate)
        self._tokens = self._seconds = 0.0
        self._steps = 0
        self.blocks += 1
        other = 1 if self.arm == self.widest else self.widest
        if other not in self.rate or self.blocks % self.EXPLORE_EVERY == 0:
            self.arm = other
        else:
            self.arm = max(self.rate, key=self.rate.get)
