"""Learned drafters that ship with checkpoints or beside them: MTP layers
(``mtp.py``), EAGLE-3 heads (``eagle3.py``) and DFlash block drafters
(``dflash.py``); here, what they share: the SwiGLU MLP, a drafter folder's
config, the target's compute dtype and a cast to it, and how each takes its
weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from ...runtime import mlx_lm_adapter


class GatedMLP(nn.Module):
    """The SwiGLU MLP of Llama/Qwen-style layers, as both heads' layers use it."""

    def __init__(self, H: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(H, inner, bias=False)
        self.up_proj = nn.Linear(H, inner, bias=False)
        self.down_proj = nn.Linear(inner, H, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def drafter_config(folder) -> dict:
    """A ``--draft-model`` folder's ``config.json``; ``ValueError`` naming it
    when there is none to read."""
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--draft-model {folder}: no readable config.json ({e})")


def compute_dtype(model) -> mx.Dtype:
    """The floating dtype ``model`` computes in: that of its token
    embedding's output (a lazy lookup, nothing evaluated), which is the
    weight's dtype unquantized and the scales' dtype quantized."""
    embed = mlx_lm_adapter.token_embedding(model)
    return embed(mx.zeros((1, 1), mx.int32)).dtype


def cast_floating(module: nn.Module, dtype: mx.Dtype,
                  keep: Callable[[str], bool] = lambda path: False) -> nn.Module:
    """``module``'s floating parameters as ``dtype`` (packed quantized weights
    and integer maps stay as they are), but those ``keep(path)`` names (a
    family's float32 router biases)."""
    def cast(path: str, value: mx.array) -> mx.array:
        if mx.issubdtype(value.dtype, mx.floating) and not keep(path):
            return value.astype(dtype)
        return value

    module.update(tree_map_with_path(cast, module.parameters()))
    return module


def load_head_weights(head: nn.Module, weights: dict, quantization: Optional[dict],
                      what: str, target=None) -> None:
    """Quantize ``head`` as its checkpoint was (layers with ``.scales``, at
    the bits and group size the config gives the layer's path, else its
    own), load ``weights`` strictly, cast it to ``target``'s compute dtype
    (when given) and evaluate it now, on this thread (MLX streams belong to
    the thread that made them). ``what`` names the weights in the error when
    they do not fit."""
    if quantization:
        def layer_params(path: str, module: nn.Module):
            if f"{path}.scales" not in weights:
                return False
            own = quantization.get(path)
            return own if isinstance(own, dict) else True

        nn.quantize(head, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=layer_params)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # MLX lists the names on lines of their own: one line here
        raise ValueError(f"{what} do not fit: {' '.join(str(e).split())}") from None
    if target is not None:
        cast_floating(head, compute_dtype(target), mlx_lm_adapter.keeps_dtype(target))
    mx.eval(head.parameters())
