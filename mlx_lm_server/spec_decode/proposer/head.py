"""A learned head drafts from the target's hidden states: an MTP layer or an EAGLE-3 head.

Both turn a pair (f_t, x_{t+1}), the target's features at position t and the
token that followed, into a guess at x_{t+2}, and chained on their own
output state and draft they guess further. The features are the target's
final hidden state for an MTP layer (``heads/mtp.py``), the concatenated
outputs of three of its layers for EAGLE-3 (``heads/eagle3.py``); the engine
captures whichever the proposer asks for (``hidden_layers``). The head keeps
its own batched KV cache, one entry per pair, and that cache holds only
pairs built from the target's features, never the head's own:

- the engine hands over the target's features of every token that entered
  the target's cache, from the passes it runs anyway (a plain step: the
  token it fed; a verification: the pending token and the drafts kept),
  through ``observe_target``; they wait per row until the next proposal;
- a proposal feeds each row's waiting pairs as one block (the tokens that
  followed them are the row's latest context, the pending token last), and
  drafts the first token from the block's last position; each further draft
  feeds the head's own (state, draft) pair;
- those chained entries are dropped before anything else happens to the
  cache (the next proposal, or the verification's report): the kept drafts
  come back as target pairs. So the cache always equals a fresh pass of the
  head over the target's pairs, which a test checks.

The prompt's features come from mlx-lm's own prefill (the capture routes
them, ``HiddenCapture.on_prefill``), and wait for a row's first proposal.
A row with more than ``CATCH_UP`` pairs waiting then (a long prompt, or a
row the controller kept off for a while) restarts its head cache over the
last ``CATCH_UP`` of them: a probe pays for every pair it feeds, and the
head's attention depends only on relative positions. So no row keeps more
than the last ``2 * CATCH_UP`` pairs waiting, copied out of the pass they
came from: a prompt's features (3 x 4096 floats a position for an 8B
model's EAGLE-3 head) are not held for the row's life.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from ...decoding.sampling import DRAFT_STREAM, SamplingParams, request_key
from ...kv import keep_rows, make_rollbackable, rollback
from ..drafts import PLACEHOLDER_TOKEN, ProposalResult
from .base import ModelDrafter
from .draft_sampling import draft_tokens, stack_q
from .draft_tree import expand, feed_depth, grown_depth, grows_trees, trees
from .node_scores import KeptRates

# A row with more pairs waiting than this at a proposal (a prompt, or a row
# the controller kept off for a while) restarts its head cache over the last
# ones instead: feeding them all made a probe at B=8 cost 2.5 plain steps on
# a CPU (the prompt's pairs through the head's layer), and the head's
# attention depends only on relative positions.
CATCH_UP = 64


class HeadProposer(ModelDrafter):
    """``--spec-decode mtp`` and ``eagle3`` (see the module). ``head(embeddings,
    features, cache)`` gives the head's states; ``to_logits(states)`` logits
    over the target's vocabulary; ``hidden_layers``: the target decoder
    layers whose outputs are the features (None: its final hidden state);
    ``tree_width``: children a node of a greedy batch's tree of drafts
    keeps (``draft_tree.py``; 1: chains)."""

    needs_hidden = True

    def __init__(self, head, embed, to_logits, hidden_layers: Optional[list] = None,
                 tree_width: int = 1):
        self.head = head
        self.embed = embed
        self.project = to_logits
        self.hidden_layers = hidden_layers
        self.tree_width = tree_width
        self.rates = KeptRates()  # what its tree nodes' chances of being kept were
        self.cache: Optional[list] = None
        self.uids: list[int] = []  # row order of self.cache
        self.waiting: dict[int, list] = {}  # uid -> target hidden states [T, H], in order
        self.waiting_len: dict[int, int] = {}  # uid -> positions in its waiting list
        self.lapsed: set[int] = set()  # rows whose waiting pairs lost their oldest
        self.chained = 0  # entries of the head's own drafts at every row's end
        self._keys: dict[int, Optional[mx.array]] = {}
        self._params: dict[int, SamplingParams] = {}

    @property
    def draft_model(self):
        """The head: its cache counts against the KV budget."""
        return self.head

    # ---- sequence bookkeeping ----------------------------------------------

    def add_sequence(self, uid: int, prompt_len: int, params: Optional[SamplingParams] = None) -> None:
        params = params or SamplingParams(temperature=0.0)
        self._params[uid] = params
        self._keys[uid] = request_key(params, DRAFT_STREAM)
        self.waiting[uid], self.waiting_len[uid] = [], 0

    def remove_sequence(self, uid: int) -> None:
        self._params.pop(uid, None)
        self._keys.pop(uid, None)
        self.waiting.pop(uid, None)
        self.waiting_len.pop(uid, None)
        self.lapsed.discard(uid)
        self.rates.forget(uid)
        if uid in self.uids:
            self._keep_rows([j for j, u in enumerate(self.uids) if u != uid])

    def holds(self, uid: int) -> bool:
        return uid in self.uids

    def forget_lagging(self, uids, contexts) -> None:
        """Nothing to forget: waiting pairs are bounded (``CATCH_UP``)."""

    def observe_target(self, uids: Sequence[int], hidden: Optional[mx.array],
                       kept: Sequence[int]) -> None:
        """Row i of the last target pass kept ``hidden[i, :kept[i]]``: the
        hidden states of the tokens that entered its cache, in order. None:
        the pass gave none, so the rows' pairs would no longer be contiguous;
        they start afresh from the next pass."""
        if hidden is None:
            gone = set(uids)
            for uid in gone & self.waiting.keys():
                self.waiting[uid], self.waiting_len[uid] = [], 0
            self._keep_rows([j for j, u in enumerate(self.uids) if u not in gone])
            return
        for i, (uid, n) in enumerate(zip(uids, kept)):
            waiting = self.waiting.get(uid)
            if waiting is None or n <= 0:
                continue
            waiting.append(hidden[i, :n])
            self.waiting_len[uid] += n
            if n > CATCH_UP or self.waiting_len[uid] > 2 * CATCH_UP:
                self._lapse(uid, prefill=n > CATCH_UP)

    def _lapse(self, uid: int, prefill: bool = False) -> None:
        """Keep only the row's last ``CATCH_UP`` waiting pairs, as a copy (a
        slice would hold the whole pass's features); its head cache starts
        afresh at its next proposal. A prompt's copy is computed now, without
        waiting for it (the prefill's buffers go as soon as it is)."""
        waiting = self.waiting[uid]
        hidden = mx.concatenate(waiting) if len(waiting) > 1 else waiting[0]
        tail = mx.contiguous(hidden[-CATCH_UP:])
        if prefill:
            mx.async_eval(tail)
        self.waiting[uid], self.waiting_len[uid] = [tail], CATCH_UP
        self.lapsed.add(uid)

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep only these cache rows, in this order."""
        self.cache = keep_rows(self.cache, keep, len(self.uids))
        self.uids = [self.uids[i] for i in keep]

    def _drop_chained(self) -> None:
        if self.chained and self.cache is not None:
            rollback(self.cache, [self.chained] * len(self.uids))
        self.chained = 0

    def observe_verification(self, uids, num_accepted) -> None:
        self._drop_chained()

    # ---- drafting ----------------------------------------------------------

    def _pairs(self, uid: int, context) -> tuple[mx.array, list[int]]:
        """The row's waiting pairs: hidden states [m, H] and the m tokens that
        followed them (the context's last m, the pending token last)."""
        waiting = self.waiting[uid]
        hidden = mx.concatenate(waiting) if len(waiting) > 1 else waiting[0]
        m = self.waiting_len[uid]
        self.waiting[uid], self.waiting_len[uid] = [], 0
        return hidden, list(context[len(context) - m:])

    def _feed_held(self, rows: list[int], pairs: list) -> mx.array:
        """The held rows' blocks, right-padded, through the head and its cache
        (padding rolled back): each row's last head state [R, H]."""
        width = max(p[0].shape[0] for p in pairs)
        hidden = mx.stack([mx.pad(h, [(0, width - h.shape[0]), (0, 0)]) for h, _ in pairs])
        tokens = mx.array([t + [t[-1]] * (width - len(t)) for _, t in pairs])
        states = self.head(self.embed(tokens), hidden, self.cache)
        last = mx.array([len(t) - 1 for _, t in pairs])
        rollback(self.cache, [width - len(t) for _, t in pairs])
        return states[mx.arange(len(rows)), last]

    def _feed_new(self, pairs: list) -> tuple[list, mx.array]:
        """Newcomers' blocks, left-padded, into a cache of their own: (that
        cache, each row's last head state [N, H])."""
        width = max(p[0].shape[0] for p in pairs)
        pad = [width - len(t) for _, t in pairs]
        hidden = mx.stack([mx.pad(h, [(d, 0), (0, 0)]) for d, (h, _) in zip(pad, pairs)])
        tokens = mx.array([[0] * d + t for d, (_, t) in zip(pad, pairs)])
        cache = [BatchKVCache(pad) for _ in self.head.layers]
        states = self.head(self.embed(tokens), hidden, cache)
        return cache, states[:, -1]

    def propose(self, uids, contexts, k) -> ProposalResult:
        self._drop_chained()
        self.rates.settle(uids, contexts)
        B, K = len(uids), max(k, default=0)
        ready = [i for i in range(B) if self.waiting.get(uids[i])]
        if K == 0 or not ready:
            return ProposalResult.from_lists([[] for _ in uids], K)
        states = self._feed(uids, contexts, ready)
        return self._draft(uids, contexts, ready, k, K, states)

    def _restart_long_waits(self, uids) -> set:
        """Rows with more than ``CATCH_UP`` pairs waiting keep only the last
        ``CATCH_UP``, and leave the cache to start afresh over them."""
        for uid in uids:
            if self.waiting_len.get(uid, 0) > CATCH_UP:
                self._lapse(uid)
        long = self.lapsed.intersection(uids)
        self.lapsed -= long
        return long

    def _feed(self, uids, contexts, ready: list[int]) -> Optional[mx.array]:
        """The ready rows' waiting pairs into the cache, whose rows then are
        the ready rows in batch order (rows that cannot draft this step leave
        it, and start afresh): each row's last head state [R, H]."""
        ready_uids = [uids[i] for i in ready]
        ready_set = set(ready_uids) - self._restart_long_waits(ready_uids)
        self._keep_rows([j for j, u in enumerate(self.uids) if u in ready_set])
        held = [i for i in ready if self.holds(uids[i])]
        new = [i for i in ready if not self.holds(uids[i])]
        parts, order = [], []
        if held:
            held_uids = [uids[i] for i in held]
            self._keep_rows([self.uids.index(u) for u in held_uids])
            parts.append(self._feed_held(held, [self._pairs(uids[i], contexts[i]) for i in held]))
            order += held_uids
        if new:
            cache, states = self._feed_new([self._pairs(uids[i], contexts[i]) for i in new])
            if self.cache is None:
                self.cache = make_rollbackable(cache)
            else:
                for c, n in zip(self.cache, cache):
                    c.extend(n)
            parts.append(states)
            order += [uids[i] for i in new]
        self.uids = order
        states = None if parts[0] is None else \
            mx.concatenate(parts) if len(parts) > 1 else parts[0]
        if order != ready_uids:  # newcomers interleaved with held rows
            perm = [order.index(u) for u in ready_uids]
            self._keep_rows(perm)
            states = None if states is None else states[mx.array(perm)]
        return states

    def _draft(self, uids, contexts, ready: list[int], k, K: int,
               states: mx.array) -> ProposalResult:
        """K drafts per ready row: the first from ``states`` (their blocks'
        last head states), each further one from the head's own pair."""
        params = [self._params.get(u, SamplingParams(temperature=0.0)) for u in self.uids]
        if self.tree_width > 1 and K > 1 and all(p.greedy for p in params) \
                and grows_trees(self.head, self.cache):
            return self._draft_tree(uids, contexts, ready, k, K, states)
        drafts, qs = [], []
        for j in range(K):
            logits = self.project(states)
            tokens, q_rows = draft_tokens(logits, params, self._keys, self.uids)
            drafts.append(tokens)
            qs.append(q_rows)
            if j < K - 1:
                states = self.head(self.embed(tokens[:, None]), states[:, None], self.cache)[:, 0]
                self.chained += 1
        return self._result(uids, ready, k, K, drafts, qs, logits.shape[-1])

    def _draft_tree(self, uids, contexts, ready: list[int], k, K: int,
                    states: mx.array) -> ProposalResult:
        """Each ready row's tree of up to ``k`` drafts (``draft_tree.expand``,
        a depth's nodes through ``_feed_depth``, ``grown_depth`` deep)."""
        depth = grown_depth(K, self.tree_width, self.tree_depth)
        grown = trees(expand(states, self.project, self._feed_depth, self.tree_width, depth,
                             self.rates.log_rates()), [min(k[i], K) for i in ready])
        rows = [([], [])] * len(uids)
        for i, tree in zip(ready, grown):
            rows[i] = tree
            self.rates.drafted(uids[i], len(contexts[i]), tree)
        return ProposalResult.from_trees(rows, K)

    def _feed_depth(self, tokens: mx.array, parent_states: mx.array, ancestors: mx.array,
                    d: int) -> mx.array:
        """One depth's nodes of every row's tree through the head, each fed
        its parent's state, as a chain's drafts are."""
        self.chained += tokens.shape[1]
        return feed_depth(self.head, self.cache, lambda: self.head(
            self.embed(tokens), parent_states, self.cache), tokens, ancestors, d)

    def _result(self, uids, ready: list[int], k, K: int, drafts: list, qs: list,
                vocab: int) -> ProposalResult:
        """The batch's proposal from the ready rows' drafts [R] and q rows per
        draft position (other rows: none)."""
        draft = mx.stack(drafts, axis=1).astype(mx.int32)
        mx.eval(draft)
        out = np.full((len(uids), K), PLACEHOLDER_TOKEN, dtype=np.int32)
        out[ready] = np.array(draft)
        lengths = np.zeros(len(uids), dtype=np.int32)
        lengths[ready] = [min(k[i], K) for i in ready]
        out[np.arange(K)[None, :] >= lengths[:, None]] = PLACEHOLDER_TOKEN
        q = stack_q(qs, vocab)
        if q is not None and len(ready) < len(uids):
            full = mx.zeros((len(uids),) + q.shape[1:], q.dtype)
            full[mx.array(ready)] = q
            q = full
        return ProposalResult(out, lengths, q)

    def propose_rows(self, rows: list[int], uids, contexts, k) -> ProposalResult:
        """Drafts for ``rows`` of the batch only (``mixed.py``); the others get none."""
        chosen = set(rows)
        return self.propose(uids, contexts, [k[i] if i in chosen else 0 for i in range(len(uids))])

    def stats(self) -> dict:
        return {"rows_in_head_cache": len(self.uids)}
