"""Drafting from a model's logits: the token each row drafts, and its q.

Shared by the proposers that run a model (a draft model, an MTP head): greedy
rows draft the argmax (verified by exact match, no q); sampled rows draw from
q, the drafter's distribution after the request's own temperature, top-p,
top-k and min-p, from the row's own random stream when it is seeded, and q
goes to the rejection sampler, which keeps the target's distribution.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ...decoding.sampling import SamplingParams, sampling_logits


def draft_tokens(logits: mx.array, params: Sequence[SamplingParams], keys: dict,
                 uids: Sequence[int]) -> tuple[mx.array, list]:
    """Draft tokens [B] from logits [B, V] and each row's q [V] (None for
    greedy rows); ``keys[uid]`` (a seeded row's stream) is advanced in place."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = mx.argmax(logprobs, axis=-1)
    q_rows, sampled = [], []
    for i, p in enumerate(params):
        if p.greedy or not p.speculable:  # the latter is never verified: no drafts
            q_rows.append(None)
            continue
        z = sampling_logits(p, logprobs[i])
        key = keys.get(uids[i])
        if key is not None:
            key, sub = mx.random.split(key)
            keys[uids[i]] = key
            sampled.append((i, mx.random.categorical(z, key=sub)))
        else:
            sampled.append((i, mx.random.categorical(z)))
        q_rows.append(mx.softmax(z, axis=-1))
    if sampled:
        idx = mx.array([i for i, _ in sampled])
        tokens[idx] = mx.stack([t for _, t in sampled]).astype(tokens.dtype)
    return tokens, q_rows


def stack_q(qs: list, vocab: int) -> Optional[mx.array]:
    """[B, K, V] from ``qs[j][i]`` (draft position j, row i), zeros for greedy
    rows (verified by exact match: their q is unused); None if no row samples."""
    if not qs or all(q is None for q in qs[0]):
        return None
    K, B = len(qs), len(qs[0])
    rows = [mx.zeros((K, vocab)) if qs[0][i] is None else mx.stack([qs[j][i] for j in range(K)])
            for i in range(B)]
    return mx.stack(rows)
