"""Attention of a short multi-token pass from two matmuls, not a fused kernel.

On MLX's CUDA backend a fused attention over two or more queries is a cuDNN
graph built for every exact shape and stride it meets (batch, queries, keys,
mask): 86-144 ms a build on an H200, against a 15 ms verification step. A
speculating server meets a new shape whenever a row joins or leaves, k
changes or a key length crosses a bucket, so on the H200 the default server
ran chat at 16 clients at 0.43x ``--spec-decode none`` (BENCHMARKS.md), and
past 512 builds in a thread MLX raises "Cache thrashing" instead of
building. A verification's few queries (k + 1) make scores ``[B, H, k+1,
L]`` small: two matmuls and a softmax, whose kernels are built once, not
per shape. Prompts (long passes) keep the fused kernel, and so do one-token
steps (MLX's vector kernel, built once); on a CPU or a Mac nothing changes.
"""

from __future__ import annotations

import mlx.core as mx

# Passes of up to this many tokens a row (verifications, drafters' passes)
# attend through ``unfused_attention`` where fused kernels are built per shape.
MOST_UNFUSED_QUERIES = 64


def fused_attention_built_per_shape() -> bool:
    """Whether this process's fused attention builds a kernel per shape (CUDA)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def unfused_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` for ``queries [B, Hq, T, D]`` over
    ``keys``/``values [B, Hkv, L, D]`` (grouped query heads: Hq a multiple of
    Hkv); ``mask`` boolean (True: attend), additive (one for every head, or
    one per query head), ``"causal"`` or None. Products in the inputs' dtype
    and a precise softmax, as MLX's own fallback and upstream's quantized
    attention; the output in the queries' dtype."""
    B, n_q_heads, T, D = queries.shape
    n_kv_heads = keys.shape[1]
    repeats = n_q_heads // n_kv_heads
    q = queries * scale
    if repeats > 1:
        q = q.reshape(B, n_kv_heads, repeats, T, D)
        keys, values = keys[:, :, None], values[:, :, None]
    scores = q @ keys.swapaxes(-1, -2)
    if isinstance(mask, str):
        L = scores.shape[-1]
        mask = mx.arange(L - T, L)[:, None] >= mx.arange(L)[None]
    if mask is not None:
        if repeats > 1 and mask.ndim > 3:
            if mask.shape[-3] == n_q_heads:  # one per query head: grouped as the queries
                mask = mask.reshape(*mask.shape[:-3], n_kv_heads, repeats, *mask.shape[-2:])
            else:
                mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ values
    out = out.reshape(B, n_q_heads, T, -1) if repeats > 1 else out
    return out.astype(queries.dtype)
