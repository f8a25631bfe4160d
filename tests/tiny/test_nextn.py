"""``--spec-decode mtp`` on a GLM-4.5 / DeepSeek-V3 style checkpoint: its
nextn layer (decoder layer ``num_hidden_layers``, ``eh_proj`` / ``enorm`` /
``hnorm`` / ``shared_head``) drafts on the MTP path (``heads/mtp.py``).

One-layer glm4_moe checkpoints in the Hugging Face layout (``build_nextn``,
MoE experts stored one tensor each): with a random nextn layer, the head's
logits against vLLM's ``deepseek_mtp.py`` forward written out here; with one
that copies the target (drafts mostly right), greedy output against the
plain model's; and ``auto`` finding the layer.
"""

import json

import mlx.core as mx
import pytest
from test_mtp_proposer import TEXTS, _greedy
from tiny_models import build_deepseek_nextn, build_nextn

from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.spec_decode.auto import auto_mode, has_mtp_layer
from mlx_lm_server.spec_decode.heads.mtp import load_mtp_head


@pytest.fixture(scope="module")
def nextn_path(tmp_path_factory, smollm2_path):
    return build_nextn(tmp_path_factory.mktemp("nextn-copy"), smollm2_path)


@pytest.fixture(scope="module")
def nextn_model(nextn_path):
    from mlx_lm import load

    return load(str(nextn_path))


def _reference(model, path, tokens, hidden, steps):
    """vLLM's ``DeepSeekMultiTokenPredictorLayer`` and ``SharedHead`` over the
    checkpoint's own tensors: logits at every pair (h_t, x_{t+1}) [1, T, V],
    then ``steps - 1`` chained positions after the last pair (the head's own
    state and its greedy draft), each [1, V]."""
    from mlx_lm.models import glm4_moe

    config = json.loads((path / "config.json").read_text())
    L = config["num_hidden_layers"]
    raw = {k[len(f"model.layers.{L}."):]: v for k, v in mx.load(str(path / "model.safetensors")).items()
           if k.startswith(f"model.layers.{L}.")}
    layer = glm4_moe.DecoderLayer(glm4_moe.ModelArgs.from_dict(config), L)
    experts = config["n_routed_experts"]
    params = {k: v for k, v in raw.items() if k.startswith(("self_attn.", "input_layernorm",
                                                            "post_attention_layernorm"))}
    params.update({k: v for k, v in raw.items() if k.startswith(("mlp.gate.", "mlp.shared"))})
    for name in ("gate_proj", "up_proj", "down_proj"):
        params[f"mlp.switch_mlp.{name}.weight"] = mx.stack(
            [raw[f"mlp.experts.{e}.{name}.weight"] for e in range(experts)])
    layer.load_weights(list(params.items()))
    eps = config["rms_norm_eps"]

    def norm(x, w):
        return mx.fast.rms_norm(x, w, eps)

    def mtp(x_next, h, cache):
        e = norm(raw["embed_tokens.weight"][x_next], raw["enorm.weight"])
        z = mx.concatenate([e, norm(h, raw["hnorm.weight"])], axis=-1) @ raw["eh_proj.weight"].T
        mask = "causal" if z.shape[1] > 1 else None
        out = layer(z, mask, cache)
        return out, norm(out, raw["shared_head.norm.weight"]) @ raw["shared_head.head.weight"].T

    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    states, logits = mtp(mx.array([tokens[1:]]), hidden[:, :-1], cache)
    chained, state, last = [], states[:, -1:], logits[:, -1:]
    for _ in range(steps - 1):
        draft = mx.argmax(last, axis=-1)
        state, last = mtp(draft, state, cache)
        chained.append(last[:, 0])
    return logits, chained


def test_the_nextn_layers_drafts_are_vllms_forward(tmp_path, smollm2_path):
    """Draft logits at every pair and at two chained positions within 1e-4
    of the forward written out from the checkpoint's tensors (its own
    names, experts stacked by hand): the renaming, the family's sanitize and
    the MoE layer built at index ``num_hidden_layers`` all hold."""
    from mlx_lm import load

    nextn_path = build_nextn(tmp_path, smollm2_path, copy=False, seed=1)
    model, tokenizer = load(str(nextn_path))
    head = load_mtp_head(model, str(nextn_path))
    embed = mlx_lm_adapter.token_embedding(model)
    project = head.projection(mlx_lm_adapter.output_projection(model))
    tokens = tokenizer.encode("the cat sat on the mat and the dog")
    inner = mlx_lm_adapter.text_model(model).model
    hidden = inner(mx.array([tokens]))  # after the final norm, as the engine captures
    want, want_chained = _reference(model, nextn_path, tokens, hidden, steps=3)
    cache = head.make_cache()
    states = head(embed(mx.array([tokens[1:]])), hidden[:, :-1], cache)
    got = project(states)
    assert mx.abs(got - want).max().item() < 1e-4
    state, last = states[:, -1:], got[:, -1:]
    for expected in want_chained:
        draft = mx.argmax(last, axis=-1)
        state = head(embed(draft), state, cache)
        last = project(state)
        assert mx.abs(last[:, 0] - expected).max().item() < 1e-4


@pytest.mark.parametrize("batch,stagger", [(1, 0.0), (4, 0.1)])
def test_greedy_output_is_the_targets_with_nextn_drafts(nextn_model, nextn_path, batch, stagger):
    model, tokenizer = nextn_model
    prompts = [tokenizer.encode(t) for t in TEXTS[:batch]]
    plain, _ = _greedy(model, tokenizer, nextn_path, "none", prompts, stagger, 24)
    ours, counts = _greedy(model, tokenizer, nextn_path, "mtp", prompts, stagger, 24)
    assert ours == plain
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, counts


def test_auto_finds_a_nextn_layer_and_a_conversion_without_it_is_refused_by_name(
        nextn_model, nextn_path, tmp_path):
    """mlx-lm's conversions keep ``num_nextn_predict_layers`` and drop the
    layer: ``auto`` falls back to prompt lookup, ``mtp`` names what it
    looked for."""
    model, _ = nextn_model
    assert has_mtp_layer(str(nextn_path)) and auto_mode(str(nextn_path)) == "ngram,mtp"
    weights = {k: v for k, v in mx.load(str(nextn_path / "model.safetensors")).items()
               if not k.startswith("model.layers.1.")}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text((nextn_path / "config.json").read_text())
    assert not has_mtp_layer(str(tmp_path)) and auto_mode(str(tmp_path)) == "ngram"
    with pytest.raises(ValueError, match=r"model\.layers\.1\.eh_proj\.weight"):
        load_mtp_head(model, str(tmp_path))


def test_a_deepseek_v3_nextn_layer_drafts_losslessly(tmp_path, smollm2_path):
    """DeepSeek-V3's nextn layer: MLA attention whose ``kv_b_proj`` the
    family's sanitize splits, an MoE layer at index ``num_hidden_layers``
    over a dense first layer, its cache batched and rolled back like any
    head's; what the KV budget measures a head with (``probe``) runs too."""
    from mlx_lm import load

    path = build_deepseek_nextn(tmp_path, smollm2_path)
    model, tokenizer = load(str(path))
    head = load_mtp_head(model, str(path))
    assert type(head.layers[0].self_attn).__name__ == "DeepseekV3Attention"
    assert type(head.layers[0].mlp).__name__ == "DeepseekV3MoE"
    mx.eval(head.probe(8, head.make_cache()))
    prompts = [tokenizer.encode(t) for t in TEXTS[:4]]
    plain, _ = _greedy(model, tokenizer, path, "none", prompts, 0.1, 16)
    ours, counts = _greedy(model, tokenizer, path, "mtp", prompts, 0.1, 16)
    assert ours == plain
    assert counts.num_draft_tokens > 20, counts
