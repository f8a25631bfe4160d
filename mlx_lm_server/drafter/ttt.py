"""Training-time test: an EAGLE-3 head unrolled K draft steps, as it drafts.

At inference the head sees, for a row at position t, the target's pairs up to
t in its cache, then its own chained entries (state, draft) at t+1, t+2, ...
Training it only on target pairs (teacher forcing) leaves it unprepared for
its own states; EAGLE-3 trains the unrolled steps instead. For a sequence of
N pairs (f_t, x_{t+1}), step 0 runs the head on every pair at once; step j
feeds, at every position t, the head's own state of step j-1 and the token
x_{t+1+j}, and attends to the step-0 keys of positions <= t plus its own
keys of steps 1..j at t (never another position's guesses): the attention
pattern of the head's cache during drafting. Step j's logits predict
x_{t+2+j}, scored against the target's distribution there.

Everything here is a pure function of arrays and the head's weights.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn


def _attend(attn, x: mx.array, keys: list, values: list, step: int,
            window: Optional[int] = None):
    """The head's attention for step ``step`` (queries at positions t + step)
    over the step-0 keys (causal; ``window``: only those of the last
    ``window`` positions up to t) and the diagonal keys of steps 1..step;
    appends this step's keys and values. Returns [B, N, H]."""
    B, N, _ = x.shape
    q = attn.q_proj(x).reshape(B, N, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q, offset=step), attn.rope(k, offset=step)
    keys.append(k)
    values.append(v)
    repeat = attn.n_heads // attn.n_kv_heads

    def heads(a):
        return mx.repeat(a, repeat, axis=1) if repeat > 1 else a

    causal = mx.tril(mx.ones((N, N), mx.bool_))
    if window is not None:
        causal = mx.triu(causal, k=1 - window)
    scores = [mx.where(causal, (q * attn.scale) @ heads(keys[0]).swapaxes(-1, -2), -mx.inf)]
    scores += [((q * attn.scale) * heads(kd)).sum(-1, keepdims=True) for kd in keys[1:]]
    weights = mx.softmax(mx.concatenate(scores, axis=-1).astype(mx.float32), axis=-1)
    weights = weights.astype(q.dtype)
    out = weights[..., :N] @ heads(values[0])
    for i, vd in enumerate(values[1:]):
        out = out + weights[..., N + i:N + i + 1] * heads(vd)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))


def unrolled_logits(head, embed: nn.Module, tokens: mx.array, features: mx.array,
                    steps: int, window: Optional[int] = None) -> list[mx.array]:
    """Draft-vocabulary logits [B, N, Dv] of steps 0..steps-1 for the pairs
    (features[:, t], tokens[:, t+1]), N = T - 1. Step j's input token at t is
    tokens[:, t+1+j] (0 past the end: those positions are masked in the loss).
    ``window``: each pair sees only the last ``window`` pairs up to it (as a
    row whose head cache restarted over them, ``spec_decode/proposer/head.py``)."""
    layer = head.layers[0]
    N = tokens.shape[1] - 1
    hidden = features[:, :N]
    if "input_norm" in head:
        hidden = head.input_norm(hidden)
    hidden = head.fc(hidden)
    keys, values, out = [], [], []
    for j in range(steps):
        ids = tokens[:, 1 + j:]
        ids = mx.pad(ids, [(0, 0), (0, N - ids.shape[1])])
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        x = mx.concatenate([layer.input_layernorm(embed(ids)), normed], axis=-1)
        h = residual + _attend(layer.self_attn, x, keys, values, j, window)
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        out.append(head.lm_head(head.norm(hidden)))
    return out


def ttt_loss(head, embed, tokens, features, target_logprobs, steps: int,
             mask=None) -> tuple[mx.array, mx.array]:
    """(mean soft cross-entropy over steps, per-step top-1 agreement [steps]).

    ``target_logprobs``: [B, T, Dv] the target's next-token log-probabilities
    restricted to the draft vocabulary and renormalised there; ``mask``
    [B, T] (1: a real token). Step j at pair t is scored against position
    t + 1 + j and counted only where that position and the pair's own are
    real."""
    B, T = tokens.shape
    N = T - 1
    mask = mx.ones((B, T)) if mask is None else mask.astype(mx.float32)
    logits = unrolled_logits(head, embed, tokens, features, steps)
    losses, agree = [], []
    for j, lg in enumerate(logits):
        n = N - j  # pairs whose target position t + 1 + j exists
        lp = nn.log_softmax(lg[:, :n].astype(mx.float32), axis=-1)
        target = target_logprobs[:, 1 + j:1 + j + n]
        valid = mask[:, :n] * mask[:, 1 + j:1 + j + n]
        count = mx.maximum(valid.sum(), 1.0)
        ce = -(mx.exp(target) * lp).sum(-1)
        losses.append((ce * valid).sum() / count)
        hit = (mx.argmax(lp, axis=-1) == mx.argmax(target, axis=-1)).astype(mx.float32)
        agree.append((hit * valid).sum() / count)
    return mx.mean(mx.stack(losses)), mx.stack(agree)


def accepted_lengths(head, embed, tokens, features, target_ids, draft_ids, steps: int,
                     mask=None, window: Optional[int] = None) -> mx.array:
    """Per pair, the number of consecutive steps (from 0) whose greedy draft
    (mapped to a target id through ``draft_ids``) equals the target's greedy
    token ``target_ids`` [B, T] (over its whole vocabulary), teacher-forced:
    [B, N - steps + 1] (the pairs where all steps are scored)."""
    N = tokens.shape[1] - 1
    n = N - steps + 1
    logits = unrolled_logits(head, embed, tokens, features, steps, window)
    run = mx.ones((tokens.shape[0], n), mx.int32)
    total = mx.zeros((tokens.shape[0], n), mx.int32)
    for j, lg in enumerate(logits):
        hit = draft_ids[mx.argmax(lg[:, :n], -1)] == target_ids[:, 1 + j:1 + j + n]
        if mask is not None:
            hit = hit & (mask[:, 1 + j:1 + j + n] > 0)
        run = run * hit.astype(mx.int32)
        total = total + run
    return total
