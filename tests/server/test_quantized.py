"""Speculation on the precisions users serve: bfloat16 weights, 4-bit quantized.

On Apple GPUs 4-bit models are the norm. Greedy output with speculation must
equal plain decoding up to near-ties of bfloat16 (see ``parity.py``), through
the engine and through the server, for a qwen3 folder in the mlx-community
layout (random weights, ``quantization`` in its config, as
``mlx-community/Qwen3-4B-4bit`` has) and, behind ``--run-slow``, for the real
SmolLM2 converted to bf16 4-bit: MLX's CPU kernels for 4-bit matmul over
bfloat16 use no BLAS, and SmolLM2 runs at about a second per token there.
"""

import json
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from parity import assert_same_or_near_tie, model_dtype
from test_spec_engine import SOURCE, _run, _scheduler

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig


def _prompts(tokenizer, n):
    base = "Repeat this code exactly:\n" + SOURCE + "\nHere it is:\n"
    return [tokenizer.encode(base + SOURCE[: 10 + 7 * i]) for i in range(n)]


def _stop(*schedulers):
    for s in schedulers:
        s.shutdown()
        s.join(10)


@pytest.fixture(scope="module")
def smollm2_4bit(tmp_path_factory):
    from mlx_lm import load

    from mlx_lm_server.models.store import fetch

    folder = fetch("smollm2-135m-instruct", str(tmp_path_factory.mktemp("q4")),
                   dtype="bfloat16", quantize=4)
    return folder, load(str(folder))


@pytest.fixture(scope="module")
def qwen3_4bit_path(tmp_path_factory, tiny_qwen3_path) -> Path:
    """The tiny random qwen3, in bfloat16, quantized to 4 bits and saved the
    way mlx-community folders are (``quantization`` in config.json).

    Its weights are scaled by 1.3: at the default initialisation it repeats
    one token from the start (every n-gram draft is right), at 1.5 it never
    repeats (every draft is wrong); at 1.3 its outputs wander, then loop, so
    verification has drafts to keep and drafts to refuse.
    """
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm import load

    model, _ = load(str(tiny_qwen3_path))
    model.update(tree_map(lambda w: 1.3 * w, model.parameters()))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4)
    folder = tmp_path_factory.mktemp("tiny-qwen3-4bit")
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((tiny_qwen3_path / "config.json").read_text())
    config.update(quantization={"group_size": 32, "bits": 4}, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_qwen3_path / name).read_bytes())
    return folder


def _parity(model, tokenizer, spec_kw, n=16, max_tokens=24, stagger=0.05, prompts=None):
    """Greedy outputs of n staggered prompts (or the given ones), plain against
    speculative; the number identical and the speculative usages."""
    dtype = model_dtype(model)
    prompts = prompts or _prompts(tokenizer, n)
    plain = _scheduler(model, tokenizer, "none")
    config = SpecDecodeConfig(dynamic=False, adaptive_k=False, **spec_kw)
    spec = make_scheduler(model, tokenizer, max_batch_size=32,
                     engine=make_engine(model, config, tokenizer, "target"))
    spec.start()
    try:
        reqs = [GenerationRequest(p, max_tokens, SamplingParams(temperature=0)) for p in prompts]
        want = _run(plain, reqs, stagger=stagger)
        got = _run(spec, reqs, stagger=stagger)
    finally:
        _stop(plain, spec)
    identical = sum(assert_same_or_near_tie(model, p, g[0], w[0], dtype)
                    for p, g, w in zip(prompts, got, want))
    return identical, [g[2].spec_decode for g in got]


@pytest.mark.slow  # long by nature (16 staggered rows of a 4-bit model); the 4-bit engine test stays
def test_qwen3_4bit_greedy_parity_16_staggered(qwen3_4bit_path):
    from mlx_lm import load

    model, tokenizer = load(str(qwen3_4bit_path))
    assert model_dtype(model) == mx.bfloat16
    identical, usage = _parity(model, tokenizer, dict(mode="ngram", num_speculative_tokens=6),
                               n=16, max_tokens=32)
    assert identical >= 12, identical  # any divergence was checked to be a bf16 near-tie
    assert sum(u["accepted_tokens"] for u in usage) > 20


@pytest.mark.slow
def test_bf16_4bit_smollm2_greedy_parity(smollm2_4bit):
    _, (model, tokenizer) = smollm2_4bit
    assert model_dtype(model) == mx.bfloat16
    # Short prompts that continue by repeating themselves: at a second per
    # token there is no room for a code file, and drafts must be accepted.
    prompts = [tokenizer.encode(t * 4) for t in ("the cat sat on the mat. ",
                                                  "one two three four. ")]
    identical, usage = _parity(model, tokenizer, dict(mode="ngram", num_speculative_tokens=4),
                               max_tokens=12, prompts=prompts)
    assert identical >= 1, identical
    assert sum(u["accepted_tokens"] for u in usage) > 0


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_qwen3_4bit_through_the_engine(qwen3_4bit_path, mode):
    from mlx_lm import load

    model, tokenizer = load(str(qwen3_4bit_path))
    assert model_dtype(model) == mx.bfloat16
    kw = dict(mode=mode, num_speculative_tokens=4)
    if mode == "draft":  # the folder drafts for itself: every greedy draft should match
        kw["draft_model_path"] = str(qwen3_4bit_path)
    identical, usage = _parity(model, tokenizer, kw, n=6, max_tokens=16)
    assert identical >= 4, identical
    assert sum(u["accepted_tokens"] for u in usage) > 0


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_qwen3_4bit_through_the_server(qwen3_4bit_path, mode):
    from conftest import LiveServer

    spec = SpecDecodeConfig(mode=mode, num_speculative_tokens=4, dynamic=False,
                            adaptive_k=False, calibration_seconds=0,
                            draft_model_path=str(qwen3_4bit_path) if mode == "draft" else None)
    servers = [LiveServer(qwen3_4bit_path, max_batch_size=4),
               LiveServer(qwen3_4bit_path, max_batch_size=4, spec=spec)]
    try:
        outs = []
        for s in servers:
            r = httpx.post(s.url + "/v1/completions", timeout=120, json={
                "model": s.model, "prompt": SOURCE[:200] + SOURCE[:60], "max_tokens": 16,
                "temperature": 0})
            assert r.status_code == 200, r.text
            outs.append(r.json())
    finally:
        for s in servers:
            s.close()
    plain, spec_out = outs
    assert "spec_decode" in spec_out["usage"]
    assert spec_out["usage"]["spec_decode"]["draft_tokens"] > 0
    if spec_out["choices"][0]["text"] != plain["choices"][0]["text"]:
        from mlx_lm import load

        model, tokenizer = load(str(qwen3_4bit_path))
        prompt = tokenizer.encode(SOURCE[:200] + SOURCE[:60])
        assert_same_or_near_tie(model, prompt, tokenizer.encode(spec_out["choices"][0]["text"]),
                                tokenizer.encode(plain["choices"][0]["text"]), mx.bfloat16)
