"""Learned drafters that ship with checkpoints or beside them: MTP layers
(``mtp.py``), EAGLE-3 heads (``eagle3.py``) and DFlash block drafters
(``dflash.py``); here, what they share: the SwiGLU MLP, a drafter folder's
config, and how each takes its weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn


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


def load_head_weights(head: nn.Module, weights: dict, quantization: Optional[dict],
                      what: str) -> None:
    """Quantize ``head`` as its checkpoint was (layers with ``.scales``), load
    ``weights`` strictly and evaluate them now, on this thread (MLX streams
    belong to the thread that made them). ``what`` names the weights in the
    error when they do not fit."""
    if quantization:
        nn.quantize(head, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{what} do not fit: {e}")
    mx.eval(head.parameters())
