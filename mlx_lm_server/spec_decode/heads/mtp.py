"""A checkpoint's own multi-token-prediction (MTP) layer, as a drafter.

Qwen3.5 / Qwen3.6 and Qwen3-Next checkpoints train one extra decoder layer
(``mtp.*``) to predict the token after next. Given the target's hidden state
h_t at position t (after its final norm, as vLLM's ``qwen3_next_mtp.py`` and
mlx-vlm feed it) and the token x_{t+1} that followed:

    h' = mtp.norm(layers(fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)])))
    logits(x_{t+2}) = lm_head(h')

with the target's own embedding and output projection. Drafting deeper
chains the head: h' and the token drafted from it are the next step's
input. The layers are the target family's full-attention decoder layer with
their own KV cache, at the position of h_t.

Weights come from the target checkpoint itself (keys ``mtp.*``, RMSNorm
weights zero-centred as Qwen3.5 stores them: +1 here, as mlx-lm does for
the target's own norms) or from a split drafter folder (``model_type:
qwen3_5_mtp``, keys without the prefix, norms already shifted; quantized or
not). mlx-lm's conversions drop ``mtp.*`` (its ``sanitize``), so a model
converted by ``mlx_lm.convert`` has no MTP layer: that is refused by name,
and ``auto`` says so at start-up. ``mlx-lm-server-models convert``
(``models/convert.py``) keeps it: in the folder, as ``mtp.*`` in the head's
own layout (files marked ``format: mlx``, norms shifted, a nextn layer
renamed and sanitized already), quantized by the target's settings or not;
or as a split folder (``qwen3_5_mtp``, or ``glm4_moe_mtp`` /
``deepseek_mtp`` for a nextn layer, whose config says its decoder layer).

DeepSeek-V3 and GLM-4.5 checkpoints (``num_nextn_predict_layers``) keep the
same module as their decoder layer ``num_hidden_layers`` under other names
(``eh_proj`` for ``fc``, ``enorm`` / ``hnorm``, ``shared_head.norm``; vLLM's
``deepseek_mtp.py``), with the forward above; its copies of the embedding
and output projection (``embed_tokens``, ``shared_head.head``) equal the
target's and are not loaded. Its decoder layer goes through the family's
own ``sanitize`` (experts stacked, fp8 dequantized). Only the first nextn
layer is used: deeper drafts chain it, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import glob
import json
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ...runtime import mlx_lm_adapter
from . import load_head_weights

# What a checkpoint's MTP layer must hold (the layers' own keys vary by family).
REQUIRED = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
            "norm.weight")
# RMSNorm weights Qwen3.5 stores zero-centred (weight - 1).
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                ".q_norm.weight", ".k_norm.weight", "norm.weight",
                "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
# A split drafter folder's model_type: Qwen's, and vLLM's names for a nextn layer on its own.
SPLIT_MODEL_TYPES = ("qwen3_5_mtp", "qwen3_next_mtp", "deepseek_mtp", "glm4_moe_mtp")
# A nextn layer's names for the MTP parts (DeepSeek-V3, GLM-4.5), and its
# copies of the target's embedding and output projection (not loaded).
NEXTN_NAMES = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
               "hnorm.weight": "pre_fc_norm_hidden.weight",
               "shared_head.norm.weight": "norm.weight"}
NEXTN_SHARED = ("embed_tokens.", "shared_head.head.")


class MTPHead(nn.Module):
    """The MTP layer(s) over the target's hidden states; the target's
    embedding and output projection are passed in, never copied."""

    def __init__(self, hidden_size: int, eps: float, layers: list, chain_normed: bool = True):
        super().__init__()
        # What a chained draft step is fed: Qwen3.5 / Qwen3-Next's state after
        # mtp.norm (vLLM's qwen3_next_mtp.py); a nextn layer's before its
        # shared_head.norm, which only the logits see (vLLM's deepseek_mtp.py).
        self.chain_normed = chain_normed
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embeddings: mx.array,  # [B, T, H] embeddings of x_{t+1}
                 hidden: mx.array,  # [B, T, H] the target's h_t (or the head's own, chained)
                 cache: Optional[list] = None) -> mx.array:
        """[B, T, H]: the head's hidden states, one per (h_t, x_{t+1}) pair."""
        h = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = mlx_lm_adapter.attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask=mask, cache=c)
        return self.norm(h) if self.chain_normed else h

    def projection(self, project: Callable[[mx.array], mx.array]) -> Callable:
        """The head's states -> logits, through the target's ``project``."""
        if self.chain_normed:
            return project
        return lambda states: project(self.norm(states))

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def probe(self, num_tokens: int, cache: list) -> mx.array:
        """A pass over ``num_tokens`` zero pairs (what the KV budget measures
        a cache's bytes per token with), in the head's own dtype."""
        x = mx.zeros((1, num_tokens, self.norm.weight.shape[0]), self.norm.weight.dtype)
        return self(x, x, cache)


def mtp_layer_count(config: dict) -> int:
    """How many MTP layers a checkpoint's config declares (0: none)."""
    text = config.get("text_config", config)
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if text.get(key):
            return int(text[key])
    return 0


def nextn_prefix(config: dict) -> Optional[str]:
    """Where a checkpoint keeps its first nextn layer, ``model.layers.{L}.``
    (None: its config declares none)."""
    text = config.get("text_config", config)
    if not text.get("num_nextn_predict_layers") or "num_hidden_layers" not in text:
        return None
    return f"model.layers.{text['num_hidden_layers']}."


def _nextn(target, weights: dict) -> dict:
    """A nextn layer's tensors as the head's: its MTP parts renamed, its
    decoder layer's as ``layers.0.*`` after the family's ``sanitize``."""
    parts = {NEXTN_NAMES[k]: v for k, v in weights.items() if k in NEXTN_NAMES}
    layer = {k: v for k, v in weights.items()
             if k not in NEXTN_NAMES and not k.startswith(NEXTN_SHARED)}
    if layer:
        layer = mlx_lm_adapter.sanitized_layer(target, layer)
    return {**parts, **{"layers.0." + k: v for k, v in layer.items()}}


def load_mtp_head(target, target_path: str, draft_path: Optional[str] = None,
                  what: str = "--spec-decode mtp") -> MTPHead:
    """The MTP head of ``target`` (loaded from ``target_path``): from the
    checkpoint's own weights (``mtp.*``, or a nextn layer in the Hugging
    Face layout), or from the split drafter folder ``draft_path``. Raises
    ``ValueError`` saying what is missing, after ``what``."""
    folder = draft_path or target_path
    config = json.loads((Path(folder) / "config.json").read_text())
    if draft_path is not None:
        if config.get("model_type") not in SPLIT_MODEL_TYPES:
            raise ValueError(f"--draft-model {draft_path} is not an MTP drafter (model_type "
                             f"{config.get('model_type')!r}, expected one of "
                             f"{', '.join(SPLIT_MODEL_TYPES)})")
        weights, shift = _read(draft_path, prefix=""), False  # norms stored shifted
        quantization = config.get("quantization")
    else:
        weights = _read(target_path, prefix="mtp.")
        # Written by MLX tools (``mlx-lm-server-models convert``): norms shifted then.
        shift = not any(f.get("format") == "mlx" for f in _metadata(target_path))
        quantization = drafter_quantization(config.get("quantization"))
    count = mtp_layer_count(config) or 1
    nextn = nextn_prefix(config)  # DeepSeek-V3 / GLM-4.5: decoder layer num_hidden_layers
    first_index = 0
    if nextn is not None:
        shift, count, first_index = False, 1, int(nextn.split(".")[2])
        if not weights and draft_path is None:  # the Hugging Face layout (a conversion's: mtp.*)
            weights = _nextn(target, _read(target_path, prefix=nextn))
    missing = [k for k in REQUIRED if k not in weights]
    if missing:
        names = [("" if draft_path else "mtp.") + k for k in missing]
        if draft_path is None and nextn is not None:
            back = {v: k for k, v in NEXTN_NAMES.items()}
            names += [nextn + back[k] for k in missing]
        if weights:
            raise ValueError(f"{what}: the MTP layer in {folder} is incomplete (missing "
                             f"{', '.join(names)})")
        raise ValueError(
            f"{what}: {folder} has no MTP layer (looked for {', '.join(names)}). "
            "mlx-lm's conversions (the mlx-community folders among them) drop the MTP "
            "weights: graft them back from the Hugging Face original with "
            "`mlx-lm-server-models add-drafter TARGET --from ORIGINAL` (only the shards "
            "that hold them are read), convert the original with `mlx-lm-server-models "
            "convert SRC OUT --quantize 4`, or pass a split MTP drafter (model_type "
            "qwen3_5_mtp) with --draft-model")
    head = _build(target, max(count, _layers_in(weights)), first_index)
    head.chain_normed = nextn is None
    weights = _stack_experts(_shift_norms(weights) if shift else weights)
    load_head_weights(head, weights, quantization, f"{what}: the MTP weights and this model",
                      target)
    return head


def drafter_quantization(quantization: Optional[dict]) -> Optional[dict]:
    """A converted target's quantization settings as its MTP layer's: the
    bits and group size, and the per-layer ones recorded under ``mtp.``."""
    if not quantization:
        return None
    out = {k: v for k, v in quantization.items() if not isinstance(v, dict)}
    out.update({k[len("mtp."):]: v for k, v in quantization.items()
                if k.startswith("mtp.") and isinstance(v, dict)})
    return out


def dropped_layer_line(folder: str) -> Optional[str]:
    """The start-up line for a folder (one without its MTP weights, nor a
    split drafter beside it) whose config declares MTP layers: its
    conversion dropped them (mlx-lm's do), and the command that grafts them
    back. None where the config declares none."""
    try:
        count = mtp_layer_count(json.loads((Path(folder) / "config.json").read_text()))
    except (OSError, ValueError):
        return None
    if not count:
        return None
    return (f"{folder} declares {count} MTP layer(s) but holds none of their weights: its "
            "conversion dropped them (mlx-lm's do, and so every mlx-community folder), so "
            "--spec-decode auto drafts with prompt lookup alone. `mlx-lm-server-models "
            f"add-drafter {folder} --from ORIGINAL` grafts them from the Hugging Face "
            "original (ORIGINAL: its folder or hub id; only the shards that hold them are read)")


def split_model_type(config: dict) -> str:
    """The ``model_type`` a split drafter folder of this target's MTP layer
    says (``SPLIT_MODEL_TYPES``)."""
    family = config.get("model_type", "")
    if nextn_prefix(config) is not None:
        return "glm4_moe_mtp" if family.startswith("glm") else "deepseek_mtp"
    return "qwen3_next_mtp" if family == "qwen3_next" else "qwen3_5_mtp"


def _build(target, num_layers: int, first_index: int = 0) -> MTPHead:
    """The head's layers: the target's full-attention decoder layer, built
    as layer ``first_index`` on (a nextn layer's index makes it an MoE
    layer where the family's later layers are)."""
    args = mlx_lm_adapter.text_args(target)
    layer_args = args
    if hasattr(args, "full_attention_interval"):  # hybrid families: every layer full
        layer_args = dataclasses.replace(args, full_attention_interval=1)
    layers = [mlx_lm_adapter.full_attention_layer(target, layer_args, first_index + i)
              for i in range(num_layers)]
    return MTPHead(args.hidden_size, args.rms_norm_eps, layers)


def _read(folder: str, prefix: str) -> dict:
    """The tensors under ``prefix`` in a folder's safetensors, prefix removed."""
    out = {}
    for path in sorted(glob.glob(str(Path(folder) / "*.safetensors"))):
        for key, value in mx.load(path).items():
            if key.startswith(prefix):
                out[key[len(prefix):]] = value
    return out


def _metadata(folder: str) -> list[dict]:
    return [mx.load(path, return_metadata=True)[1]
            for path in sorted(glob.glob(str(Path(folder) / "*.safetensors")))]


def _layers_in(weights: dict) -> int:
    ids = {int(k.split(".")[1]) for k in weights if k.startswith("layers.")}
    return max(ids) + 1 if ids else 0


def _shift_norms(weights: dict) -> dict:
    return {k: v + 1.0 if v.ndim == 1 and k.endswith(ZERO_CENTRED) else v
            for k, v in weights.items()}


def _stack_experts(weights: dict) -> dict:
    """Hugging Face's MoE expert layouts as mlx-lm's ``switch_mlp``: fused
    ``experts.gate_up_proj`` / ``experts.down_proj``, or one tensor per expert."""
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".mlp.experts.gate_up_proj")]:
        prefix = key[: -len(".experts.gate_up_proj")]
        gate_up = out.pop(key)
        mid = gate_up.shape[-2] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    for key in [k for k in weights if k.endswith(".mlp.experts.0.up_proj.weight")]:
        prefix = key[: -len(".experts.0.up_proj.weight")]
        count = len({k.split(".experts.")[1].split(".")[0] for k in weights
                     if k.startswith(f"{prefix}.experts.")})
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(
                [out.pop(f"{prefix}.experts.{e}.{name}.weight") for e in range(count)])
    return out
