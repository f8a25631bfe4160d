"""Short passes' attention without the fused kernel (``kv/unfused.py``):
the same numbers as MLX's ``scaled_dot_product_attention`` for every mask
a pass brings (a ragged batch's boolean rows, additive, causal, none), with
grouped query heads and without; and only short passes of our ragged
caches take it, only where asked."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_server.kv.ragged import RaggedKVCache
from mlx_lm_server.kv.rows import RowEnds, row_mask
from mlx_lm_server.kv.unfused import MOST_UNFUSED_QUERIES, unfused_attention


def _qkv(B, n_q_heads, n_kv_heads, T, L, D=16, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((B, n_q_heads, T, D)), mx.random.normal((B, n_kv_heads, L, D)),
            mx.random.normal((B, n_kv_heads, L, D)))


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("mask_kind", ["rows", "additive", "per_head", "causal", "none"])
def test_the_same_attention_as_mlx_for_every_mask(heads, mask_kind):
    B, T, L = 3, 5, 40
    q, k, v = _qkv(B, *heads, T, L)
    scale = 16 ** -0.5
    # Rows ending at different positions with their own left padding, as a
    # ragged verification pass sees them.
    rows = row_mask([20, 31, 35], mx.array([0, 4, 9]), T, L)  # [B, 1, T, L]
    # A mask per query head (latent attention's position scores are one).
    per_head = mx.where(rows, 0.0, -1e9) + mx.random.normal((B, heads[0], T, L))
    mask = {"rows": rows, "additive": mx.where(rows, 0.0, -1e9), "per_head": per_head,
            "causal": "causal", "none": None}[mask_kind]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    got = unfused_attention(q, k, v, scale, mask)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_bfloat16_in_bfloat16_out_as_mlx():
    q, k, v = (x.astype(mx.bfloat16) for x in _qkv(2, 6, 2, 5, 40))
    rows = row_mask([20, 31], mx.array([0, 4]), 5, 40)
    for mask in (rows, mx.where(rows, 0.0, -1e9)):  # an additive float32 mask too
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=rows)
        got = unfused_attention(q, k, v, 0.25, mask)
        assert got.dtype == mx.bfloat16
        np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                                   np.array(want.astype(mx.float32)), atol=2e-2)


def test_only_short_passes_of_a_ragged_cache_take_it_and_only_where_asked(monkeypatch):
    cache = RaggedKVCache.__new__(RaggedKVCache)
    q, k, v = _qkv(1, 2, 2, 4, 8)
    monkeypatch.setattr(RowEnds, "unfused_passes", False)
    assert cache.own_attention(q, k, v, 1.0, None) is None  # a CPU, a Mac: upstream's
    monkeypatch.setattr(RowEnds, "unfused_passes", True)
    assert cache.own_attention(q, k, v, 1.0, None) is not None
    one, _, _ = _qkv(1, 2, 2, 1, 8)
    assert cache.own_attention(one, k, v, 1.0, None) is None  # one token: the vector kernel
    long, _, _ = _qkv(1, 2, 2, MOST_UNFUSED_QUERIES + 1, 8)
    assert cache.own_attention(long, k, v, 1.0, None) is None  # a prompt: the fused kernel
