"""A DFlash block drafter (z-lab's ``DFlashDraftModel``) as a drafter.

DFlash drafts a whole block in one pass instead of one token per pass. Its
context is the target's hidden states at a few decoder layers
(``target_layer_ids``, 0-based decoder layer outputs), concatenated and
projected once:

    c_t = hidden_norm(fc(cat[target layers at t]))    # per target position

Each of its decoder layers turns c_t into keys and values only (its own
``k_proj``/``v_proj``, ``k_norm``, RoPE at t): context positions have no
queries, so the cache holds nothing but a function of the target's states,
never of a draft. The block [x_n, MASK, ..., MASK] (x_n the token not yet in
the target's cache, at position n) goes through the layers attending,
without a causal mask, to the whole context and the whole block; position j
of the block guesses x_{n+j}, all K at once, through the target's own output
projection. The block's keys and values are dropped after the pass.

So a kept draft needs no rollback: the verification's features of the
tokens kept come back as context, and the cache equals a fresh pass over the
target's states, always (a test checks it).

Checkpoints: a Qwen3-style ``config.json`` with ``block_size`` and
``dflash_config`` (``mask_token_id``, ``target_layer_ids``); weights ``fc``,
``hidden_norm``, ``layers.N.*`` (q/k/v/o, ``q_norm``/``k_norm``, a SwiGLU
MLP, two norms), ``norm``; the embedding and the output projection are the
target's (an ``embed_tokens`` of its own is used when present).
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ...kv.unfused import MOST_UNFUSED_QUERIES, fused_attention_built_per_shape, unfused_attention
from ...runtime import mlx_lm_adapter
from . import GatedMLP, cast_floating, compute_dtype, drafter_config, load_head_weights

# A block's pass attends to a context one step longer each time: on CUDA the
# fused kernel would be built anew at every step (kv/unfused.py).
UNFUSED = fused_attention_built_per_shape()


class _Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv_heads = cfg.get("num_key_value_heads", self.n_heads)
        self.head_dim = cfg.get("head_dim") or H // self.n_heads
        self.scale = self.head_dim ** -0.5
        bias = cfg.get("attention_bias", False)
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=eps)

    def keys_values(self, x, rope, offset):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(self, x, rope, cache, mask):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=cache.offset)
        k, v = self.keys_values(x, rope, cache.offset)
        k, v = cache.update_and_fetch(k, v)
        if UNFUSED and L <= MOST_UNFUSED_QUERIES:  # see kv/unfused.py
            out = unfused_attention(q, k, v, self.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = _Attention(cfg)
        self.mlp = GatedMLP(H, cfg["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)

    def __call__(self, x, rope, cache, mask):
        h = x + self.self_attn(self.input_layernorm(x), rope, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(nn.Module):
    """``context(features, cache)`` appends the target's states to the cache;
    ``block(embeddings, cache)`` gives the block's states [B, L, H] (after
    the final norm) and leaves its L entries at every row's end, for the
    caller to roll back."""

    def __init__(self, config: dict, num_features: int):
        super().__init__()
        H, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.hidden_size = H
        self.num_features = num_features
        self.fc = nn.Linear(num_features * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.layers = [_Layer(config) for _ in range(config["num_hidden_layers"])]
        self.norm = nn.RMSNorm(H, eps=eps)
        head_dim = self.layers[0].self_attn.head_dim
        rope = config.get("rope_parameters") or {}
        self.rope = mlx_lm_adapter.rope(
            head_dim, rope.get("rope_theta", config.get("rope_theta", 10000.0)), False,
            config.get("rope_scaling"), config.get("max_position_embeddings"))
        self.mask_token_id = int(_dflash_field(config, "mask_token_id"))
        self.block_size = int(config.get("block_size", 16))

    def context(self, features: mx.array, cache: list) -> None:
        c = self.hidden_norm(self.fc(features))
        for layer, layer_cache in zip(self.layers, cache):
            k, v = layer.self_attn.keys_values(c, self.rope, layer_cache.offset)
            layer_cache.update_and_fetch(k, v)

    def block(self, embeddings: mx.array, cache: list) -> mx.array:
        mask = _block_mask(cache[0], embeddings.shape[1])
        h = embeddings
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, self.rope, layer_cache, mask)
        return self.norm(h)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def probe(self, num_tokens: int, cache: list) -> mx.array:
        # The features' width, not fc's weight's (packed when quantized).
        x = mx.zeros((1, num_tokens, self.num_features * self.hidden_size),
                     self.norm.weight.dtype)
        self.context(x, cache)
        return cache[0].keys


def _block_mask(cache, num_new: int) -> Optional[mx.array]:
    """Each row's block sees its row's context (from its left padding to its
    end) and the whole block: [B, 1, 1, S] over the key length the write
    will return. None for a single sequence's plain cache (everything)."""
    ends = getattr(cache, "ends", None)
    if ends is None:
        return None
    from ...kv import key_length

    length = key_length(max(ends) + num_new)
    key = mx.arange(length)[None, :]
    end = mx.array(ends)[:, None] + num_new
    visible = (key >= cache.left_padding[:, None]) & (key < end)
    return visible[:, None, None, :]


def _dflash_field(config: dict, name: str):
    """A field of ``dflash_config`` (z-lab's checkpoints), or top-level."""
    inner = config.get("dflash_config") or {}
    return inner[name] if name in inner else config.get(name)


# Variants other checkpoints describe, not implemented here: a clear refusal.
def _refusal(config: dict) -> Optional[str]:
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        return "sliding-window layers"
    if _dflash_field(config, "causal") or config.get("dflash_query_causal"):
        return "a causal block"
    if _dflash_field(config, "attention_sink_bias"):
        return "attention sinks"
    if _dflash_field(config, "draft_window_size"):
        return "a draft window"
    if config.get("final_logit_softcapping"):
        return "logit soft-capping"
    return None


def is_dflash(config: dict) -> bool:
    return "dflash_config" in config or any("DFlash" in a for a in config.get("architectures") or [])


def load_dflash_head(target, draft_path: str) -> tuple[DFlashHead, list[int], Optional[nn.Module]]:
    """(the head, the target decoder layers it reads, its own embedding or
    None: the target's). Raises ``ValueError`` saying what does not fit."""
    folder = Path(draft_path)
    config = drafter_config(folder)
    if not is_dflash(config):
        raise ValueError(f"--spec-decode dflash: {draft_path} is not a DFlash drafter "
                         f"(no dflash_config, architectures {config.get('architectures')})")
    refused = _refusal(config)
    if refused:
        raise ValueError(f"--spec-decode dflash: {draft_path} uses {refused}, which this "
                         "server does not implement")
    args = mlx_lm_adapter.text_args(target)
    num_layers = len(mlx_lm_adapter.text_model(target).model.layers)
    if config.get("hidden_size") != args.hidden_size:
        raise ValueError(f"--spec-decode dflash: the drafter's hidden size is "
                         f"{config.get('hidden_size')}, the target's {args.hidden_size}")
    layers = [int(i) for i in _dflash_field(config, "target_layer_ids") or []]
    if not layers or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"--spec-decode dflash: target_layer_ids {layers} do not name "
                         f"layers of the target's {num_layers}")
    mask_id = _dflash_field(config, "mask_token_id")
    if mask_id is None or not 0 <= int(mask_id) < args.vocab_size:
        raise ValueError(f"--spec-decode dflash: mask_token_id {mask_id} is not in the "
                         f"target's vocabulary of {args.vocab_size}")
    weights = {}
    for path in sorted(glob.glob(str(folder / "*.safetensors"))):
        weights.update(mx.load(path))
    if not weights:
        raise ValueError(f"--spec-decode dflash: {draft_path} has no safetensors")
    weights = {k.removeprefix("model."): v for k, v in weights.items()
               if "rotary_emb.inv_freq" not in k}
    head = DFlashHead(config, len(layers))
    embed = None
    if "embed_tokens.weight" in weights:
        table = weights.pop("embed_tokens.weight")
        embed = nn.Embedding(*table.shape)
        embed.weight = table
    weights.pop("lm_head.weight", None)  # the target's output projection drafts
    load_head_weights(head, weights, config.get("quantization"),
                      f"--spec-decode dflash: the weights in {draft_path} and its config", target)
    if embed is not None:
        cast_floating(embed, compute_dtype(target))
    return head, layers, embed
