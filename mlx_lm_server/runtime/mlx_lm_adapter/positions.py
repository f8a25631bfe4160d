"""Positions per token: a tree of drafts in one pass, each node at its
depth (``node_positions``), where every attention layer's RoPE provably
takes the positions over (``node_positions_refused``)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .accessors import text_model


# ---- positions per token: a tree of drafts in one pass --------------------------
#
# Upstream's attention layers rotate queries and keys by ``self.rope(x,
# offset=cache.offset)``: one position per row, then consecutive ones. A
# tree's nodes sit at their row's offset plus their depth. ``mx.fast.rope``
# takes an array of offsets, one per batch entry, so each token goes through
# the same kernel as its own batch entry at its own position: no RoPE of our
# own, and every scaling upstream builds (Llama 3, YaRN, SuScaled) is kept.
#
# Only a module named ``rope`` is taken over. A family whose positions come
# another way (GPT-2's and StarCoder's learned embeddings of ``offset +
# arange(L)``, Qwen 1's and PLaMo's ``rotary_emb``, nanochat's RoPE as a
# function) would place every node at its index: ``node_positions_refused``
# says so, and such a model drafts chains.

# Families that use a token's position outside their RoPE too (this mlx-lm).
_POSITIONS_PAST_ROPE = {
    "mlx_lm.models.ministral3": "its attention scales queries by position (Llama 4 scaling)",
    "mlx_lm.models.mistral4": "its attention scales queries by position (Llama 4 scaling)",
}


class _NodeRoPE:
    """A layer's RoPE that, while a tree pass runs, places token n of row b
    at ``offset[b] + depth[b, n]``."""

    def __init__(self, inner, depths: list):
        self.inner = inner
        self.depths = depths  # one shared slot: the pass's [B, L] depths, or None

    def __call__(self, x, offset=0):
        depth = self.depths[0]
        if depth is None:
            return self.inner(x, offset=offset)
        if x.ndim != 4 or x.shape[0] != depth.shape[0] or x.shape[2] != depth.shape[1]:
            raise ValueError(f"a tree pass's RoPE got {x.shape}, not [B, heads, L, dims] for "
                             f"depths {depth.shape}: cannot place the nodes at their depths")
        B, H, L, D = x.shape
        start = offset[:, None] if isinstance(offset, mx.array) and offset.ndim else offset
        positions = (start + depth).reshape(-1).astype(mx.int32)
        flat = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
        out = self.inner(flat, offset=positions)
        return out.reshape(B, L, H, D).transpose(0, 2, 1, 3)


def node_positions(model) -> list:
    """The slot that sets per-token positions for ``model``'s attention
    layers: put ``[B, L]`` depths in ``slot[0]`` for a pass, None after.
    Installed once per model (a wrapper around each layer's ``rope``); it
    holds only where ``node_positions_refused`` is None."""
    inner = text_model(model)
    slot = inner.__dict__.get("_node_positions")
    if slot is None:
        slot = [None]
        for module in inner.modules():
            rope_module = getattr(module, "rope", None)
            if rope_module is not None and callable(rope_module) \
                    and not isinstance(rope_module, _NodeRoPE):
                module.rope = _NodeRoPE(rope_module, slot)
        object.__setattr__(inner, "_node_positions", slot)
    return slot


def node_positions_refused(model) -> Optional[str]:
    """Why ``node_positions`` cannot place a tree's nodes at their depths in
    ``model`` (None: it can). Strict: every decoder layer must rotate through
    a ``rope`` module it took over, and the family must use positions nowhere
    else; a layer without one (learned position embeddings, a RoPE under
    another name or applied as a function, a recurrent mixer) refuses.
    Found once per model."""
    node_positions(model)
    inner = text_model(model)
    verdict = inner.__dict__.get("_node_positions_refused")
    if verdict is None:
        verdict = (_refused(inner),)
        object.__setattr__(inner, "_node_positions_refused", verdict)
    return verdict[0]


def _refused(inner) -> Optional[str]:
    family = type(inner).__module__
    if family in _POSITIONS_PAST_ROPE:
        return f"{family}: {_POSITIONS_PAST_ROPE[family]}"
    layers = getattr(inner, "layers", None)
    if not layers:
        return f"{family}: no decoder layers found"
    for i, layer in enumerate(layers):
        if layer is None:  # another pipeline rank's layer
            continue
        if not any(isinstance(getattr(m, "rope", None), _NodeRoPE) for m in layer.modules()):
            return (f"{family}: layer {i} ({type(layer).__name__}) has no `rope` module, so "
                    "its positions cannot follow a node's depth")
    return None
