"""A block drafter: ``--spec-decode dflash`` drafts K tokens in one pass.

The rows, their waiting target states and their cache are kept as for the
learned heads (``head.py``): the engine hands the target's states of every
token that entered its cache, a proposal feeds each row's waiting states
(here as context only, ``DFlashHead.context``), newcomers in a left-padded
pass of their own. Drafting is one pass of the block [pending, MASK * K]
per batch (``DFlashHead.block``), whose entries are rolled back at once: the
cache never holds a draft, so a verification needs nothing from this
proposer but the states of the tokens it kept.

At T > 0 each position's token is drawn from that position's distribution
after the request's sampling filters; that q goes to the rejection sampler,
so the output keeps the target's distribution (the drafts of one block do
not condition on each other: q_j is still the distribution x_{n+j} was
drawn from).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from ...decoding.sampling import SamplingParams
from ...kv import rollback
from .draft_sampling import draft_tokens
from .head import HeadProposer


class DFlashProposer(HeadProposer):
    """``head``: a ``DFlashHead``; ``embed`` the token embedding its block
    reads, ``to_logits`` the target's output projection; ``hidden_layers``
    the target decoder layers whose outputs are its context."""

    def _feed_held(self, rows, pairs) -> None:
        width = max(h.shape[0] for h, _ in pairs)
        hidden = mx.stack([mx.pad(h, [(0, width - h.shape[0]), (0, 0)]) for h, _ in pairs])
        self.head.context(hidden, self.cache)
        rollback(self.cache, [width - h.shape[0] for h, _ in pairs])

    def _feed_new(self, pairs) -> tuple[list, None]:
        width = max(h.shape[0] for h, _ in pairs)
        pad = [width - h.shape[0] for h, _ in pairs]
        hidden = mx.stack([mx.pad(h, [(d, 0), (0, 0)]) for d, (h, _) in zip(pad, pairs)])
        cache = [BatchKVCache(pad) for _ in self.head.layers]
        self.head.context(hidden, cache)
        return cache, None

    def _draft(self, uids, contexts, ready, k, K, states):
        K = min(K, self.head.block_size - 1)
        mask = self.head.mask_token_id
        block = mx.array([[contexts[i][-1]] + [mask] * K for i in ready])
        out = self.head.block(self.embed(block), self.cache)
        rollback(self.cache, [K + 1] * len(ready))
        params = [self._params.get(u, SamplingParams(temperature=0.0)) for u in self.uids]
        drafts, qs = [], []
        for j in range(1, K + 1):
            logits = self.project(out[:, j])
            tokens, q_rows = draft_tokens(logits, params, self._keys, self.uids)
            drafts.append(tokens)
            qs.append(q_rows)
        return self._result(uids, ready, k, K, drafts, qs, logits.shape[-1])
