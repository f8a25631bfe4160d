"""``--spec-decode mtp`` through the HTTP server, on ``test_mtp_proposer.py``'s
random hybrid qwen3_5 with an MTP layer.
"""

import pytest
from test_mtp_proposer import hybrid_path  # noqa: F401
from tiny_models import build

from mlx_lm_server.spec_decode.config import SpecDecodeConfig


def test_the_server_drafts_with_the_checkpoints_mtp_layer(hybrid_path, tmp_path,  # noqa: F811
                                                           smollm2_path):
    """Through the HTTP server: ``--spec-decode mtp`` answers and reports the
    head's drafts; a folder without an MTP layer is refused at start-up,
    naming what is missing."""
    import httpx
    from conftest import LiveServer

    spec = SpecDecodeConfig(mode="mtp", dynamic=False, adaptive_k=False, calibration_seconds=0,
                            num_speculative_tokens=3)
    # The hybrid: upstream's qwen3_5 cannot build a one-token mask over a plain
    # KVCache without a linear layer, which the server's start-up runs.
    server = LiveServer(hybrid_path, spec=spec)
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": server.model, "prompt": "one two three", "max_tokens": 24,
            "temperature": 0})
        assert r.status_code == 200, r.text
        metrics = httpx.get(server.url + "/v1/spec_decode/metrics", timeout=5).json()
    finally:
        server.close()
    assert metrics["mode"] == "mtp"
    assert metrics["totals"]["draft_tokens"] > 0, metrics

    plain = build("qwen3_5", tmp_path / "plain", smollm2_path)
    with pytest.raises(ValueError, match="has no MTP layer"):
        LiveServer(plain, spec=spec)
