"""An EAGLE-3 head, as the ``speculators`` format stores it, as a drafter.

EAGLE-3 trains one decoder layer on the target's hidden states at three of
its layers (``eagle_aux_hidden_state_layer_ids``, by default 2, L//2 and
L-3 in Hugging Face's ``hidden_states`` numbering: the outputs of decoder
layers 1, L//2 - 1 and L-4). Given those at position t, concatenated, and the
token x_{t+1}:

    g = fc(cat[aux_a, aux_b, aux_c])                     # target features -> H
    h = layer(cat[input_norm(embed(x_{t+1})), hidden_norm(g)], residual g)
    logits over the draft vocabulary = lm_head(norm(h))  # target id = d + d2t[d]

and drafting deeper feeds the layer's own output h (before ``norm``) in
place of g. The layer's attention takes the 2H-wide concatenation (q/k/v
are 2H wide). The same pairs (state, next token) as an MTP layer, so the
same proposer drives both (``proposer/head.py``); this module only says how
one pair goes through the head.

Checkpoints: ``config.json`` with ``transformer_layer_config`` (a Llama-style
layer), ``draft_vocab_size``, the norm flags; weights ``fc``, ``layers.0.*``
(SpecForge: ``midlayer.*``), ``norm``, ``lm_head``, ``d2t`` (and ``t2d``,
unused), optionally ``embed_tokens`` (else the target's embedding).
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ...runtime import mlx_lm_adapter
from . import GatedMLP, cast_floating, compute_dtype, drafter_config, load_head_weights

# Flags some trainers write that change the forward in ways not implemented here.
REFUSED_FLAGS = ("norm_output", "fc_norm")


class _Attention(nn.Module):
    def __init__(self, cfg: dict, input_size: int):
        super().__init__()
        H = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv_heads = cfg.get("num_key_value_heads", self.n_heads)
        self.head_dim = cfg.get("head_dim") or H // self.n_heads
        self.scale = self.head_dim ** -0.5
        bias = cfg.get("attention_bias", False)
        self.q_proj = nn.Linear(input_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=bias)
        rope = cfg.get("rope_parameters") or {}
        self.rope = mlx_lm_adapter.rope(
            self.head_dim, rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            cfg.get("rope_traditional", False), cfg.get("rope_scaling"),
            cfg.get("max_position_embeddings"))

    def __call__(self, x, mask, cache):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = mlx_lm_adapter.attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _Layer(nn.Module):
    """The head's decoder layer: attention over cat[embedding, hidden]."""

    def __init__(self, cfg: dict, norm_before_residual: bool):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.self_attn = _Attention(cfg, 2 * H)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = GatedMLP(H, cfg["intermediate_size"])

    def __call__(self, embeddings, hidden, mask, cache):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        h = mx.concatenate([self.input_layernorm(embeddings), normed], axis=-1)
        h = residual + self.self_attn(h, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """``__call__(embeddings, hidden, cache)``: hidden is the target's
    concatenated aux states [.., 3 * H_target] (through ``fc``) or the head's
    own output [.., H] (chained); returns the head's states [B, T, H]."""

    def __init__(self, config: dict, target_hidden: int, vocab_size: int):
        super().__init__()
        cfg = config["transformer_layer_config"]
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.hidden_size = H
        self.vocab_size = vocab_size
        self.draft_vocab_size = int(config.get("draft_vocab_size") or vocab_size)
        self.fc = nn.Linear(3 * target_hidden, H, bias=False)
        if config.get("norm_before_fc"):
            self.input_norm = nn.RMSNorm(3 * target_hidden, eps=eps)
        self.layers = [_Layer(cfg, bool(config.get("norm_before_residual")))]
        self.norm = nn.RMSNorm(H, eps=eps)
        self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False)
        if self.draft_vocab_size != vocab_size:
            self.d2t = mx.zeros((self.draft_vocab_size,), mx.int32)

    def __call__(self, embeddings, hidden, cache: Optional[list] = None):
        if hidden.shape[-1] != self.hidden_size:  # the target's features
            if "input_norm" in self:
                hidden = self.input_norm(hidden)
            hidden = self.fc(hidden)
        cache = cache if cache is not None else [None]
        mask = mlx_lm_adapter.attention_mask(hidden, cache[0])
        return self.layers[0](embeddings, hidden, mask, cache[0])

    def draft_ids(self) -> mx.array:
        """[Dv] the target id of each draft-vocabulary entry (``d2t`` holds offsets)."""
        ids = mx.arange(self.draft_vocab_size, dtype=mx.int32)
        return ids + self.d2t if "d2t" in self else ids

    def logits(self, states: mx.array) -> mx.array:
        """[..., V] over the target's vocabulary: the draft vocabulary's logits
        at their target ids, -inf elsewhere (never drafted, q = 0 there)."""
        draft = self.lm_head(self.norm(states))
        if "d2t" not in self:
            return draft
        full = mx.full(draft.shape[:-1] + (self.vocab_size,), -mx.inf, draft.dtype)
        full[..., self.draft_ids()] = draft
        return full

    def make_cache(self) -> list:
        return [KVCache()]

    def probe(self, num_tokens: int, cache: list) -> mx.array:
        x = mx.zeros((1, num_tokens, self.hidden_size), self.norm.weight.dtype)
        return self(x, x, cache)


def aux_layer_ids(config: dict, num_target_layers: int) -> list[int]:
    """The target decoder layers whose outputs the head reads, 0-based: Hugging
    Face's ``hidden_states[i]`` is the output of decoder layer i - 1."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        L = num_target_layers
        ids = [2, L // 2, L - 3]
    return [max(int(i) - 1, 0) for i in ids]


def is_eagle3(config: dict) -> bool:
    """A ``speculators`` EAGLE-3 config (or SpecForge's, which has the layer config)."""
    kind = config.get("speculators_model_type") or config.get("model_type")
    return kind == "eagle3" or "transformer_layer_config" in config


def load_eagle3_head(target, draft_path: str) -> tuple[Eagle3Head, list[int], Optional[nn.Module]]:
    """(the head, the target layers it reads, its own embedding or None:
    the target's). Raises ``ValueError`` saying what does not fit."""
    folder = Path(draft_path)
    config = drafter_config(folder)
    if not is_eagle3(config):
        kind = config.get("speculators_model_type") or config.get("model_type")
        raise ValueError(f"--spec-decode eagle3: {draft_path} is not an EAGLE-3 head "
                         f"(speculators_model_type {kind!r}, no transformer_layer_config)")
    flags = [f for f in REFUSED_FLAGS if config.get(f)]
    if flags:
        raise ValueError(f"--spec-decode eagle3: {draft_path} sets {', '.join(flags)}, which "
                         "this server does not implement")
    args = mlx_lm_adapter.text_args(target)
    num_layers = len(mlx_lm_adapter.text_model(target).model.layers)
    target_hidden = int(config.get("target_hidden_size") or args.hidden_size)
    if target_hidden != args.hidden_size:
        raise ValueError(f"--spec-decode eagle3: the head reads hidden states of size "
                         f"{target_hidden}, the target's are {args.hidden_size}")
    vocab = int(config["transformer_layer_config"].get("vocab_size") or args.vocab_size)
    layers = aux_layer_ids(config, num_layers)
    if not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"--spec-decode eagle3: aux layers {layers} outside the target's "
                         f"{num_layers}")
    weights = {}
    for path in sorted(glob.glob(str(folder / "model*.safetensors"))):
        weights.update(mx.load(path))
    if not weights:
        raise ValueError(f"--spec-decode eagle3: {draft_path} has no model*.safetensors")
    weights = _sanitize(weights)
    head = Eagle3Head(config, target_hidden, vocab)
    embed = None
    if "embed_tokens.weight" in weights:  # trained with its own embedding
        table = weights.pop("embed_tokens.weight")
        embed = nn.Embedding(*table.shape)
        embed.weight = table
    if head.draft_vocab_size == vocab:
        weights.pop("d2t", None)  # the identity map
    load_head_weights(head, weights, config.get("quantization"),
                      f"--spec-decode eagle3: the weights in {draft_path} and its config", target)
    if embed is not None:
        cast_floating(embed, compute_dtype(target))
    return head, layers, embed


def _sanitize(weights: dict) -> dict:
    out = {}
    for key, value in weights.items():
        if key == "t2d" or key.startswith("verifier_") or "rotary_emb.inv_freq" in key:
            continue
        if key.startswith("midlayer."):  # SpecForge's name for the one layer
            key = "layers.0." + key[len("midlayer."):]
        if key == "d2t":
            value = value.astype(mx.int32)
        out[key] = value
    return out
