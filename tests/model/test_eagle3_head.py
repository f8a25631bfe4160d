"""An EAGLE-3 head in the ``speculators`` format (``spec_decode/heads/eagle3.py``)
and the target features it reads, checked against an independent
implementation: mlx-vlm 0.7.10's ``Eagle3DraftModel`` (its wheel, as in
``test_mtp_head.py``), on a random-weight head for SmolLM2-135M (30 layers:
aux layers 2, 15, 27). float32; the bar is 1e-4 on the logits at the
prompt's positions and at chained draft positions.
"""

import json

import mlx.core as mx
import pytest
from test_mtp_head import mlx_vlm  # noqa: F401  (puts the reference on sys.path)
from tiny_models import build_eagle3

from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.spec_decode.heads.eagle3 import aux_layer_ids, load_eagle3_head

PROMPT = [[5, 17, 99, 3, 42, 7, 200, 11, 64, 9]]


@pytest.fixture(scope="module")
def mlx_vlm_eagle3(mlx_vlm):  # noqa: F811
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    return Eagle3Config, Eagle3DraftModel


@pytest.fixture(scope="module")
def target_config(smollm2_path):
    return json.loads((smollm2_path / "config.json").read_text())


@pytest.fixture(scope="module")
def head_path(tmp_path_factory, target_config):
    return build_eagle3(tmp_path_factory.mktemp("eagle3"), target_config)


def _features(model, layers):
    """The target's aux features by hand: Hugging Face's hidden_states[i]
    (i in the config's numbering) is the output of decoder layer i - 1."""
    inner = mlx_lm_adapter.text_model(model).model
    h = inner.embed_tokens(mx.array(PROMPT))
    outs = {}
    for i, layer in enumerate(inner.layers):
        h = layer(h, "causal", None)
        outs[i + 1] = h
    return mx.concatenate([outs[i] for i in layers], axis=-1)


def test_the_capture_reads_the_configured_layers(smollm2):
    """The engine's capture gives hidden_states[2], [15], [27] of SmolLM2
    (the speculators default [2, L//2, L-3]) concatenated, from the model's
    own pass; and the model's output is unchanged by it."""
    model, _ = smollm2
    layers = aux_layer_ids({}, 30)
    assert layers == [1, 14, 26]
    before = model(mx.array(PROMPT))
    capture = mlx_lm_adapter.capture_hidden(model, layers)
    try:
        after = model(mx.array(PROMPT))
        got = capture.take()
    finally:
        mlx_lm_adapter.capture_hidden(model, None)  # the final-state capture: harmless
    assert mx.array_equal(before, after).item()
    assert mx.abs(got - _features(model, [2, 15, 27])).max().item() <= 1e-5


def test_the_head_matches_mlx_vlms_drafter(mlx_vlm_eagle3, smollm2, head_path):
    """Prompt pairs (features_t, x_{t+1}) through the head with its KV cache,
    then two chained drafts from the head's own state: logits (at the draft
    vocabulary's target ids) and drafts agree with mlx-vlm's."""
    config_class, drafter_class = mlx_vlm_eagle3
    model, _ = smollm2
    head, layers, embed = load_eagle3_head(model, str(head_path))
    assert embed is None  # the checkpoint has no embedding: the target's
    embed = mlx_lm_adapter.token_embedding(model)
    features = _features(model, [2, 15, 27])
    prompt = mx.array(PROMPT)
    bonus = mx.array([[123]])
    shifted = mx.concatenate([prompt[:, 1:], bonus], axis=1)

    config = json.loads((head_path / "config.json").read_text())
    reference = drafter_class(config_class.from_dict(config))
    weights = mx.load(str(head_path / "model.safetensors"))
    reference.load_weights(list(reference.sanitize(weights).items()), strict=False)
    reference.reset(model)  # binds the target's embedding, as ours shares it
    ids = mx.arange(head.draft_vocab_size) + reference.d2t

    cache = head.make_cache()
    ours = head(embed(shifted), features, cache)
    theirs = reference._forward_tokens(shifted, features, mx.int32)
    for _ in range(3):
        a = head.logits(ours)
        b = reference._logits(theirs)
        assert mx.abs(a[..., ids] - b).max().item() <= 1e-4, mx.abs(a[..., ids] - b).max()
        assert mx.all(mx.isinf(a).sum(axis=-1) == a.shape[-1] - head.draft_vocab_size).item()
        our_token = mx.argmax(a[:, -1:], axis=-1)
        their_token = reference._draft_to_target(mx.argmax(b[:, -1:], axis=-1), mx.int32)
        assert our_token.tolist() == their_token.tolist()
        ours = head(embed(our_token), ours[:, -1:], cache)
        theirs = reference._forward_tokens(their_token, theirs[:, -1:], mx.int32)


def test_specforge_naming_and_refusals(smollm2, target_config, tmp_path):
    """SpecForge's ``midlayer.*`` loads as the same head; unimplemented flags,
    a head for another hidden size and a folder that is no head are refused
    by name."""
    model, _ = smollm2
    a, _, _ = load_eagle3_head(model, str(build_eagle3(tmp_path / "a", target_config, seed=1)))
    b, _, _ = load_eagle3_head(model, str(build_eagle3(tmp_path / "b", target_config, seed=1,
                                                        layout="specforge")))
    x = mx.ones((1, 2, target_config["hidden_size"]))
    f = mx.ones((1, 2, 3 * target_config["hidden_size"]))
    assert mx.array_equal(a(x, f), b(x, f)).item()

    folder = build_eagle3(tmp_path / "c", target_config)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    with pytest.raises(ValueError, match="norm_output"):
        load_eagle3_head(model, str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "target_hidden_size": 1024}))
    with pytest.raises(ValueError, match="hidden states of size 1024"):
        load_eagle3_head(model, str(folder))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        load_eagle3_head(model, _plain(tmp_path))


def _plain(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(folder)
