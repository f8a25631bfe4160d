"""Learned heads on a 4-bit target: the dtype a head and its features use is
the target's compute dtype (the scales' dtype), never the packed ``uint32``
of a quantized weight.

Tiny random qwen3 targets quantized to 4 bits with their embedding (as
mlx-community folders are): over bfloat16 (``test_quantized.qwen3_4bit_path``)
a loaded head computes in bfloat16 and a proposal is priced on bfloat16
features; over float32 (this CPU's 4-bit: MLX's 4-bit matmul over bfloat16
is ten times slower here) an EAGLE-3 head trains a few steps, is evaluated
and priced by the command and served, and a DFlash drafter, itself 4-bit,
is served; greedy output is the plain model's (a divergence must be a
near-tie, ``parity.py``).
"""

import json
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from parity import assert_same_or_near_tie
from test_mtp_proposer import TEXTS, _greedy
from test_quantized import qwen3_4bit_path  # noqa: F401  (the bfloat16 4-bit target)
from tiny_models import build_dflash, build_eagle3

from mlx_lm_server.runtime import mlx_lm_adapter
from mlx_lm_server.spec_decode.heads import compute_dtype

TEXT = "The cat sat on the mat. The dog ran to the park. " * 8


@pytest.fixture(scope="module")
def q4_path(tmp_path_factory, tiny_qwen3_path):
    """The tiny qwen3 (weights x 1.3, as ``qwen3_4bit_path``) 4-bit over float32."""
    from mlx.utils import tree_map
    from mlx_lm import load

    model, _ = load(str(tiny_qwen3_path))
    model.update(tree_map(lambda w: 1.3 * w, model.parameters()))
    nn.quantize(model, group_size=32, bits=4)
    folder = tmp_path_factory.mktemp("tiny-qwen3-4bit-float32")
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((tiny_qwen3_path / "config.json").read_text())
    config.update(quantization={"group_size": 32, "bits": 4})
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_qwen3_path / name).read_bytes())
    return folder


@pytest.fixture(scope="module")
def q4(q4_path):
    from mlx_lm import load

    return load(str(q4_path))


@pytest.fixture(scope="module")
def bf16_q4(qwen3_4bit_path):  # noqa: F811
    from mlx_lm import load

    return load(str(qwen3_4bit_path))


def _floating_dtypes(module) -> set:
    return {v.dtype for _, v in tree_flatten(module.parameters())
            if mx.issubdtype(v.dtype, mx.floating)}


def _same_as_plain(model, tokenizer, path, mode, **fields):
    """Greedy outputs through ``mode`` against ``none`` (a divergence must be a
    float32 near-tie) and the drafted-token counts."""
    prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
    plain, _ = _greedy(model, tokenizer, path, "none", prompts, 0.05, 12)
    ours, counts = _greedy(model, tokenizer, path, mode, prompts, 0.05, 12, **fields)
    for prompt, got, want in zip(prompts, ours, plain):
        assert_same_or_near_tie(model, prompt, got, want, mx.float32)
    return counts


def _quantize_drafter(head, folder) -> None:
    """Rewrite a drafter folder 4-bit, as a conversion would (``quantization``
    in its config)."""
    nn.quantize(head, group_size=32, bits=4)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(head.parameters())))
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))


def test_a_4bit_targets_compute_dtype_is_its_scales_not_its_packed_weights(bf16_q4, q4,
                                                                           smollm2):
    for (model, _), dtype in ((bf16_q4, mx.bfloat16), (q4, mx.float32)):
        assert mlx_lm_adapter.token_embedding(model).weight.dtype == mx.uint32
        assert compute_dtype(model) == dtype
    assert compute_dtype(smollm2[0]) == mx.float32


def test_heads_compute_and_are_priced_in_a_bfloat16_4bit_targets_dtype(
        bf16_q4, qwen3_4bit_path, tmp_path, monkeypatch):  # noqa: F811
    """A float32 EAGLE-3 head and a 4-bit DFlash drafter load in bfloat16;
    the drafter's KV-budget probe feeds features of the right width (not its
    packed ``fc`` weight's); a proposal is timed on bfloat16 features."""
    from mlx_lm_server.drafter.prices import head_speedups
    from mlx_lm_server.spec_decode.heads.dflash import load_dflash_head
    from mlx_lm_server.spec_decode.heads.eagle3 import load_eagle3_head
    from mlx_lm_server.spec_decode.proposer.head import HeadProposer

    model, _ = bf16_q4
    config = json.loads((qwen3_4bit_path / "config.json").read_text())
    head, layers, _ = load_eagle3_head(model, str(build_eagle3(tmp_path / "eagle3", config,
                                                               draft_vocab=256)))
    assert _floating_dtypes(head) == {mx.bfloat16}

    folder = build_dflash(tmp_path / "dflash", config, layer_ids=(0, 1), block_size=4)
    _quantize_drafter(load_dflash_head(model, str(folder))[0], folder)
    dflash, _, _ = load_dflash_head(model, str(folder))
    assert isinstance(dflash.fc, nn.QuantizedLinear)
    assert _floating_dtypes(dflash) == {mx.bfloat16}
    mx.eval(dflash.probe(8, dflash.make_cache()))

    seen = []
    observe = HeadProposer.observe_target
    monkeypatch.setattr(HeadProposer, "observe_target", lambda self, uids, hidden, kept: (
        seen.append(hidden.dtype), observe(self, uids, hidden, kept))[1])
    prices = head_speedups(model, head, mlx_lm_adapter.token_embedding(model), layers,
                           {1: 1.5}, batch=1, context=8, reps=1)
    assert prices["draft_ms"][1] > 0 and seen and set(seen) == {mx.bfloat16}, (prices, seen)


def test_an_eagle3_head_trains_evaluates_and_serves_on_a_4bit_target(q4, q4_path, tmp_path):
    from mlx_lm_server.drafter.train import TrainConfig, train

    model, tokenizer = q4
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    out = tmp_path / "head"
    cfg = TrainConfig(steps=3, eval_every=3, checkpoint_every=3, batch_size=2, max_len=32,
                      draft_vocab=256, learning_rate=1e-3, warmup=1)
    result = train(model, tokenizer, [str(data)], str(out), cfg, eval_fraction=0.3,
                   progress=lambda line: None)
    assert len(result["history"]) == 3 and np.isfinite(result["history"]).all()
    assert result["evaluation"]["pairs"] > 0

    done = subprocess.run(
        [sys.executable, "-m", "mlx_lm_server.drafter.cli", "evaluate", "--model",
         str(q4_path), "--head", str(out), "--data", str(data), "--max-len", "32",
         "--k", "2", "--price-context", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    evaluation = json.loads(done.stdout.strip().splitlines()[-1])
    assert evaluation["pairs"] > 0 and evaluation["on_this_machine"]["draft_ms"]["2"] > 0

    counts = _same_as_plain(model, tokenizer, q4_path, "eagle3", draft_model_path=str(out))
    assert counts.num_draft_tokens > 0, counts


def test_a_4bit_dflash_drafter_serves_on_a_4bit_target(q4, q4_path, tmp_path):
    from mlx_lm_server.spec_decode.heads.dflash import load_dflash_head

    model, tokenizer = q4
    config = json.loads((q4_path / "config.json").read_text())
    folder = build_dflash(tmp_path / "dflash", config, layer_ids=(0, 1), block_size=4)
    _quantize_drafter(load_dflash_head(model, str(folder))[0], folder)
    counts = _same_as_plain(model, tokenizer, q4_path, "dflash", draft_model_path=str(folder))
    assert counts.num_draft_tokens > 0, counts
