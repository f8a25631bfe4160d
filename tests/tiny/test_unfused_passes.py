"""Verification passes attending without the fused kernel (``kv/unfused.py``,
what a CUDA process does) give the plain greedy tokens: on a family with
sliding-window and full layers (``gemma3_text``, both ragged caches), a
hybrid one with grouped query heads (``qwen3_5``), one whose layers share
keys and values (``gemma4_text``) and one with latent attention, its values
narrower than its keys (``kimi_linear``); n-gram drafts partly kept, partly
refused; and the passes did go through it."""

import pytest
from test_hybrid_caches import FAMILIES, _prompts
from test_model_families import SPECULATING
from test_quantized import _parity
from tiny_models import build

import mlx_lm_server.kv.rows as rows
from mlx_lm_server.kv.rows import RowEnds
from mlx_lm_server.kv.unfused import MOST_UNFUSED_QUERIES


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_5", "gemma4_text", "kimi_linear"])
def test_greedy_parity_with_unfused_passes(tmp_path, smollm2_path, monkeypatch, family):
    from mlx_lm import load

    model, tokenizer = load(str(build(family, tmp_path / family, smollm2_path,
                                          {**FAMILIES, **SPECULATING}[family])))
    calls = []
    unfused = rows.unfused_attention
    monkeypatch.setattr(rows, "unfused_attention", lambda *a: calls.append(a[0].shape) or unfused(*a))
    monkeypatch.setattr(RowEnds, "unfused_passes", True)
    identical, usage = _parity(model, tokenizer, dict(mode="ngram", num_speculative_tokens=4),
                               max_tokens=24, prompts=_prompts(tokenizer, 8))
    assert identical == 8
    # Every verification (k + 1 = 5 tokens a row) among them; nothing of one
    # token (the vector kernel's) or longer than a short pass.
    assert any(shape[2] == 5 for shape in calls), calls[:3]
    assert all(1 < shape[2] <= MOST_UNFUSED_QUERIES for shape in calls)
    drafted = sum(u["draft_tokens"] for u in usage)
    assert 0 < sum(u["accepted_tokens"] for u in usage) < drafted
