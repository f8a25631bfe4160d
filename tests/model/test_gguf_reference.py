"""The converted MLX model computes what the GGUF file means.

``gguf_convert`` renames tensors and, for llama, un-permutes the q/k rows so that
mlx-lm's standard (non-traditional, "rotate halves") RoPE applies. Mistakes
there do not crash anything: a model with a wrong RoPE convention or a missing
un-permute still loads and still emits plausible-looking text, only worse.

So this test compares against an independent reference: a plain numpy forward
pass that reads the tensors *as stored in the GGUF file* (``gguf.GGUFReader`` +
``gguf.quants.dequantize``) and follows llama.cpp's conventions rather than the
converter's code:

* llama: q/k stay permuted as stored and RoPE is llama.cpp's "normal" mode,
  which rotates adjacent pairs (x[2i], x[2i+1]);
* qwen2: weights are stored unpermuted, RoPE is NEOX mode (rotate halves
  (x[i], x[i + d/2])), and q/k/v have biases.

Full-vocabulary logits for a short prompt must agree with ``mlx_lm.load`` of
the converted folder to float tolerance, and so must the argmax at every
position.
"""

from __future__ import annotations

import numpy as np
import pytest

PROMPT = "The capital of France is"

# Maximum |logit difference| allowed, relative to the largest |reference logit|
# (about 27 for SmolLM2, 22 for Qwen2.5 on this prompt).
#
# Both sides use the same dequantized weights, so the only difference is
# rounding: the reference keeps the residual stream, norms, RoPE and softmax in
# float64 and runs matmuls in float32 BLAS; MLX runs everything in float32.
# Measured: 5.1e-5 (1.9e-6 relative) for SmolLM2, 2.8e-5 (1.3e-6 relative) for
# Qwen2.5-0.5B.
#
# Getting a convention wrong is far above this. Measured with the reference
# deliberately broken: the other RoPE style gives 6.4 (0.23 relative) for
# SmolLM2 and 7.9 (0.49) for Qwen2.5, and an argmax flips; a converter that
# skips the llama un-permute gives the same 6.4; even a wrong rope_theta
# (10000) gives 1.2 / 0.80 (0.045 / 0.037 relative). 1e-3 sits ~500x above the
# rounding noise and ~37x below the smallest of those.
REL_TOL = 1e-3

CASES = [
    pytest.param("smollm2-135m-instruct", "smollm2_path", id="llama-smollm2"),
    pytest.param("qwen2.5-coder-0.5b-instruct", "qwen05_path", id="qwen2-0.5b"),
]


# --- reading the GGUF file -------------------------------------------------


class GGUFWeights:
    """Dequantized float32 tensors of a GGUF file, by GGUF name, read on demand.

    Nothing is cached: each tensor is dequantized when the forward pass reaches
    it and dropped afterwards, so memory stays at about one tensor.
    """

    def __init__(self, path):
        import gguf

        self.reader = gguf.GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.field("general.architecture")

    def field(self, key, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def hparam(self, key, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def __contains__(self, name):
        return name in self.tensors

    def __getitem__(self, name) -> np.ndarray:
        from gguf.quants import dequantize

        t = self.tensors[name]
        w = dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        return np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])

    def rows(self, name, index: list[int]) -> np.ndarray:
        """Only the given rows of a 2-D tensor (an embedding lookup).

        The reader exposes a 2-D tensor's data as one row of bytes (or values)
        per row, so rows dequantize on their own.
        """
        from gguf.quants import dequantize

        t = self.tensors[name]
        return np.asarray(dequantize(t.data[index], t.tensor_type), dtype=np.float32)


def hyperparameters(g: GGUFWeights) -> dict:
    heads = int(g.hparam("attention.head_count"))
    hidden = int(g.hparam("embedding_length"))
    return {
        "layers": int(g.hparam("block_count")),
        "heads": heads,
        "kv_heads": int(g.hparam("attention.head_count_kv", heads)),
        "head_dim": int(g.hparam("rope.dimension_count", hidden // heads)),
        "eps": float(g.hparam("attention.layer_norm_rms_epsilon")),
        "rope_base": float(g.hparam("rope.freq_base", 10000.0)),
        # llama.cpp: LLM_ARCH_LLAMA uses LLAMA_ROPE_TYPE_NORM, QWEN2 uses NEOX.
        "rope_style": {"llama": "adjacent", "qwen2": "halves"}[g.arch],
    }


# --- the reference forward pass ------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_pairs(dim: int, style: str) -> tuple[np.ndarray, np.ndarray]:
    """Indices (i, j) of the element pairs that RoPE rotates together."""
    if style == "adjacent":  # llama.cpp normal mode: (x[2i], x[2i+1])
        first = np.arange(0, dim, 2)
        return first, first + 1
    if style == "halves":  # llama.cpp NEOX mode: (x[i], x[i + dim/2])
        first = np.arange(dim // 2)
        return first, first + dim // 2
    raise ValueError(style)


def rope(x: np.ndarray, base: float, style: str) -> np.ndarray:
    """Rotate x of shape (heads, seq, head_dim); the position is the seq index.

    Pair number i turns by angle position * base ** (-2i / head_dim).
    """
    _, seq, dim = x.shape
    freqs = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (dim/2,)
    angles = np.arange(seq, dtype=np.float64)[:, None] * freqs[None, :]  # (seq, dim/2)
    cos, sin = np.cos(angles), np.sin(angles)
    i, j = rope_pairs(dim, style)
    a, b = x[..., i], x[..., j]
    out = np.empty_like(x)
    out[..., i] = a * cos - b * sin
    out[..., j] = a * sin + b * cos
    return out


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T in float32 BLAS (upcasting 0.5B weights to float64 costs seconds)."""
    return (x.astype(np.float32) @ w.T).astype(np.float64)


def linear(g: GGUFWeights, name: str, x: np.ndarray) -> np.ndarray:
    """x @ W.T (+ b): GGUF stores W as (out_features, in_features)."""
    y = matmul(x, g[f"{name}.weight"])
    if f"{name}.bias" in g:
        y = y + g[f"{name}.bias"]
    return y


def attention(g: GGUFWeights, hp: dict, layer: int, x: np.ndarray) -> np.ndarray:
    seq = x.shape[0]
    h, kvh, d = hp["heads"], hp["kv_heads"], hp["head_dim"]
    p = f"blk.{layer}"
    q = linear(g, f"{p}.attn_q", x).reshape(seq, h, d).transpose(1, 0, 2)
    k = linear(g, f"{p}.attn_k", x).reshape(seq, kvh, d).transpose(1, 0, 2)
    v = linear(g, f"{p}.attn_v", x).reshape(seq, kvh, d).transpose(1, 0, 2)
    q = rope(q, hp["rope_base"], hp["rope_style"])
    k = rope(k, hp["rope_base"], hp["rope_style"])
    # Grouped-query attention: query head i reads kv head i // (h / kvh).
    k = np.repeat(k, h // kvh, axis=0)
    v = np.repeat(v, h // kvh, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)  # (h, seq, seq)
    scores = np.where(np.tril(np.ones((seq, seq), dtype=bool)), scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(seq, h * d)
    return linear(g, f"{p}.attn_output", out)


def mlp(g: GGUFWeights, layer: int, x: np.ndarray) -> np.ndarray:
    p = f"blk.{layer}"
    gate = linear(g, f"{p}.ffn_gate", x)
    up = linear(g, f"{p}.ffn_up", x)
    silu = gate / (1.0 + np.exp(-gate))
    return linear(g, f"{p}.ffn_down", silu * up)


def reference_logits(g: GGUFWeights, ids: list[int], hp: dict) -> np.ndarray:
    """(seq, vocab) float64 logits of a llama/qwen2 decoder, from GGUF tensors."""
    x = g.rows("token_embd.weight", ids).astype(np.float64)
    for layer in range(hp["layers"]):
        p = f"blk.{layer}"
        x = x + attention(g, hp, layer, rms_norm(x, g[f"{p}.attn_norm.weight"], hp["eps"]))
        x = x + mlp(g, layer, rms_norm(x, g[f"{p}.ffn_norm.weight"], hp["eps"]))
    x = rms_norm(x, g["output_norm.weight"], hp["eps"])
    head = "output.weight" if "output.weight" in g else "token_embd.weight"  # tied
    return matmul(x, g[head])


# --- the test ----------------------------------------------------------------


@pytest.mark.parametrize("name, folder_fixture", CASES)
def test_converted_logits_match_gguf_reference(name, folder_fixture, request):
    import mlx.core as mx
    from mlx_lm import load

    from mlx_lm_server.models.store import gguf_path

    folder = request.getfixturevalue(folder_fixture)
    model, tokenizer = load(str(folder))
    ids = list(tokenizer.encode(PROMPT))
    assert 4 <= len(ids) <= 10, ids

    logits = model(mx.array([ids])).astype(mx.float32)
    got = np.array(logits[0], dtype=np.float64)
    del model

    g = GGUFWeights(gguf_path(name))
    want = reference_logits(g, ids, hyperparameters(g))

    assert got.shape == want.shape
    scale = np.abs(want).max()
    diff = np.abs(got - want).max()
    assert diff <= REL_TOL * scale, (
        f"max |logit diff| {diff:.4g} exceeds {REL_TOL} x logit scale {scale:.4g}"
    )
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
