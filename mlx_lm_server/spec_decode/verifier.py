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
``PLACEHOLDER_TOKEN``.

An n-gram draft is deterministic, i.e. a one-hot q. With one-hot q the
acceptance probability min(1, p(t)/q(t)) is p(t), and the residual is p with t
removed, renormalised: exact at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import mlx.core as mx

from ..decoding.sampling import sampling_logits
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


@dataclass
class SampledRows:
    """The rows of a batch that sample (temperature > 0), with what verifying them needs."""

    rows: list  # [R] batch row indices
    target_probs: mx.array  # [R, K+1, V] p after each request's sampling filters
    uniforms: mx.array  # [R, K]
    gumbels: mx.array  # [R, V]
    draft_probs: Optional[mx.array] = None  # [R, K, V] q, None for one-hot drafts


def verify(
    target_ids: mx.array,  # [B, K+1] each row's greedy choice at each position
    draft: mx.array,  # [B, K]
    num_drafts: mx.array,  # [B]
    sampled: Optional[SampledRows] = None,
) -> tuple[mx.array, mx.array]:
    """The one lossless verification: greedy rows by exact match, sampled rows
    by rejection sampling (one-hot or full q). Returns ``(output [B, K+1],
    num_accepted [B])``; only sampled rows touch vocabulary-sized arrays."""
    out, n = greedy_verify(target_ids, draft, num_drafts)
    if sampled is None or not sampled.rows:
        return out, n
    idx = mx.array(sampled.rows)
    s_out, s_n = rejection_sample(sampled.target_probs, draft[idx], num_drafts[idx],
                                  sampled.uniforms, sampled.gumbels, sampled.draft_probs)
    is_sampled = mx.zeros(n.shape, mx.bool_)
    is_sampled[idx] = True
    full_out, full_n = mx.zeros_like(out), mx.zeros_like(n)
    full_out[idx] = s_out
    full_n[idx] = s_n
    return mx.where(is_sampled[:, None], full_out, out), mx.where(is_sampled, full_n, n)


_DISTRIBUTIONS = {"uniform": mx.random.uniform, "gumbel": mx.random.gumbel}


def draw_noise(keys: list, draws: list[tuple[str, tuple]]) -> tuple[list[mx.array], list]:
    """For each ``(distribution, shape)`` in ``draws``, one draw per row, stacked:
    ``[R, *shape]``.

    A row with a key (a request with a ``seed``) splits it once per draw, so
    its randomness depends on nothing else in the batch; all such rows draw
    at once (``vmap``: the numbers one row at a time would give). The rows
    without one draw together from MLX's global generator. Returns the draws
    and the rows' new keys.
    """
    seeded = [i for i, key in enumerate(keys) if key is not None]
    free = [i for i, key in enumerate(keys) if key is None]
    parts, new_keys = [], list(keys)
    if seeded:
        next_keys, *out = mx.vmap(partial(_split_and_draw, draws))(
            mx.stack([keys[i] for i in seeded]))
        for n, i in enumerate(seeded):
            new_keys[i] = next_keys[n]
        parts.append((seeded, out))
    if free:
        parts.append((free, [_DISTRIBUTIONS[d](shape=(len(free), *shape)) for d, shape in draws]))
    return [in_row_order([(rows, out[j]) for rows, out in parts]) for j in range(len(draws))], \
        new_keys


def _split_and_draw(draws: list, key: mx.array) -> tuple:
    out = []
    for distribution, shape in draws:
        key, sub = mx.random.split(key)
        out.append(_DISTRIBUTIONS[distribution](shape=shape, key=sub))
    return (key, *out)


def in_row_order(parts: list[tuple[list, mx.array]]) -> mx.array:
    """Arrays computed for groups of rows (``(row indices, [len, ...])``),
    stacked back in the order of the indices."""
    if len(parts) == 1:
        return parts[0][1]
    order = [i for rows, _ in parts for i in rows]
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return mx.concatenate([a for _, a in parts])[mx.array(inverse)]


# ---- the target's side of a verification pass --------------------------------
#
# What the pure functions above need from a pass over [pending, d_1..d_k]:
# each row's logits processors applied at every draft position, the sampling
# filters the row samples with, its random draws from its own key.


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities in float32 (sampling filters and probabilities need the precision)."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def fit_vocab(q: mx.array, V: int) -> mx.array:
    """The draft's vocabulary axis padded or cut to the target's logits width."""
    if q.shape[-1] == V:
        return q
    if q.shape[-1] > V:
        return q[..., :V]
    return mx.concatenate([q, mx.zeros(q.shape[:-1] + (V - q.shape[-1],), q.dtype)], axis=-1)


def process_logits(logits: mx.array, processors_of: list, contexts: list, draft_np) -> mx.array:
    """Logits after each row's logits processors (``processors_of``: a
    list per row; grammars are not among them: their masks are computed for
    all positions at once, see ``grammar.py``). Normalising is left to
    the rows and positions that need it (sampled rows, asked-for
    logprobs): at temperature 0 nothing vocabulary-sized is computed
    beyond the argmax."""
    if any(processors_of):
        rows = []
        for i, processors in enumerate(processors_of):
            if not processors:
                rows.append(logits[i])
                continue
            positions = []
            base = contexts[i].tolist()
            for j in range(logits.shape[1]):
                # The context grows by one draft token per position.
                ctx = mx.array(base + [int(t) for t in draft_np[i, :j]], dtype=mx.int32)
                row = logits[i, j][None]
                for p in processors:
                    row = p(ctx, row)
                positions.append(row[0])
            rows.append(mx.stack(positions))
        logits = mx.stack(rows)
    return logits


def row_noise(rows: list, draws: list) -> list:
    """Random draws for these rows (see ``draw_noise``), advancing their keys."""
    out, keys = draw_noise([r.key for r in rows], draws)
    for r, key in zip(rows, keys):
        r.key = key
    return out


def xtc_draws(rows: list, indices) -> dict:
    """Each XTC row's draw for the one token it samples this step (such
    rows never have drafts, so only their first position is used)."""
    out = {}
    for i in indices:
        if rows[i].params.xtc_probability > 0:
            (u,) = row_noise([rows[i]], [("uniform", (1,))])
            out[i] = u[0, 0]
    return out


def sampled_logits(rows: list, indices: list, logits: mx.array, xtc: dict) -> mx.array:
    """[R, K+1, V] the logits rows ``indices`` sample from (``sampling_logits``
    after ``log_softmax``). Rows that filter alike (temperature, top-p,
    min-p, top-k) go through the filters together; an XTC row, with its own
    draw, alone."""
    groups: dict = {}
    for i in indices:
        p = rows[i].params
        alike = ("xtc", i) if p.xtc_probability > 0 else (p.temperature, p.top_p, p.min_p,
                                                             p.top_k)
        groups.setdefault(alike, []).append(i)
    parts = []
    for members in groups.values():
        rows_logits = logits if members == list(range(logits.shape[0])) \
            else logits[mx.array(members)]
        parts.append((members, sampling_logits(rows[members[0]].params, log_softmax(rows_logits),
                                               xtc.get(members[0]))))
    order = {i: n for n, i in enumerate(indices)}
    return in_row_order([([order[i] for i in members], a) for members, a in parts])


def verify_rows(rows: list, logits, draft, num_drafts, draft_probs=None, *, mode: str = "lossless",
                max_k: int, threshold: float = 0.0):
    """The verdict on one pass for the rows of a batch (each with its
    ``params`` and ``key``): ``(output [B, K+1], num_accepted [B])``.
    ``mode``: "greedy" (argmax only), "threshold" (lossy, asked for by name)
    or anything else (lossless: rejection sampling for sampled rows).
    ``max_k`` fixes the shape of a row's draws (the most drafts a step can
    have), so a seeded row's randomness does not depend on its batch."""
    B, K1, V = logits.shape
    K = K1 - 1
    # Upstream's greedy step takes the argmax of log-probabilities; the
    # shift by logsumexp keeps the order (it can only round a near-tie
    # into a tie), so the raw logits give the same choice without
    # normalising [B, K+1, V].
    greedy_ids = mx.argmax(logits, axis=-1).astype(mx.int32)  # [B, K+1]
    if mode == "threshold":
        return _verify_threshold(rows, logits, greedy_ids, draft, num_drafts, max_k, threshold)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if mode == "greedy" or not sampled:
        return verify(greedy_ids, draft, num_drafts)
    probs = mx.softmax(sampled_logits(rows, sampled, logits, xtc_draws(rows, sampled)), axis=-1)
    uniforms, gumbels = row_noise([rows[i] for i in sampled],
                                  [("uniform", (max_k,)), ("gumbel", (V,))])
    q = None
    if draft_probs is not None:
        q = fit_vocab(draft_probs[mx.array(sampled)][:, :K], V)
    return verify(greedy_ids, draft, num_drafts,
                  SampledRows(sampled, probs, uniforms[:, :K], gumbels, q))


def _verify_threshold(rows, logits, greedy_ids, draft, num_drafts, max_k: int, threshold: float):
    """Lossy, asked for by name: a draft the target finds likely enough is
    kept. Greedy rows judge by the target's softmax, sampled rows by their
    sampling distribution, with their final token drawn from it."""
    K1, V = logits.shape[1:]
    K = K1 - 1
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    plain = [i for i, row in enumerate(rows) if row.params.greedy]
    parts_ids, parts_probs = [], []
    if plain:
        idx = mx.array(plain)
        parts_ids.append((plain, greedy_ids[idx]))
        parts_probs.append((plain, mx.softmax(logits[idx].astype(mx.float32), axis=-1)))
    if sampled:
        row_logits = sampled_logits(rows, sampled, logits, xtc_draws(rows, sampled))
        (g,) = row_noise([rows[i] for i in sampled], [("gumbel", (max_k + 1, V))])
        parts_ids.append((sampled, mx.argmax(row_logits + g[:, :K1], axis=-1).astype(mx.int32)))
        parts_probs.append((sampled, mx.softmax(row_logits, axis=-1)))
    probs = in_row_order(parts_probs)
    p_draft = mx.take_along_axis(probs[:, :K], mx.maximum(draft, 0)[..., None], axis=2)[..., 0]
    return threshold_verify(in_row_order(parts_ids), p_draft, draft, num_drafts, threshold)
