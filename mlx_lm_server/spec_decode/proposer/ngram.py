"""Prompt lookup / n-gram proposer.

The longest suffix n-gram of the context (``ngram_max`` down to ``ngram_min``)
is looked up among earlier positions; the tokens that followed its most recent
earlier occurrence are the draft. Work that repeats its input (editing code,
reformatting, extraction) is predicted well, at no model cost.

Each sequence keeps an incremental index: for every n, a dict from n-gram to
the end of its most recent occurrence (and, for trees of drafts, a few
earlier ones: each continuation is a branch, ``tree.best_first``). A step inserts only the n-grams that end
at new positions, so proposing costs O(ngram_max + k) per sequence, not
O(context).
"""

from __future__ import annotations

from typing import Sequence

from ..drafts import ProposalResult
from ..tree import best_first
from .base import BaseProposer


class NGramIndex:
    """Most recent earlier occurrence of each n-gram of one token sequence."""

    def __init__(self, ngram_min: int, ngram_max: int, min_end: int = 0, earlier: int = 0):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        # Continuations must start at or after ``min_end`` (the prompt's end
        # when prompt lookup is off).
        self.min_end = min_end
        self.tokens: list[int] = []
        self._last_end: dict[int, dict[tuple, int]] = {
            n: {} for n in range(ngram_min, ngram_max + 1)
        }
        # Up to ``earlier`` ends before the most recent, oldest first (trees).
        self.earlier = earlier
        self._earlier_ends: dict[int, dict[tuple, list]] = {n: {} for n in self._last_end}
        # n-grams ending at positions < _indexed_to are in the index.
        self._indexed_to = 0
        self.match = 0  # the n of the last proposal's match (0: none)

    def sync(self, context: Sequence[int]) -> None:
        """Catch up with ``context``, which extends what was seen before."""
        seen = len(self.tokens)
        if len(context) < seen or (seen and context[seen - 1] != self.tokens[-1]):
            self.__init__(self.ngram_min, self.ngram_max, self.min_end, self.earlier)
            seen = 0
        self.tokens.extend(context[seen:])

    def _index_until(self, end: int) -> None:
        """Insert the n-grams ending at every position in [_indexed_to, end)."""
        toks = self.tokens
        for e in range(max(self._indexed_to, self.min_end), end):
            for n, table in self._last_end.items():
                if e >= n:
                    gram = tuple(toks[e - n : e])
                    if self.earlier and gram in table:
                        ends = self._earlier_ends[n].setdefault(gram, [])
                        ends.append(table[gram])
                        del ends[: -self.earlier]
                    table[gram] = e
        self._indexed_to = max(self._indexed_to, end)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens following the longest matching suffix n-gram."""
        L = len(self.tokens)
        if k <= 0 or L == 0:
            self.match = 0
            return []
        # Only occurrences ending strictly before L have a continuation.
        self._index_until(L)
        for n in range(min(self.ngram_max, L), self.ngram_min - 1, -1):
            e = self._last_end[n].get(tuple(self.tokens[L - n :]))
            if e is not None and e < L:
                self.match = n
                return continuation(self.tokens, e, k)
        self.match = 0
        return []


    def propose_paths(self, k: int, num_paths: int) -> tuple[list, list]:
        """Up to ``num_paths`` continuations of ``k`` tokens, likeliest first:
        the most recent occurrence of the longest matching n-gram (the
        chain ``propose`` drafts), its earlier occurrences, then shorter
        n-grams'; and a weight each (halving by rank, doubling by n)."""
        L = len(self.tokens)
        paths, weights, starts = [], [], set()
        if k <= 0 or L == 0:
            self.match = 0
            return paths, weights
        self._index_until(L)
        self.match = 0
        for n in range(min(self.ngram_max, L), self.ngram_min - 1, -1):
            gram = tuple(self.tokens[L - n :])
            e = self._last_end[n].get(gram)
            if e is None or e >= L:
                continue
            self.match = self.match or n
            for start in [e] + self._earlier_ends[n].get(gram, [])[::-1]:
                if start in starts:
                    continue
                starts.add(start)
                paths.append(continuation(self.tokens, start, k))
                weights.append(2.0 ** (n - self.match) * 0.5 ** len(weights))
                if len(paths) >= num_paths:
                    return paths, weights
        return paths, weights


def continuation(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start``, reading past the end into the draft itself.

    Copying from the draft continues a periodic pattern whose last period
    reaches the end of the context (for example "ab ab ab" -> "ab ab").
    """
    draft: list[int] = []
    L = len(tokens)
    for j in range(k):
        i = start + j
        draft.append(tokens[i] if i < L else draft[i - L])
    return draft


class NGramProposer(BaseProposer):
    cheap = True

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, prompt_lookup: bool = True,
                 tree_paths: int = 1):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.prompt_lookup = prompt_lookup
        # Continuations a row's tree may merge (1: a chain, as ``propose``
        # drafts it): the earlier ends an index keeps; ``tree_width`` those
        # the coming step merges.
        self.tree_paths = self.tree_width = tree_paths
        self._indices: dict[int, NGramIndex] = {}

    def add_sequence(self, uid: int, prompt_len: int, params=None) -> None:
        min_end = 0 if self.prompt_lookup else prompt_len
        self._indices[uid] = NGramIndex(self.ngram_min, self.ngram_max, min_end,
                                        self.tree_paths - 1)

    def remove_sequence(self, uid: int) -> None:
        self._indices.pop(uid, None)

    def _synced(self, uid: int, context) -> NGramIndex:
        """The row's index, caught up with ``context``."""
        index = self._indices.get(uid)
        if index is None:
            index = self._indices[uid] = NGramIndex(self.ngram_min, self.ngram_max,
                                                    earlier=self.tree_paths - 1)
        index.sync(context)
        return index

    def propose(self, uids, contexts, k) -> ProposalResult:
        if self.tree_width > 1:
            return ProposalResult.from_trees(
                [best_first(*self._synced(uid, context).propose_paths(k_i, self.tree_width), k_i)
                 for uid, context, k_i in zip(uids, contexts, k)], max(k, default=0))
        drafts = [self._synced(uid, context).propose(k_i)
                  for uid, context, k_i in zip(uids, contexts, k)]
        return ProposalResult.from_lists(drafts, max(k, default=0))
