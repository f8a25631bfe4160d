"""The rejection sampler: which draft tokens to keep, for the whole batch at once.

Glossary (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; p is the target distribution, q the draft's):

- p: what the target samples from at each position of the pass over
  ``[pending, d_1..d_k]``, after the row's processors, grammar and sampling
  filters (made by ``target_probs.py``);
- q: what the proposer drew each draft from; one-hot for a deterministic
  draft (n-gram, greedy draft model);
- draft tokens d_1..d_k: the proposer's guesses for the next k tokens;
- accepted tokens: the longest prefix of the drafts the verifier keeps;
- recovered token: drawn at the first rejected position, from p with the
  rejected draft's mass removed (``norm(max(0, p - q))``);
- bonus token: drawn from p after the last draft when every draft was kept.

Every function here but ``verify_rows`` is pure over arrays and returns a
fixed-shape output ``[B, k + 1]``: the accepted drafts, then the recovered or
bonus token, then ``PLACEHOLDER_TOKEN``. ``verify_rows`` is the one entry for
a batch's rows, chains or trees: it has ``target_probs.py`` make p and the
rows' random draws, judges with the pure functions here or a tree's
(``tree_verdict.py``), and returns one ``Verdict`` (output, accepted, path).

With one-hot q the acceptance probability min(1, p(t)/q(t)) is p(t), and the
residual is p with t removed, renormalised: exact at any temperature.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .drafts import PLACEHOLDER_TOKEN
from .target_probs import sampled_targets, threshold_targets
from .tree_verdict import Verdict, greedy_tree_verify, tree_rejection_sample


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


def rejection_sample(
    target_probs: mx.array,  # [B, K+1, V] p at each position
    draft: mx.array,  # [B, K] int32
    num_drafts: mx.array,  # [B]
    uniforms: mx.array,  # [B, K] in [0, 1)
    gumbels: mx.array,  # [B, V] standard Gumbel noise for the final draw
    draft_probs: Optional[mx.array] = None,  # [B, K, V] q; None: one-hot (deterministic) drafts
    greedy: Optional[mx.array] = None,  # [B] bool: rows verified by exact match
) -> tuple[mx.array, mx.array]:
    """Exact rejection sampling of drafts (see the module glossary).

    Keep d_j with probability min(1, p_j(d_j) / q_j(d_j)) (one-hot q: p_j(d_j));
    at the first rejection draw from norm(max(0, p_j - q_j)) (one-hot q: p
    without d_j); if all are kept, draw the bonus from p after the last
    draft. The final draw is Gumbel-max over log-probabilities.
    """
    B, K = draft.shape
    safe = mx.maximum(draft, 0)
    p_d = mx.take_along_axis(target_probs[:, :K], safe[..., None], axis=2)[..., 0]
    if draft_probs is None:
        accept = uniforms < p_d
    else:
        q_d = mx.take_along_axis(draft_probs, safe[..., None], axis=2)[..., 0]
        # u < p/q without dividing: q(t) = 0 (a draft q could not have produced)
        # accepts only where p(t) > 0, and u = 0 never accepts a token p rules out.
        accept = (uniforms * q_d < p_d) & (p_d > 0)
        accept = mx.where(mx.isnan(p_d) | mx.isnan(q_d), False, accept)
    argmax_p = mx.argmax(target_probs, axis=-1).astype(mx.int32)  # [B, K+1]
    if greedy is not None:
        accept = mx.where(greedy[:, None], draft == argmax_p[:, :K], accept)
    n = accepted_prefix(accept & valid_mask(draft, num_drafts))

    p_n = mx.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = (n < num_drafts)[:, None]
    if draft_probs is None:
        padded = mx.concatenate([safe, mx.zeros((B, 1), mx.int32)], axis=1)
        d_n = mx.take_along_axis(padded, n[:, None], axis=1)  # [B, 1]
        remove = (mx.arange(p_n.shape[1])[None, :] == d_n) & rejected
        residual = mx.where(remove, 0.0, p_n)
    else:
        q_padded = mx.concatenate([draft_probs, mx.zeros_like(draft_probs[:, :1])], axis=1)
        q_n = mx.take_along_axis(q_padded, n[:, None, None], axis=1)[:, 0]
        residual = mx.where(rejected, mx.maximum(p_n - q_n, 0.0), p_n)
    # p == q (or p all on the draft) leaves no residual mass, rounding too: fall back to p.
    residual = mx.where(residual.sum(axis=1, keepdims=True) <= 0, p_n, residual)
    final = mx.argmax(mx.log(residual) + gumbels, axis=1).astype(mx.int32)
    if greedy is not None:
        final = mx.where(greedy, mx.take_along_axis(argmax_p, n[:, None], axis=1)[:, 0], final)
    return assemble_output(draft, n, final), n


def fit_vocab(q: mx.array, V: int) -> mx.array:
    """The draft's vocabulary axis padded or cut to the target's logits width."""
    if q.shape[-1] == V:
        return q
    if q.shape[-1] > V:
        return q[..., :V]
    return mx.concatenate([q, mx.zeros(q.shape[:-1] + (V - q.shape[-1],), q.dtype)], axis=-1)


def verify_rows(rows: list, logits, draft, num_drafts, draft_probs=None, *, tree=None,
                parents=None, mode: str = "lossless", max_k: int,
                threshold: float = 0.0) -> Verdict:
    """The verdict on one pass for the rows of a batch (each with its
    ``params`` and ``key``), chains or trees (``tree``: the pass's
    ``TreeLayout``, ``parents [B, N]`` its links; None: chains).
    ``logits``: [B, K+1, V] after the rows' processors and grammar masks;
    p, the rows' filters and draws are made from them by ``target_probs.py``.
    Greedy rows keep the longest run (a tree: root path) of the target's own
    choices; sampled rows are judged by rejection sampling, a chain's drafts
    against their q (one-hot: deterministic drafts), a tree's children one-hot
    in rank order (``tree_verdict.py``). ``mode``: "greedy" (argmax only),
    "threshold" (lossy, chains only, asked for by name) or anything else
    (lossless). ``max_k`` fixes the shape of a row's draws
    (``sampled_targets``)."""
    B, K1, V = logits.shape
    K = K1 - 1
    # Upstream's greedy step takes the argmax of log-probabilities; the
    # shift by logsumexp keeps the order (it can only round a near-tie
    # into a tie), so the raw logits give the same choice without
    # normalising [B, K+1, V].
    greedy_ids = mx.argmax(logits, axis=-1).astype(mx.int32)  # [B, K+1]
    if mode == "threshold":
        assert tree is None, "threshold verification drafts chains (tree_step.chain_rows)"
        target_ids, probs = threshold_targets(rows, logits, greedy_ids, max_k)
        p_draft = mx.take_along_axis(probs[:, :K], mx.maximum(draft, 0)[..., None], axis=2)[..., 0]
        return Verdict(*threshold_verify(target_ids, p_draft, draft, num_drafts, threshold))
    parents = None if tree is None else mx.array(parents)
    verdict = (Verdict(*greedy_verify(greedy_ids, draft, num_drafts)) if tree is None
               else greedy_tree_verify(greedy_ids, draft, parents, tree))
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if mode == "greedy" or not sampled:
        return verdict
    probs, uniforms, gumbels = sampled_targets(rows, sampled, logits, max_k)
    idx = mx.array(sampled)
    if tree is None:
        q = None if draft_probs is None else fit_vocab(draft_probs[idx][:, :K], V)
        part = Verdict(*rejection_sample(probs, draft[idx], num_drafts[idx], uniforms, gumbels,
                                         q))
    else:
        part = tree_rejection_sample(probs, draft[idx], parents[idx], tree.rows(sampled),
                                     uniforms, gumbels)
    return merge_rows(verdict, part, sampled)


def merge_rows(verdict: Verdict, part: Verdict, rows: list) -> Verdict:
    """``verdict`` with the verdicts of ``rows`` replaced by ``part``'s (the
    sampled rows' beside the greedy ones), placeholders past a shorter output."""
    B = verdict.num_accepted.shape[0]
    idx = mx.array(rows)
    on = mx.zeros((B,), mx.bool_)
    on[idx] = True
    width = min(verdict.output.shape[1], part.output.shape[1])
    out = mx.full(verdict.output.shape, PLACEHOLDER_TOKEN, mx.int32)
    out[idx, :width] = part.output[:, :width]
    n = mx.zeros_like(verdict.num_accepted)
    n[idx] = part.num_accepted
    path = verdict.path
    if path is not None:  # past a row's own depth its path repeats its last entry
        D = part.path.shape[1]
        theirs = mx.concatenate([part.path, mx.repeat(part.path[:, -1:], path.shape[1] - D, 1)],
                                axis=1) if D < path.shape[1] else part.path[:, : path.shape[1]]
        full = mx.zeros_like(path)
        full[idx] = theirs
        path = mx.where(on[:, None], full, path)
    return Verdict(mx.where(on[:, None], out, verdict.output),
                   mx.where(on, n, verdict.num_accepted), path)
