"""Batched rejection sampling of drafts from a draft model: lossless at any temperature.

Glossary (Leviathan et al. 2023; Chen et al. 2023), p is the target's
distribution, q the draft's, both after the request's own sampling transforms:

- accepted token: draft d_j kept with probability min(1, p_j(d_j) / q_j(d_j));
- recovered token: at the first rejection, a draw from
  norm(max(0, p_j - q_j)), which makes the emitted token exactly p-distributed;
- bonus token: when all drafts are kept, a draw from p after the last draft.

``rejection_sample`` is a pure function over arrays, vectorised over batch and
positions, with the random draws passed in (uniforms for acceptance, Gumbel
noise for the final draw) so that tests can replay it draw for draw. Greedy
rows in the same batch are verified by exact match against argmax p.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .verifier import assemble_output, valid_mask, accepted_prefix


def rejection_sample(
    target_probs: mx.array,  # [B, K+1, V] p
    draft_probs: mx.array,  # [B, K, V] q
    draft: mx.array,  # [B, K] int32 drafts sampled from q
    num_drafts: mx.array,  # [B]
    uniforms: mx.array,  # [B, K] in [0, 1)
    gumbels: mx.array,  # [B, V] standard Gumbel noise
    greedy: Optional[mx.array] = None,  # [B] bool: rows verified by exact match
) -> tuple[mx.array, mx.array]:
    """Returns ``(output [B, K+1], num_accepted [B])``; see the module glossary."""
    B, K = draft.shape
    safe = mx.maximum(draft, 0)[..., None]
    p_d = mx.take_along_axis(target_probs[:, :K], safe, axis=2)[..., 0]
    q_d = mx.take_along_axis(draft_probs, safe, axis=2)[..., 0]
    # u < p/q without dividing: q(t) = 0 (a draft q could not have produced)
    # accepts only where p(t) > 0, and u = 0 never accepts a token p rules out.
    accept = (uniforms * q_d < p_d) & (p_d > 0)
    accept = mx.where(mx.isnan(p_d) | mx.isnan(q_d), False, accept)

    argmax_p = mx.argmax(target_probs, axis=-1).astype(mx.int32)  # [B, K+1]
    if greedy is not None:
        exact = draft == argmax_p[:, :K]
        accept = mx.where(greedy[:, None], exact, accept)
    n = accepted_prefix(accept & valid_mask(draft, num_drafts))

    p_n = mx.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_padded = mx.concatenate([draft_probs, mx.zeros_like(draft_probs[:, :1])], axis=1)
    q_n = mx.take_along_axis(q_padded, n[:, None, None], axis=1)[:, 0]
    rejected = (n < num_drafts)[:, None]
    residual = mx.where(rejected, mx.maximum(p_n - q_n, 0.0), p_n)
    # p == q leaves no residual mass (and rounding can do the same): fall back to p.
    residual = mx.where(residual.sum(axis=1, keepdims=True) <= 0, p_n, residual)
    final = mx.argmax(mx.log(residual) + gumbels, axis=1).astype(mx.int32)
    if greedy is not None:
        greedy_final = mx.take_along_axis(argmax_p, n[:, None], axis=1)[:, 0]
        final = mx.where(greedy, greedy_final, final)
    return assemble_output(draft, n, final), n


class BatchedRejectionSampler:
    """Draws the random inputs of ``rejection_sample`` from per-row keys.

    A row with a key (a request with a ``seed``) is reproducible whatever else
    shares its batch; rows without one draw from MLX's global generator.
    """

    def __call__(self, target_probs, draft_probs, draft, num_drafts, keys, greedy=None):
        B, K = draft.shape
        V = target_probs.shape[-1]
        uniforms, gumbels = [], []
        new_keys = []
        for key in keys:
            if key is None:
                uniforms.append(mx.random.uniform(shape=(K,)))
                gumbels.append(mx.random.gumbel(shape=(V,)))
                new_keys.append(None)
            else:
                key, k1, k2 = mx.random.split(key, 3)
                uniforms.append(mx.random.uniform(shape=(K,), key=k1))
                gumbels.append(mx.random.gumbel(shape=(V,), key=k2))
                new_keys.append(key)
        out = rejection_sample(target_probs, draft_probs, draft, num_drafts,
                               mx.stack(uniforms), mx.stack(gumbels), greedy)
        return out, new_keys
