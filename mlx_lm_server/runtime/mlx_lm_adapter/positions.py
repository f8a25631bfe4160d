"""Positions per token: a tree of drafts in one pass, each node at its
depth (``node_positions``), where every attention layer's RoPE provably
takes the positions over (``node_positions_refused``); and a prompt's
M-RoPE positions (time, height, width per token) while it is prefilled
(``grid_positions``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

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


class _Grid:
    """A prompt's M-RoPE positions for one pass: ``positions`` [3, B, L]
    (time, height, width; absolute, not from the cache's offset) and the
    axis each rotated frequency reads (``axes`` [dims / 2])."""

    def __init__(self, positions: mx.array, axes: mx.array):
        self.positions = positions
        self.axes = axes


class _NodeRoPE:
    """A layer's RoPE that, while a tree pass runs, places token n of row b
    at ``offset[b] + depth[b, n]``; while a prompt with an image grid is
    prefilled (a ``_Grid`` in the slot), at its M-RoPE positions."""

    def __init__(self, inner, depths: list):
        self.inner = inner
        self.depths = depths  # one shared slot: the pass's [B, L] depths, a _Grid, or None

    def __call__(self, x, offset=0):
        depth = self.depths[0]
        if depth is None:
            return self.inner(x, offset=offset)
        if isinstance(depth, _Grid):
            return self._grid(x, depth)
        if x.ndim != 4 or x.shape[0] != depth.shape[0] or x.shape[2] != depth.shape[1]:
            raise ValueError(f"a tree pass's RoPE got {x.shape}, not [B, heads, L, dims] for "
                             f"depths {depth.shape}: cannot place the nodes at their depths")
        B, H, L, D = x.shape
        start = offset[:, None] if isinstance(offset, mx.array) and offset.ndim else offset
        positions = (start + depth).reshape(-1).astype(mx.int32)
        flat = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
        out = self.inner(flat, offset=positions)
        return out.reshape(B, L, H, D).transpose(0, 2, 1, 3)

    def _grid(self, x, grid: _Grid):
        # M-RoPE rotates each frequency by one of three positions: upstream's
        # RoPE at each axis's positions, each dimension taken from its axis.
        _, B, L = grid.positions.shape
        if x.ndim != 4 or x.shape[0] != B or x.shape[2] != L:
            raise ValueError(f"a prompt's M-RoPE got {x.shape}, not [B, heads, L, dims] for "
                             f"positions {grid.positions.shape}")
        H, D = x.shape[1], x.shape[3]
        flat = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
        t, h, w = (self.inner(flat, offset=grid.positions[a].reshape(-1).astype(mx.int32))
                   for a in range(3))
        # Frequency j turns dimensions j and j + dims / 2; the rest pass through.
        rest = mx.zeros((D - 2 * grid.axes.size,), dtype=mx.int32)
        axis = mx.concatenate([grid.axes, grid.axes, rest])
        out = mx.where(axis == 0, t, mx.where(axis == 1, h, w))
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


# ---- a prompt's M-RoPE positions ---------------------------------------------------
#
# Qwen's M-RoPE (Qwen2-VL on) gives each token three positions (time, height,
# width: an image's tokens by their place in its grid) and rotates each
# frequency of the RoPE by one of them. Text has the three equal, where it is
# upstream's RoPE; only a prompt with an image needs the three apart, and only
# while it is prefilled (the server numbers the text after the last image from
# its index: see ``vision/tower.py``).


def grid_refused(model, num_frequencies: int) -> Optional[str]:
    """Why ``grid_positions`` cannot place ``model``'s tokens at M-RoPE
    positions over ``num_frequencies`` rotated frequencies (None: it can):
    every ``rope`` module must be upstream's plain RoPE rotating the two
    halves of its dimensions (not interleaved pairs), over that many
    frequencies; the layers without one must use no positions (the caller
    knows the family: its recurrent layers)."""
    node_positions(model)
    wrapped = [m.rope.inner for m in text_model(model).modules()
               if isinstance(getattr(m, "rope", None), _NodeRoPE)]
    if not wrapped:
        return f"{type(text_model(model)).__module__}: no `rope` module to take the positions"
    for rope_module in wrapped:
        dims = getattr(rope_module, "dims", None)
        traditional = getattr(rope_module, "traditional", None)
        if type(rope_module).__name__ != "RoPE" or traditional is not False:
            return (f"its RoPE ({type(rope_module).__name__}, traditional={traditional}) is not "
                    "a plain one over the halves of its dimensions")
        if dims != 2 * num_frequencies:
            return (f"its RoPE rotates {dims} dimensions, the checkpoint's M-RoPE "
                    f"{2 * num_frequencies}")
    return None


@contextmanager
def grid_positions(model, positions: mx.array, axes: Sequence[int]):
    """While in the block, ``model``'s passes place token n of row b at the
    M-RoPE positions ``positions[:, b, n]`` ([3, B, L]: time, height, width),
    rotating frequency j by axis ``axes[j]`` (0, 1 or 2). Holds only where
    ``grid_refused`` is None."""
    slot = node_positions(model)
    if slot[0] is not None:
        raise RuntimeError("a pass's positions are set already")
    slot[0] = _Grid(positions, mx.array(list(axes), dtype=mx.int32))
    try:
        yield
    finally:
        slot[0] = None
