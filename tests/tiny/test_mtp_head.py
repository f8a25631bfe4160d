"""A checkpoint's own MTP layer as a drafter (``spec_decode/heads/mtp.py``),
checked against an independent implementation: mlx-vlm 0.7.10's
``Qwen3_5MTPDraftModel`` (its wheel, fetched from the package index and put
on ``sys.path``; the test skips, saying so, where the index cannot be
reached), on a tiny random-weight qwen3_5 whose checkpoint carries ``mtp.*``
weights in the Hugging Face layout. float32; the bar is 1e-4 on the logits,
for the prompt's positions and for chained draft positions.
"""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from tiny_models import CONFIGS, build

from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.spec_decode.heads.mtp import load_mtp_head

MLX_VLM = "mlx-vlm==0.7.10"
PROMPT = [[5, 17, 99, 3, 42, 7, 200, 11, 64, 9]]


@pytest.fixture(scope="module")
def mlx_vlm():
    """mlx-vlm's wheel, unpacked once into build/ (git-ignored)."""
    folder = Path(__file__).resolve().parents[2] / "build" / MLX_VLM.replace("==", "-")
    if not (folder / "mlx_vlm").is_dir():
        wheels = folder.with_name(folder.name + "-wheel")
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                               MLX_VLM, "-d", str(wheels)], capture_output=True, text=True)
        if done.returncode != 0:
            # The suite installs from the same index: a skip here would drop the
            # independent parity checks of every head without a trace.
            pytest.fail(f"cannot fetch {MLX_VLM} from the package index (the reference "
                        f"implementation the head tests compare with): {done.stderr[-300:]}")
        import zipfile

        zipfile.ZipFile(next(wheels.glob("*.whl"))).extractall(folder)
    sys.path.insert(0, str(folder))
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig, Qwen3_5MTPDraftModel

    return ModelConfig, Qwen3_5MTPDraftModel


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_path):
    return build("qwen3_5_mtp", tmp_path_factory.mktemp("qwen3_5-mtp"), smollm2_path,
                 scale=0.5, seed=3)


@pytest.fixture(scope="module")
def target(checkpoint):
    from mlx_lm import load

    model, _ = load(str(checkpoint))
    return model


def _reference(mlx_vlm, checkpoint, target):
    config_class, drafter_class = mlx_vlm
    text = CONFIGS["qwen3_5_mtp"]["text_config"]
    drafter = drafter_class(config_class.from_dict(
        {"model_type": "qwen3_5_mtp", "text_config": dict(text)}))
    hf = {k: v for k, v in mx.load(str(checkpoint / "model.safetensors")).items()
          if k.startswith("mtp.")}
    drafter.load_weights(list(drafter.sanitize(hf).items()))
    drafter.reset(target)
    return drafter


def _target_pass(target):
    """The prompt's final hidden states (after the target's final norm) and
    the target's greedy next token."""
    prompt = mx.array(PROMPT)
    hidden = mlx_lm_adapter.text_model(target).model(prompt, cache=target.make_cache())
    bonus = mx.argmax(mlx_lm_adapter.output_projection(target)(hidden[:, -1]), axis=-1)
    return prompt, hidden, bonus


def test_the_head_matches_mlx_vlms_drafter_at_prompt_and_chained_positions(
        mlx_vlm, checkpoint, target):
    """Prompt pairs (h_t, x_{t+1}) through the head with its KV cache, then
    two chained drafts (the head's own hidden state and drafted token): the
    logits at every position agree with mlx-vlm's, and so do the drafts."""
    head = load_mtp_head(target, str(checkpoint))
    embed = mlx_lm_adapter.token_embedding(target)
    project = mlx_lm_adapter.output_projection(target)
    prompt, hidden, bonus = _target_pass(target)
    shifted = mx.concatenate([prompt[:, 1:], bonus[:, None]], axis=1)

    cache = head.make_cache()
    states = head(embed(shifted), hidden, cache)  # its cache now holds the prompt's pairs
    ours = [project(states)]
    reference = _reference(mlx_vlm, checkpoint, target)
    reference.prefill_from_target_hidden(prompt, hidden, bonus, lambda x: mx.argmax(x, -1),
                                         greedy=True)
    theirs = [reference._lm_head_fn(reference._forward_hidden(
        reference._input_embed(shifted), hidden, None, mx.arange(shifted.shape[1])[None]))]
    ref_h, ref_token = reference._seed_hidden, reference._seed_token
    our_h = states[:, -1:]
    our_token = mx.argmax(project(our_h), axis=-1)
    assert mx.abs(our_h - ref_h).max().item() <= 1e-4
    for _ in range(2):  # chained: each draft from the head's own last state
        assert our_token.reshape(-1).tolist() == ref_token.reshape(-1).tolist()
        ref_h = reference._forward_token(ref_token.reshape(1, 1), ref_h, mx.int32)
        our_h = head(embed(our_token.reshape(1, 1)), our_h, cache)
        ours.append(project(our_h))
        theirs.append(reference._lm_head_fn(ref_h))
        ref_token = mx.argmax(theirs[-1], axis=-1)
        our_token = mx.argmax(ours[-1], axis=-1)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert mx.abs(a - b).max().item() <= 1e-4, mx.abs(a - b).max().item()


def test_a_split_drafter_folder_gives_the_same_head(checkpoint, target, tmp_path):
    """A split MTP drafter (model_type qwen3_5_mtp: keys without the prefix,
    norms stored shifted) loads the head the checkpoint's own weights give."""
    from mlx_lm_server.spec_decode.heads.mtp import ZERO_CENTRED

    own = {k[len("mtp."):]: v for k, v in mx.load(str(checkpoint / "model.safetensors")).items()
           if k.startswith("mtp.")}
    split = {k: v + 1.0 if v.ndim == 1 and k.endswith(ZERO_CENTRED) else v
             for k, v in own.items()}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), split)
    text = CONFIGS["qwen3_5_mtp"]["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5_mtp", "text_config": text}))
    a = load_mtp_head(target, str(checkpoint))
    b = load_mtp_head(target, str(checkpoint), draft_path=str(tmp_path))
    prompt, hidden, _ = _target_pass(target)
    embed = mlx_lm_adapter.token_embedding(target)(prompt)
    assert mx.array_equal(a(embed, hidden), b(embed, hidden)).item()


def test_a_checkpoint_without_mtp_weights_is_refused_by_name(target, tmp_path, smollm2_path):
    """mlx-lm's conversions drop mtp.*: such a folder is a start-up error
    that names the keys looked for and what to serve instead."""
    plain = build("qwen3_5", tmp_path / "plain", smollm2_path)
    with pytest.raises(ValueError) as e:
        load_mtp_head(target, str(plain))
    message = str(e.value)
    assert "mtp.fc.weight" in message and "mlx-community" in message and "--draft-model" in message
    with pytest.raises(ValueError, match="not an MTP drafter"):
        load_mtp_head(target, str(plain), draft_path=str(plain))
