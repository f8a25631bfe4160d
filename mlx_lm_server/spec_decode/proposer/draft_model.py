"""Draft-model proposer: a small model with the target's tokenizer drafts k tokens.

The draft keeps its own batched KV cache (its own layers and heads; never a
copy of the target's) whose rows follow the target's generation batch:

- a sequence that joins is prefilled on the draft lazily, at its first
  proposal, then merged into the batch;
- a sequence that leaves is filtered out;
- tokens the target fed without the draft (plain steps, or the last draft of a
  fully accepted run, which the draft sampled but never fed) are the row's
  *lag*, fed in front of the pending token at the next proposal;
- after verification each row rolls back to exactly the drafts it kept, with
  the same per-row mechanism as the target (``RaggedKVCache``).

Drafts are sampled from q, the draft's distribution after the request's own
temperature, top-p, top-k and min-p, and q is returned for the rejection
sampler. Greedy requests draft the argmax, or with a tree width above 1 a
tree of the draft's likeliest continuations (``draft_tree.py``, SpecExec's
search): its nodes leave the cache at the verification, and the kept ones
come back as lag at the next proposal (a few tokens in a block fed anyway,
where moving the kept path into place would cost a gather in every layer).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load

from ...decoding.sampling import DRAFT_STREAM, SamplingParams, request_key
from ...kv import (
    batch_caches,
    cannot_speculate,
    keep_rows,
    make_rollbackable,
    recurrent,
    rollback,
)
from ...runtime import mlx_lm_adapter
from ..drafts import PLACEHOLDER_TOKEN, ProposalResult
from ..tree import chain_parents
from .base import ModelDrafter
from .draft_sampling import draft_tokens, stack_q
from .draft_tree import expand, feed_depth, grown_depth, grows_trees, trees
from .node_scores import KeptRates

PREFILL_CHUNK = 512

# A row whose draft cache lags the target by more tokens than this (it took
# other drafts for a while, ``mixed.py``) may be prefilled again instead.
LAG_LIMIT = 32


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose token ids would mean something else to the target.

    The target decides every token: a draft id is only ever a guess that the
    target's own distribution keeps or refuses, so what a draft cannot change
    is the output, and what this check protects is that its guesses are worth
    verifying. It needs the same token for every id (else nearly every draft
    is refused, or an id lies outside the target's vocabulary). Special ids
    are not compared: which ids end a sequence or begin one is the target's
    business (its stop ids end generation; the prompt is the target's
    encoding), so families that share a vocabulary but list different
    end-of-sequence ids (Qwen2.5 and Qwen3.5) can draft for each other.
    """
    problems = []
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(tv) != len(dv):
        problems.append(f"vocabulary sizes differ ({len(tv)} vs {len(dv)})")
    else:
        diff = [t for t, i in tv.items() if dv.get(t) != i]
        if diff:
            problems.append(f"{len(diff)} tokens have different ids (e.g. {diff[:3]})")
    if problems:
        raise ValueError(
            f"draft model {draft_name} cannot draft for {target_name}: " + "; ".join(problems)
        )


class DraftModelProposer(ModelDrafter):
    def __init__(self, model, max_context: Optional[int] = None, tree_width: int = 1):
        self.model = model
        self.tree_width = tree_width  # children a node of a greedy batch's tree keeps
        self._tree_entries = 0  # the last proposal's tree nodes in every row's cache
        self.rates = KeptRates()  # what its tree nodes' chances of being kept were
        # The draft's own context length: a sequence that outgrows it (a long
        # prompt the target takes) is drafted for no more, and its row leaves
        # the draft cache; the target decodes it plainly.
        self.max_context = max_context
        self.cache: Optional[list] = None
        self.uids: list[int] = []  # row order of self.cache
        self.fed: dict[int, int] = {}  # tokens of each sequence in the draft cache
        self._keys: dict[int, Optional[mx.array]] = {}
        self._params: dict[int, SamplingParams] = {}
        self._states: list = []  # recurrent states after each draft of the last proposal

    @property
    def draft_model(self):
        return self.model

    # ---- sequence bookkeeping ----------------------------------------------

    def add_sequence(self, uid: int, prompt_len: int, params: Optional[SamplingParams] = None) -> None:
        params = params or SamplingParams(temperature=0.0)
        self._params[uid] = params
        self._keys[uid] = request_key(params, DRAFT_STREAM)

    def remove_sequence(self, uid: int) -> None:
        self._params.pop(uid, None)
        self._keys.pop(uid, None)
        self.fed.pop(uid, None)
        self.rates.forget(uid)
        if uid in self.uids:  # its cache row goes now, not at the next proposal
            self._keep_rows([j for j, u in enumerate(self.uids) if u != uid])

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep only these cache rows, in this order."""
        self.cache = keep_rows(self.cache, keep, len(self.uids))
        self.uids = [self.uids[i] for i in keep]

    def _prefill(self, prompts: list[list[int]]) -> list:
        """One left-padded batched prefill of the newcomers, in chunks."""
        width = max(len(p) for p in prompts)
        pad = [width - len(p) for p in prompts]
        cache = batch_caches(self.model, pad)
        tokens = mx.array([[0] * d + list(p) for d, p in zip(pad, prompts)])
        for start in range(0, width, PREFILL_CHUNK):
            self.model(tokens[:, start : start + PREFILL_CHUNK], cache=cache)
            mx.eval([c.state for c in cache])
        for c in cache:
            c.finalize()
        return cache

    def _sync(self, uids: Sequence[int], contexts: Sequence[Sequence[int]]) -> None:
        """Make the cache rows equal ``uids``, in order, prefilling newcomers."""
        keep = [self.uids.index(u) for u in uids if self.holds(u)]
        new = [i for i, u in enumerate(uids) if not self.holds(u)]
        self._keep_rows(keep)
        if new:
            # Everything but the pending token, which the next forward feeds.
            merged = self._prefill([list(contexts[i][:-1]) for i in new])
            if self.cache is None:
                self.cache = make_rollbackable(merged)
            else:
                for c, m in zip(self.cache, merged):
                    c.extend(m)
            for i in new:
                self.uids.append(uids[i])
                self.fed[uids[i]] = len(contexts[i]) - 1
        if self.uids != list(uids):  # joins interleaved with leaves: reorder rows
            self._keep_rows([self.uids.index(u) for u in uids])

    def holds(self, uid: int) -> bool:
        """Whether the sequence has a row in the draft cache: drafting for it
        costs a catch-up at most, never a prefill of its context."""
        return uid in self.fed and uid in self.uids

    def forget_lagging(self, uids: Sequence[int], contexts: Sequence[Sequence[int]]) -> None:
        """Drop the cache rows that are cheaper to prefill again than to catch
        up: the catch-up feeds every row of the batch as wide as the longest
        lag (right-padded), a prefill only the row's own context."""
        for uid, context in zip(uids, contexts):
            fed = self.fed.get(uid)
            if fed is None:
                continue
            lag = len(context) - 1 - fed
            if lag > LAG_LIMIT and lag * len(uids) > len(context):
                del self.fed[uid]  # ``_sync`` drops its row and prefills it anew

    # ---- drafting ----------------------------------------------------------

    def propose(self, uids, contexts, k):
        B = len(uids)
        K = max(k, default=0)
        if B == 0 or K == 0:
            return ProposalResult.from_lists([[] for _ in uids], K)
        self.rates.settle(uids, contexts)
        fit = [i for i in range(B)
               if self.max_context is None or len(contexts[i]) + K <= self.max_context]
        if len(fit) < B:
            return self.propose_rows(fit, uids, contexts, k)
        self._sync(uids, contexts)
        params = [self._params.get(u, SamplingParams(temperature=0.0)) for u in uids]

        # First forward: each row's lag, then its pending token, right-padded.
        heads = [list(contexts[i][self.fed[u]:]) for i, u in enumerate(uids)]
        width = max(len(h) for h in heads)
        block = mx.array([h + [h[-1]] * (width - len(h)) for h in heads])
        recurrent.set_lengths(self.cache, [len(h) for h in heads])  # padding leaves no state
        logits = self.model(block, cache=self.cache)
        recurrent.set_lengths(self.cache, None)
        last = mx.array([len(h) - 1 for h in heads])
        logits = logits[mx.arange(B), last]
        self._rollback([width - len(h) for h in heads])
        for i, u in enumerate(uids):
            self.fed[u] += len(heads[i])

        if self.tree_width > 1 and K > 1 and all(p.greedy for p in params) \
                and grows_trees(self.model, self.cache):
            return self._propose_tree(uids, contexts, k, K, logits)
        drafts, qs = [], []
        # Recurrent states after 0..K-1 drafts: a rollback takes each row's own.
        self._states = [recurrent.snapshot(self.cache)]
        for j in range(K):
            tokens, q_rows = draft_tokens(logits, params, self._keys, self.uids)
            drafts.append(tokens)
            qs.append(q_rows)
            if j < K - 1:
                logits = self.model(tokens[:, None], cache=self.cache)[:, -1]
                self._states.append(recurrent.snapshot(self.cache))
        draft = mx.stack(drafts, axis=1).astype(mx.int32)  # [B, K]
        mx.eval(draft)
        draft_np = np.array(draft)
        lengths = np.array([min(kk, K) for kk in k], dtype=np.int32)
        draft_np[np.arange(K)[None, :] >= lengths[:, None]] = PLACEHOLDER_TOKEN
        for u in uids:
            self.fed[u] += K - 1
        self._last = (list(uids), K)

        q = stack_q(qs, logits.shape[-1])
        return ProposalResult(draft_np, lengths, q)

    def _propose_tree(self, uids, contexts, k, K: int, logits: mx.array) -> ProposalResult:
        """Every row's tree of up to ``k`` drafts grown from the logits at
        its pending token (``draft_tree.expand``)."""
        width = self.tree_width

        def feed(tokens, _states, ancestors, d):
            return feed_depth(self.model, self.cache,
                              lambda: self.model(tokens, cache=self.cache), tokens, ancestors, d)

        depth = grown_depth(K, width, self.tree_depth)
        grown = trees(expand(logits, lambda x: x, feed, width, depth, self.rates.log_rates()),
                      [min(n, K) for n in k])
        self._tree_entries = width * (depth - 1)
        for i, u in enumerate(uids):
            self.fed[u] += self._tree_entries
            self.rates.drafted(u, len(contexts[i]), grown[i])
        self._last = (list(uids), K)
        return ProposalResult.from_trees(grown, K)

    def propose_rows(self, rows: list[int], uids, contexts, k) -> ProposalResult:
        """Drafts for ``rows`` of the batch only; the others get none, and
        leave the draft cache (a later proposal prefills them again)."""
        K = max(k, default=0)
        part = self.propose([uids[i] for i in rows], [contexts[i] for i in rows],
                            [k[i] for i in rows])
        if not rows:
            self._last = ([], K)
        width = part.draft_tokens.shape[1]
        draft = np.full((len(uids), width), PLACEHOLDER_TOKEN, dtype=np.int32)
        lengths = np.zeros(len(uids), dtype=np.int32)
        draft[rows] = part.draft_tokens
        lengths[rows] = part.num_proposed
        q = parents = None
        if part.draft_probs is not None:
            q = mx.zeros((len(uids), width, part.draft_probs.shape[-1]))
            q[mx.array(rows)] = part.draft_probs
        if part.parents is not None:
            parents = chain_parents(len(uids), width)
            parents[rows] = part.parents
        return ProposalResult(draft, lengths, q, parents=parents)

    def _rollback(self, num_drop: Sequence[int]) -> None:
        if any(num_drop):
            rollback(self.cache, list(num_drop))

    def observe_verification(self, uids: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Keep exactly the drafts the target kept; remember a fed-by-target last draft."""
        last_uids, K = self._last
        if list(uids) != last_uids:  # rows past the draft's context were left out
            accepted = dict(zip(uids, num_accepted))
            num_accepted = [accepted[u] for u in last_uids]
            uids = last_uids
        if not uids:
            return
        if self._tree_entries:  # every node goes; the kept ones come back as lag
            self._rollback([self._tree_entries] * len(uids))
            for u in uids:
                self.fed[u] -= self._tree_entries
            self._tree_entries = 0
            return
        drops, kept = [], []
        for i, (u, n) in enumerate(zip(uids, num_accepted)):
            kept.append(min(n, K - 1))
            drops.append((K - 1) - kept[-1])
            self.fed[u] -= drops[-1]
        self._rollback(drops)
        if any(drops):
            recurrent.select(self.cache, self._states, kept)
        self._states = []
        # A fully accepted run's last draft is in the target's cache, not the
        # draft's: it becomes lag, picked up from the context next time.


def load_draft_proposer(path: str, target_tokenizer, target_path: str,
                        quantize_bits: Optional[int] = None,
                        tree_width: int = 1) -> DraftModelProposer:
    model, tokenizer = load(path)
    check_tokenizers(target_tokenizer, tokenizer, target_path, path)
    reason = cannot_speculate(model)
    if reason:
        raise ValueError(f"draft model {path} cannot draft: {reason}")
    if quantize_bits:
        nn.quantize(model, group_size=64, bits=quantize_bits)
        # Now, on this thread: lazy weights cannot be evaluated on the
        # inference thread (MLX streams belong to the thread that made them).
        mx.eval(model.parameters())
    return DraftModelProposer(model, context_length(model), tree_width)


def context_length(model) -> Optional[int]:
    """The draft's context length from its own arguments (None when unknown)."""
    value = getattr(mlx_lm_adapter.text_args(model), "max_position_embeddings", None)
    return int(value) if value else None
