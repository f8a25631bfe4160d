"""Decide which draft tokens to keep, for the whole batch at once.

Glossary (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; p is the target distribution, q the draft's):

- draft tokens d_1..d_k: the proposer's guesses for the next k tokens;
- accepted tokens: the longest prefix of the drafts the verifier keeps;
- recovered token: drawn at the first rejected position, from p with the
  rejected draft's mass removed (``norm(max(0, p - q))``);
- bonus token: drawn from p after the last draft when every draft was kept.

Every function here is pure over arrays and returns a fixed-shape output
``[B, k + 1]``: the accepted drafts, then the recovered or bonus token, then
``PLACEHOLDER_TOKEN``. ``parse_output`` turns it into ragged lists.

An n-gram draft is deterministic, i.e. a one-hot q. With one-hot q the
acceptance probability min(1, p(t)/q(t)) is p(t), and the residual is p with t
removed, renormalised: exact at any temperature.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .proposer.base import PLACEHOLDER_TOKEN


def assemble_output(
    draft: mx.array,  # [B, K] int32
    num_accepted: mx.array,  # [B] int32
    final_token: mx.array,  # [B] int32: recovered or bonus token
) -> mx.array:
    """[B, K+1]: accepted drafts, the final token, then placeholders."""
    B, K = draft.shape
    pos = mx.arange(K + 1)[None, :]
    n = num_accepted[:, None]
    padded = mx.concatenate([draft, mx.full((B, 1), PLACEHOLDER_TOKEN, mx.int32)], axis=1)
    out = mx.where(pos < n, padded, mx.full(padded.shape, PLACEHOLDER_TOKEN, mx.int32))
    return mx.where(pos == n, final_token[:, None].astype(mx.int32), out)


def valid_mask(draft: mx.array, num_drafts: mx.array) -> mx.array:
    return mx.arange(draft.shape[1])[None, :] < num_drafts[:, None]


def accepted_prefix(accept: mx.array) -> mx.array:
    """[B, K] bool -> [B] length of the all-true prefix (the cumulative-product mask)."""
    return mx.cumprod(accept.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)


def greedy_verify(
    target_ids: mx.array,  # [B, K+1] the target's argmax after (last, d_1..d_j)
    draft: mx.array,  # [B, K]
    num_drafts: mx.array,  # [B]
) -> tuple[mx.array, mx.array]:
    """Keep drafts while they equal the target's own greedy choice: lossless at temperature 0."""
    match = (draft == target_ids[:, :-1]) & valid_mask(draft, num_drafts)
    n = accepted_prefix(match)
    final = mx.take_along_axis(target_ids, n[:, None], axis=1)[:, 0]
    return assemble_output(draft, n, final), n


def threshold_verify(
    target_ids: mx.array,  # [B, K+1] the token the target itself would emit
    draft_target_probs: mx.array,  # [B, K] p(d_j) under the target
    draft: mx.array,  # [B, K]
    num_drafts: mx.array,  # [B]
    threshold: float,
) -> tuple[mx.array, mx.array]:
    """Lossy: also keep a draft the target finds at least ``threshold`` likely."""
    match = ((draft == target_ids[:, :-1]) | (draft_target_probs >= threshold)) & valid_mask(
        draft, num_drafts
    )
    n = accepted_prefix(match)
    final = mx.take_along_axis(target_ids, n[:, None], axis=1)[:, 0]
    return assemble_output(draft, n, final), n


def rejection_verify_onehot(
    target_probs: mx.array,  # [B, K+1, V] p at each position
    draft: mx.array,  # [B, K]
    num_drafts: mx.array,  # [B]
    uniforms: mx.array,  # [B, K] in [0, 1)
    gumbels: mx.array,  # [B, V] standard Gumbel noise for the final draw
) -> tuple[mx.array, mx.array]:
    """Exact rejection sampling of deterministic drafts.

    Accept d_j with probability p_j(d_j) (``u < p``); at the first rejection
    draw from p without d_j, renormalised; if all are kept, draw the bonus from
    p after the last draft. The final draw is Gumbel-max over log-probabilities.
    """
    B, K = draft.shape
    safe_draft = mx.maximum(draft, 0)
    p_draft = mx.take_along_axis(target_probs[:, :K, :], safe_draft[..., None], axis=2)[..., 0]
    n = accepted_prefix((uniforms < p_draft) & valid_mask(draft, num_drafts))

    p_n = mx.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0, :]  # [B, V]
    padded = mx.concatenate([safe_draft, mx.zeros((B, 1), mx.int32)], axis=1)
    d_n = mx.take_along_axis(padded, n[:, None], axis=1)  # [B, 1]
    rejected = (n < num_drafts)[:, None]
    remove = (mx.arange(p_n.shape[1])[None, :] == d_n) & rejected
    residual = mx.where(remove, 0.0, p_n)
    # Rounding can leave no mass when p put (almost) all of it on the draft.
    empty = residual.sum(axis=1, keepdims=True) <= 0
    residual = mx.where(empty, p_n, residual)
    final = mx.argmax(mx.log(residual) + gumbels, axis=1).astype(mx.int32)
    return assemble_output(draft, n, final), n


def parse_output(output) -> list[list[int]]:
    """[B, K+1] padded output -> the tokens each sequence emits."""
    rows = np.asarray(output)
    return [[int(t) for t in row if t != PLACEHOLDER_TOKEN] for row in rows]
