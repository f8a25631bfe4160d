"""Suffix proposer: drafts from the request itself and from earlier requests' outputs.

Prompt lookup (``ngram.py``) sees only the request's own text. Many requests
to one server do similar work whose outputs resemble *earlier outputs*: the
same JSON keys record after record, the same tool-call scaffolding every
turn, one docstring style function after function. After SuffixDecoding
(Arctic Inference), this proposer keeps two indexes:

- per request, the n-gram index of prompt lookup over its prompt and output,
  so it never loses to ``ngram`` where the output copies its input;
- one global index over the outputs of finished requests: for every context
  of ``MIN_ORDER`` to ``MAX_ORDER`` tokens, how often each next token
  followed it.

The global draft is greedy over those counts: at each position the longest
context that was seen picks the most frequent next token, and drafting stops
once the product of the picks' frequencies (the draft's estimated chance of
being right so far) falls below ``min_probability``, or at ``alpha`` times
the length of the first match: a weak match drafts little. Evidence from
other requests is scored and bounded, never trusted outright; drafts never
change what is emitted (verification decides), only how fast.

With a tree width W above 1 the draft is a tree of drafts (``tree.py``;
SuffixDecoding's speculation tree): at every node the index offers its W
most frequent next tokens, not only the first, and the request's own W
latest continuations (``NGramIndex.propose_paths``) grow in the same tree;
nodes are taken best first by the same running probability, within the k
nodes a chain would take (``SuffixIndex.tree``). Width 1 is the chain.

Memory is bounded by ``max_tokens`` indexed tokens (oldest requests leave
first): about ``(MAX_ORDER - MIN_ORDER + 1)`` table entries per token.
Proposing costs O(orders x k) dictionary lookups per row, whatever the
index holds.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Optional, Sequence

from ..drafts import ProposalResult
from .ngram import NGramProposer

MIN_ORDER = 2
MAX_ORDER = 6
# In a tree, the chance that the request's own continuation goes on where
# it has one (``best_first``'s decay a depth); the index's offers share the
# rest. Where the request's match is shorter than ``ngram_max`` the two split
# a node evenly (there the chain drafts the index's where it expects more).
OWN_TRUST = 0.8
SHORT_MATCH_SHARE = 0.5


class _Next:
    """Counts of the tokens that followed one context, and the most frequent."""

    __slots__ = ("total", "best", "best_count", "counts")

    def __init__(self):
        self.total = 0
        self.best = -1
        self.best_count = 0
        self.counts: dict[int, int] = {}

    def add(self, token: int, n: int) -> None:
        c = self.counts.get(token, 0) + n
        self.total += n
        if c > 0:
            self.counts[token] = c
        else:
            self.counts.pop(token, None)
        if c > self.best_count:
            self.best, self.best_count = token, c
        elif token == self.best:  # the best lost counts (eviction): find the new one
            self.best, self.best_count = max(self.counts.items(), key=lambda kv: kv[1],
                                             default=(-1, 0))


def _ranked(entry: _Next, width: int) -> list:
    """The ``width`` most frequent next tokens and their counts: the chain's
    pick (``best``, the first to reach the top count) first, then by count
    (ties by token id, so a tree does not depend on the table's order)."""
    if width <= 1:
        return [(entry.best, entry.best_count)]
    others = heapq.nsmallest(width - 1, ((-c, t) for t, c in entry.counts.items()
                                         if t != entry.best))
    return [(entry.best, entry.best_count)] + [(t, -c) for c, t in others]


class SuffixIndex:
    """Next-token counts over many token sequences, bounded by tokens held."""

    def __init__(self, max_tokens: int, min_order: int = MIN_ORDER,
                 max_order: int = MAX_ORDER):
        self.max_tokens = max_tokens
        self.min_order = min_order
        self.max_order = max_order
        self.tokens_held = 0
        self._table: dict[tuple, _Next] = {}
        self._sequences: deque = deque()

    def __len__(self) -> int:
        return len(self._table)

    def add(self, tokens: Sequence[int]) -> None:
        """Index one sequence (a finished request's output); the oldest
        sequences leave while more than ``max_tokens`` are held."""
        tokens = list(tokens)[-self.max_tokens:] if self.max_tokens > 0 else []
        if len(tokens) <= self.min_order:
            return
        self._count(tokens, +1)
        self._sequences.append(tokens)
        self.tokens_held += len(tokens)
        while self.tokens_held > self.max_tokens:
            old = self._sequences.popleft()
            self._count(old, -1)
            self.tokens_held -= len(old)

    def _count(self, tokens: list, n: int) -> None:
        table = self._table
        for i in range(self.min_order, len(tokens)):
            nxt = tokens[i]
            for order in range(self.min_order, min(self.max_order, i) + 1):
                key = tuple(tokens[i - order:i])
                entry = table.get(key)
                if entry is None:
                    entry = table[key] = _Next()
                entry.add(nxt, n)
                if entry.total <= 0:
                    del table[key]

    def _lookup(self, tail: list) -> tuple[Optional[_Next], int]:
        """The entry of the longest context ending ``tail`` that was seen, and its order."""
        for order in range(min(self.max_order, len(tail)), self.min_order - 1, -1):
            entry = self._table.get(tuple(tail[-order:]))
            if entry is not None:
                return entry, order
        return None, 0

    def draft(self, context: Sequence[int], k: int, min_probability: float,
              alpha: float) -> tuple[list[int], float]:
        """Up to ``k`` tokens continuing ``context``, and their expected
        number of accepted tokens (the sum of the running probabilities)."""
        tail = list(context[-self.max_order:])
        entry, match = self._lookup(tail)
        if entry is None:
            return [], 0.0
        limit = min(k, max(1, int(alpha * match)))
        draft, p, expected = [], 1.0, 0.0
        while entry is not None and len(draft) < limit:
            p *= entry.best_count / entry.total
            if p < min_probability:
                break
            draft.append(entry.best)
            expected += p
            tail.append(entry.best)
            entry, _ = self._lookup(tail[-self.max_order:])
        return draft, expected

    def tree(self, context: Sequence[int], k: int, min_probability: float, alpha: float,
             width: int, paths: Sequence = (), weights: Sequence = (),
             trust: float = OWN_TRUST, share: float = OWN_TRUST) -> tuple[list, list, list, int]:
        """The ``k`` likeliest continuations of ``context`` as one tree
        (SuffixDecoding's speculation tree), grown around the request's own
        continuations ``paths`` (prompt lookup's, likeliest first, with
        ``weights``): ``(tokens, parents, probs, num_from_index)`` in tree
        order, ``parents`` as ``tree.py`` lays them out.

        A node's probability is the product of its picks' chances along the
        path, the chain's running probability. At a node the index offers
        its ``width`` most frequent next tokens, each at its frequency; where
        the request's own paths go on, they take ``share`` of the chance,
        divided by their weights, and the index the rest (where the index
        has nothing, an own path decays by ``trust`` a depth, as
        ``best_first``'s). Each
        node keeps its ``width`` likeliest offers; nodes are taken likeliest
        first, while at least ``min_probability``, the index's no deeper
        than its chain may go. A child is never likelier than its parent,
        so parents come first, and siblings come by rank. Without paths and
        with ``width`` 1 this is ``draft``'s chain, node for node."""
        own = _trie(paths, weights)
        tail = list(context[-self.max_order:])
        entry, match = self._lookup(tail)
        if entry is None and not own[0]:
            return [], [], [], 0
        limit = min(k, max(1, int(alpha * match))) if entry is not None else 0
        tokens, parents, probs, depths, num_from_index = [], [], [], [0], 0
        frontier: list = []  # heap of (-p, pushed, parent position, token, its tail, own node)
        pushed = 0

        def offer(p_parent: float, position: int, tail: list, node) -> None:
            nonlocal pushed
            own_next = own[node] if node is not None else {}
            entry = self._lookup(tail)[0] if depths[position] < limit else None
            for token, q in _offers(own_next, entry, width,
                                    trust if entry is None else share):
                p = p_parent * q
                if p >= min_probability:
                    child = own_next[token][0] if token in own_next else None
                    heapq.heappush(frontier, (-p, pushed, position, token, tail, child))
                    pushed += 1

        offer(1.0, 0, tail, 0)
        while frontier and len(tokens) < k:
            neg_p, _, parent, token, tail, node = heapq.heappop(frontier)
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg_p)
            depths.append(depths[parent] + 1)
            num_from_index += node is None
            offer(-neg_p, len(tokens), (tail + [token])[-self.max_order:], node)
        return tokens, parents, probs, num_from_index


def _trie(paths: Sequence, weights: Sequence) -> list:
    """The trie of ``paths``: per node, ``{token: [child node, weight of the
    paths through it]}``; node 0 is the root."""
    nodes: list = [{}]
    for path, w in zip(paths, weights):
        at = 0
        for t in path:
            child = nodes[at].setdefault(int(t), [len(nodes), 0.0])
            if child[0] == len(nodes):
                nodes.append({})
            child[1] += w
            at = child[0]
    return nodes


def _offers(own_next: dict, entry: Optional[_Next], width: int, own_share: float) -> list:
    """A node's ``width`` likeliest next tokens and their chances: the
    request's own continuations divide ``own_share`` by weight, the index's
    most frequent the rest by count (all of it where the request has none).
    Ties keep the own paths' order, then the index's rank."""
    share = own_share if own_next else 0.0
    total = sum(w for _, w in own_next.values())
    q = {t: share * w / total for t, (_, w) in own_next.items()}
    if entry is not None:
        for t, count in _ranked(entry, width):
            q[t] = q.get(t, 0.0) + (1 - share) * count / entry.total
    return heapq.nlargest(width, q.items(), key=lambda tq: tq[1])


class SuffixProposer(NGramProposer):
    """Prompt lookup within the request (``NGramProposer``), else the global
    index's draft. With ``tree_width`` W above 1, one tree of both: the
    request's W latest continuations and, at every node, the index's W most
    frequent next tokens (``SuffixIndex.tree``)."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, prompt_lookup: bool = True,
                 max_tokens: int = 32768, index_prompts: bool = False,
                 min_probability: float = 0.1, alpha: float = 4.0, tree_width: int = 1):
        super().__init__(ngram_min, ngram_max, prompt_lookup, tree_paths=tree_width)
        self.index_prompts = index_prompts
        self.min_probability = min_probability
        self.alpha = alpha
        self.index = SuffixIndex(max_tokens)
        self._prompt_lens: dict[int, int] = {}
        # Drafts taken from the global index, and in all (metrics).
        self.global_drafts = 0
        self.drafts = 0

    def add_sequence(self, uid: int, prompt_len: int, params=None) -> None:
        super().add_sequence(uid, prompt_len, params)
        self._prompt_lens[uid] = prompt_len

    def remove_sequence(self, uid: int) -> None:
        """The request's output (and prompt, if asked) joins the global index."""
        own = self._indices.pop(uid, None)
        prompt_len = self._prompt_lens.pop(uid, 0)
        if own is not None:
            self.index.add(own.tokens[0 if self.index_prompts else prompt_len:])

    def propose(self, uids, contexts, k) -> ProposalResult:
        trees = [self._propose_row(uid, context, k_i)
                 for uid, context, k_i in zip(uids, contexts, k)]
        return ProposalResult.from_trees(trees, max(k, default=0))

    def _propose_row(self, uid: int, context, k: int) -> tuple[list, list]:
        own = self._synced(uid, context)
        paths, weights = own.propose_paths(k, self.tree_width)
        if self.tree_width > 1:  # this step's width (``tree_step.TreeChoice``)
            share = OWN_TRUST if own.match >= own.ngram_max else SHORT_MATCH_SHARE
            tokens, parents, _, num_from_index = self.index.tree(
                own.tokens, k, self.min_probability, self.alpha, self.tree_width, paths, weights,
                share=share)
            return self._tally((tokens, parents), num_from_index > 0)
        mine = paths[0] if paths else []
        if k <= 0 or (mine and own.match >= own.ngram_max):
            return self._tally((mine, list(range(len(mine)))), False)
        theirs, expected = self.index.draft(own.tokens, k, self.min_probability, self.alpha)
        # A shorter match in the request's own text still copies it; the
        # global draft wins where it expects more tokens kept than a
        # prompt-lookup draft's one likely token.
        if theirs and (not mine or expected > 1.0):
            return self._tally((theirs, list(range(len(theirs)))), True)
        return self._tally((mine, list(range(len(mine)))), False)

    def stats(self) -> dict:
        return {"drafts": self.drafts, "drafts_from_index": self.global_drafts,
                "index_tokens": self.index.tokens_held, "index_entries": len(self.index)}

    def _tally(self, draft: tuple[list, list], from_index: bool) -> tuple[list, list]:
        if draft[0]:
            self.drafts += 1
            self.global_drafts += from_index
        return draft
