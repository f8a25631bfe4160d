"""The sliding-window and recurrent families of ``test_hybrid_caches.py``
through the HTTP server: each speculates with n-gram and draft proposers and
answers as the plain server does; ``olmo_hybrid``, which cannot roll back, is
served plainly.
"""

import httpx
import mlx.core as mx
import pytest
from parity import assert_same_or_near_tie
from test_hybrid_caches import DRAFT_FOR, FAMILIES, tiny_models, tiny_paths  # noqa: F401
from test_spec_engine import SOURCE
from tiny_models import build

from mlx_lm_server.spec_decode.config import SpecDecodeConfig


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_speculates_through_the_server(tiny_models, tiny_paths,  # noqa: F811
                                                   family):
    """n-gram and draft servers answer like the plain one and report verified drafts."""
    from conftest import LiveServer

    path = tiny_paths[family]
    prompt = SOURCE[:300] + SOURCE[:80]
    texts, metrics = {}, {}
    for mode in ("none", "ngram", "draft"):
        spec = SpecDecodeConfig(mode=mode, num_speculative_tokens=4, dynamic=False,
                                adaptive_k=False, calibration_seconds=0,
                                draft_model_path=str(tiny_paths[DRAFT_FOR[family]])
                                if mode == "draft" else None)
        server = LiveServer(path, max_batch_size=4, spec=spec)
        try:
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": server.model, "prompt": prompt, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            texts[mode] = r.json()["choices"][0]["text"]
            metrics[mode] = httpx.get(server.url + "/v1/spec_decode/metrics", timeout=10).json()
        finally:
            server.close()
    model, tokenizer = tiny_models[family]
    for mode in ("ngram", "draft"):
        assert metrics[mode]["enabled"] and metrics[mode]["mode"] == mode
        assert metrics[mode]["totals"]["draft_tokens"] > 0, (mode, metrics[mode]["totals"])
        if texts[mode] != texts["none"]:
            assert_same_or_near_tie(model, tokenizer.encode(prompt),
                                    tokenizer.encode(texts[mode]),
                                    tokenizer.encode(texts["none"]), mx.float32)


def test_a_family_whose_recurrent_layers_ignore_right_padding_is_served_plainly(
        tmp_path, smollm2_path):
    """olmo_hybrid's convolution state ignores right padding (the replay needs
    it): the start-up check finds that on the model itself, and the server
    answers with plain decoding instead of failing or diverging."""
    from conftest import LiveServer
    from mlx_lm import load

    from mlx_lm_server.kv import cannot_speculate

    path = build("olmo_hybrid", tmp_path / "olmo", smollm2_path)
    reason = cannot_speculate(load(str(path))[0])
    assert "rollback check on the model failed" in reason
    server = LiveServer(path, max_batch_size=2, spec=SpecDecodeConfig(
        mode="ngram", dynamic=False, adaptive_k=False, calibration_seconds=0))
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": server.model, "prompt": SOURCE[:100], "max_tokens": 8, "temperature": 0})
        metrics = httpx.get(server.url + "/v1/spec_decode/metrics", timeout=10).json()
    finally:
        server.close()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert not metrics["enabled"]
