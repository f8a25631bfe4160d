"""``--spec-decode eagle3``: an EAGLE-3 head drafts for SmolLM2-135M under
continuous batching, on the same path as MTP layers (``proposer/head.py``).

The head is random (``build_eagle3``): its drafts are refused, so these
tests show that its path (aux-layer features captured from the engine's own
passes, the 3H -> H projection on target pairs only, the draft vocabulary
mapped to target ids) leaves the output the plain model's and keeps the
head's cache equal to a fresh pass over the target's pairs. Kept drafts on
this path are covered by the MTP tests (``test_mtp_proposer.py``) and the
head's numbers by ``test_eagle3_head.py``.
"""

import json

import mlx.core as mx
import pytest
from test_mtp_proposer import CheckedProposer, _greedy, run_checked
from tiny_models import build_eagle3

from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.heads.eagle3 import load_eagle3_head

TEXTS = ["Write a haiku about rain.", "What is 2 + 2?", "Name three colours.",
         "def add(a, b):", "Say hello in French.", "List the days of the week."]


@pytest.fixture(scope="module")
def head_path(tmp_path_factory, smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    return build_eagle3(tmp_path_factory.mktemp("eagle3-head"), config, seed=2)


def _features(model, layers, tokens):
    inner = mlx_lm_adapter.text_model(model).model
    h = inner.embed_tokens(mx.array([tokens]))
    outs = []
    for i, layer in enumerate(inner.layers):
        h = layer(h, "causal", None)
        if i in layers:
            outs.append(h)
    return mx.concatenate(outs, axis=-1)


def test_greedy_output_is_the_targets(smollm2, head_path, mode="eagle3"):
    model, tokenizer = smollm2
    from test_spec_engine import _chat

    prompts = [_chat(tokenizer, t) for t in TEXTS]
    plain, _ = _greedy(model, tokenizer, head_path, "none", prompts, 0.1, 24)
    ours, counts = _greedy(model, tokenizer, "target", mode, prompts, 0.1, 24,
                           draft_model_path=str(head_path))
    assert ours == plain
    assert counts.num_draft_tokens > 50, counts


def test_the_heads_cache_equals_a_fresh_pass_over_the_targets_aux_features(smollm2, head_path):
    """Two prompts longer than ``CATCH_UP`` among them, prefilled in chunks
    of 32 (each chunk's features reach the head as they come): a row's
    first proposal feeds the head only the prompt's last ``CATCH_UP`` pairs
    (feeding them all made a probe cost 2.5 plain steps at B=8 on a CPU),
    and its cache still equals a fresh pass over the pairs it holds."""
    from test_spec_engine import _chat

    from mlx_lm_server.spec_decode.proposer.head import CATCH_UP

    model, tokenizer = smollm2
    texts = ["Summarise: " + "The council met on Tuesday about the tram. " * n for n in (9, 14)]
    prompts = [_chat(tokenizer, t) for t in texts + TEXTS[:2]]
    assert sum(len(p) > CATCH_UP + 1 for p in prompts) == 2
    head, layers, _ = load_eagle3_head(model, str(head_path))
    proposer = CheckedProposer(head, mlx_lm_adapter.token_embedding(model), head.logits,
                               lambda tokens: _features(model, layers, tokens),
                               prompts, hidden_layers=layers)
    firsts = {max(0, len(p) - CATCH_UP) for p in prompts}
    run_checked(model, tokenizer, "eagle3", proposer, prompts, firsts=firsts, max_tokens=10,
                prefill_step_size=32, draft_model_path=str(head_path))


def test_an_eagle3_mode_needs_its_head():
    with pytest.raises(ValueError, match="needs --draft-model the EAGLE-3 head"):
        SpecDecodeConfig(mode="eagle3")


def test_the_server_drafts_with_an_eagle3_head(make_server, head_path, tmp_path):
    """``--spec-decode eagle3 --draft-model HEAD`` answers through the HTTP
    server and reports the head's drafts; a head for another model is
    refused at start-up, naming the mismatch."""
    import httpx

    spec = SpecDecodeConfig(mode="eagle3", draft_model_path=str(head_path), dynamic=False,
                            adaptive_k=False, calibration_seconds=0, num_speculative_tokens=3)
    server = make_server(spec=spec)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    metrics = httpx.get(server.url + "/v1/spec_decode/metrics", timeout=5).json()
    assert metrics["mode"] == "eagle3" and metrics["totals"]["draft_tokens"] > 0, metrics

    other = build_eagle3(tmp_path / "other", {"hidden_size": 1024, "vocab_size": 49152})
    with pytest.raises(ValueError, match="hidden states of size 1024"):
        make_server(spec=SpecDecodeConfig(mode="eagle3", draft_model_path=str(other)))


def test_engines_sharing_a_model_share_its_capture(smollm2, head_path):
    """Two engines built on one model (as a benchmark builds one per mode)
    both draft from the same capture; a capture of other layers installed
    later costs the first engine its drafts' context, never a request."""
    from test_mtp_proposer import _scheduler, _stop
    from test_spec_engine import _chat, _run

    from mlx_lm_server.decoding.sampling import SamplingParams
    from mlx_lm_server.serving.request import GenerationRequest

    model, tokenizer = smollm2
    prompts = [_chat(tokenizer, t) for t in TEXTS[:3]]
    reqs = [GenerationRequest(p, 16, SamplingParams(temperature=0)) for p in prompts]
    none = _scheduler(model, tokenizer, "target", mode="none")
    try:
        plain = [ids for ids, _, _ in _run(none, reqs)]
    finally:
        _stop(none)
    first = _scheduler(model, tokenizer, "target", mode="eagle3", draft_model_path=str(head_path))
    second = _scheduler(model, tokenizer, "target", mode="eagle3",
                        draft_model_path=str(head_path))
    try:
        for s in (first, second):
            assert [ids for ids, _, _ in _run(s, reqs)] == plain
            assert s.spec_stats.tokens.num_draft_tokens > 0
        mlx_lm_adapter.capture_hidden(model, None)  # the final state: other features
        assert [ids for ids, _, _ in _run(first, reqs)] == plain
    finally:
        _stop(first, second)


def test_a_hybrid_target_keeps_its_output(tmp_path_factory, smollm2_path):
    """qwen3_5 with gated-delta layers: the head reads a linear and an
    attention layer's outputs; staggered rows, output the plain model's."""
    from mlx_lm import load
    from tiny_models import CONFIGS, build

    root = tmp_path_factory.mktemp("eagle3-hybrid")
    target = build("qwen3_5", root / "target", smollm2_path, scale=2.0, seed=3)
    head = build_eagle3(root / "head", CONFIGS["qwen3_5"]["text_config"], seed=5)
    model, tokenizer = load(str(target))
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    plain, _ = _greedy(model, tokenizer, target, "none", prompts, 0.1, 24)
    ours, counts = _greedy(model, tokenizer, target, "eagle3", prompts, 0.1, 24,
                           draft_model_path=str(head))
    assert ours == plain
    assert counts.num_draft_tokens > 100, counts
