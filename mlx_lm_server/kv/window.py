"""Per-row rollback of sliding-window attention layers: ``RaggedWindowKVCache``.

Upstream's ``BatchRotatingKVCache`` keeps one ring of ``max_size`` entries
with one write index for the whole batch. A verification pass writes k+1
entries and may keep fewer, differently per row; in that ring the entries a
pass overwrote (the oldest of the window) are gone, and rows cannot end at
different positions.

``RaggedWindowKVCache`` gives every row its own ring over its own positions:
position p of a row lives in slot ``p mod S``. With ``S >= window + N - 1``
for every pass of N tokens, a pass only overwrites positions that no query
from the row's current end onwards can see, so a rollback only lowers the
row's end (no copy, no saved entries), as in ``RaggedKVCache``. The mask is
built per row from the position each slot holds. Attention sees the ring in
slot order; the mask, not the order, decides what each query attends to.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from ..runtime import mlx_lm_adapter
from .rows import RowEnds

# Slots beyond the window: a pass of up to SLACK + 1 tokens fits without
# regrowing the ring (a longer one regrows it once).
SLACK = 31


def _slot_positions(last: mx.array, size: int) -> mx.array:
    """[B, S]: the position each slot holds once row b's last position is
    ``last[b]`` (negative: never written)."""
    slots = mx.arange(size)[None, :]
    return last[:, None] - ((last[:, None] - slots) % size)


class RaggedWindowKVCache(RowEnds):
    """A batch of per-row rings for one sliding-window attention layer.

    ``ends[i]`` (host side) is row i's number of tokens, which is also its
    RoPE position (``offset``). It stands in for upstream's
    ``BatchRotatingKVCache`` with the same verbs; its layout (a ring per row)
    is its own, so it holds none of upstream's state.
    """

    def __init__(self, max_size: int, keys, values, ends: list):
        self.max_size = max_size
        self.keys, self.values = keys, values
        self.ends = list(ends)
        self.offset = mx.array(self.ends)

    @property
    def ring_size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    # ---- the kind's verbs (dispatch.py) ---------------------------------------

    checked_on_model = True  # the start-up check rolls a pass back on the model

    @classmethod
    def empty_batch(cls, cache: RotatingKVCache, left_padding: list) -> BatchRotatingKVCache:
        return BatchRotatingKVCache(cache.max_size, left_padding)

    @classmethod
    def cannot_roll_back(cls, model, caches: list) -> str:
        """Tokens kept at the start of the window (``keep``) are not laid out
        per row here."""
        return "RotatingKVCache with kept tokens" if any(c.keep for c in caches) else ""

    @classmethod
    def from_batch(cls, cache: BatchRotatingKVCache, layers: Sequence = (),
                   slack: int = SLACK) -> "RaggedWindowKVCache":
        """Re-lay upstream's batch ring (any rotation, any left padding) into per-row rings."""
        max_size, keys, values, offset, idx, rotated = mlx_lm_adapter.rotating_state(cache)
        ends = offset.tolist()
        if keys is None:
            return cls(max_size, None, None, ends)
        if rotated:  # temporal order: the oldest entry first
            keys = mx.roll(keys, -idx, axis=2)
            values = mx.roll(values, -idx, axis=2)
        else:
            keys, values = keys[..., :idx, :], values[..., :idx, :]
        ring = cls(max_size, None, None, ends)
        ring._place(keys, values, max_size + slack)
        return ring

    def _place(self, keys: mx.array, values: mx.array, size: int) -> None:
        """Rings of ``size`` slots holding ``keys``/``values`` [B, H, L, D] in
        temporal order, the last entry of row b being its position ends[b]-1."""
        B, H, L, _ = keys.shape
        keep = min(L, size)
        keys, values = keys[..., L - keep :, :], values[..., L - keep :, :]
        pos = mx.array(self.ends)[:, None] - keep + mx.arange(keep)[None, :]
        slots = (pos % size)[:, None, :, None]
        self.keys = mx.put_along_axis(
            mx.zeros((B, H, size, keys.shape[3]), keys.dtype),
            mx.broadcast_to(slots, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(
            mx.zeros((B, H, size, values.shape[3]), values.dtype),
            mx.broadcast_to(slots, values.shape), values, axis=2)

    def _temporal(self, size: int):
        """Each row's last ``size`` slots' entries in temporal order."""
        last = mx.array(self.ends) - 1
        pos = last[:, None] - size + 1 + mx.arange(size)[None, :]
        slots = (pos % self.ring_size)[:, None, :, None]
        return (mx.take_along_axis(self.keys, slots, axis=2),
                mx.take_along_axis(self.values, slots, axis=2))

    def _fit(self, num_new: int) -> None:
        """Regrow the rings if a pass of ``num_new`` tokens would overwrite an
        entry that a query of the pass (or after a rollback) can still see."""
        need = self.max_size + num_new - 1
        if self.keys is None or self.ring_size >= need:
            return
        size = max(need, 2 * self.ring_size - self.max_size)
        keys, values = self._temporal(self.ring_size)
        self._place(keys, values, size)

    def update_and_fetch(self, keys, values):
        B, H, N, _ = keys.shape
        if self.keys is None:
            self.keys = mx.zeros((B, H, self.max_size + SLACK, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((B, H, self.max_size + SLACK, values.shape[3]), values.dtype)
        self._fit(N)
        pos = mx.array(self.ends)[:, None] + mx.arange(N)[None, :]
        slots = (pos % self.ring_size)[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(slots, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(
            self.values, mx.broadcast_to(slots, values.shape), values, axis=2)
        self.advance_ends(N)
        return self.keys, self.values

    def make_mask(self, N: int, window_size=None, return_array: bool = False, **kwargs):
        """[B, 1, N, S]: query n of row b (position ends[b] + n) sees the slots
        holding positions in (q - window, q]. Called before the pass writes."""
        window = window_size or self.max_size
        self._fit(N)
        size = self.ring_size or self.max_size + SLACK
        ends = mx.array(self.ends)
        held = _slot_positions(ends + N - 1, size)[:, None, :]  # [B, 1, S]
        query = (ends[:, None] + mx.arange(N)[None, :])[..., None]  # [B, N, 1]
        mask = (held >= 0) & (held <= query) & (held > query - window)
        return mask[:, None]

    # ---- what upstream's batch code calls ----------------------------------

    def filter(self, batch_indices):
        batch_indices = list(batch_indices)
        if self.keys is not None:
            idx = mx.array(batch_indices)
            self.keys, self.values = self.keys[idx], self.values[idx]
        self.ends = [self.ends[i] for i in batch_indices]
        self.offset = mx.array(self.ends)

    def extend(self, other):
        if not isinstance(other, RaggedWindowKVCache):
            other = RaggedWindowKVCache.from_batch(
                other, slack=max(self.ring_size - self.max_size, SLACK))
        if other.keys is None and self.keys is None:
            pass
        else:
            template = self if self.keys is not None else other
            size = max(self.ring_size, other.ring_size)
            for c in (self, other):
                if c.keys is None:
                    B = len(c.ends)
                    H, _, Dk = template.keys.shape[1:]
                    Dv = template.values.shape[3]
                    c.keys = mx.zeros((B, H, size, Dk), template.keys.dtype)
                    c.values = mx.zeros((B, H, size, Dv), template.values.dtype)
                elif c.ring_size < size:
                    keys, values = c._temporal(c.ring_size)
                    c._place(keys, values, size)
            self.keys = mx.concatenate([self.keys, other.keys])
            self.values = mx.concatenate([self.values, other.values])
        self.ends = self.ends + other.ends
        self.offset = mx.array(self.ends)

    def extract(self, idx):
        end = self.ends[idx]
        keep = min(end, self.max_size)
        if self.keys is None or not keep:
            return mlx_lm_adapter.rotating_cache(self.max_size, None, None, end)
        row = RaggedWindowKVCache(self.max_size, self.keys[idx : idx + 1],
                                  self.values[idx : idx + 1], [end])
        keys, values = row._temporal(keep)
        return mlx_lm_adapter.rotating_cache(self.max_size, mx.contiguous(keys),
                                       mx.contiguous(values), end)

    def is_trimmable(self):
        return True

    def size(self):
        return min(max(self.ends, default=0), self.max_size)

    def empty(self):
        return self.keys is None

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @property
    def nbytes(self):
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
