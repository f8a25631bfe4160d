"""Per-sequence rollback inside mlx-lm's batched, left-padded KV cache.

After a verification pass every row holds k+1 new entries but keeps only as
many as it accepted. ``BatchKVCache`` cannot express that: its mask comes from
one global write index, so lowering a row's ``offset`` leaves stale keys
visible (checked: logits off by up to 4.9), and trimming the batch minimum
throws away tokens other rows accepted.

``RaggedKVCache`` lets each row end at its own position. New entries are
scattered to each row's own end, the mask is built per row from its left
padding and its end, and a rollback only lowers the row ends: no copy, no
second forward pass, a cost independent of context length. Upstream's
``filter``/``extend``/``extract`` keep working on it: each is adjusted for the
per-row ends, so rows never need re-aligning when the batch changes.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .. import upstream


class _WritePositions:
    """Where each row's new entries go, built once per step for every layer.

    Every layer's cache of a batch holds the same row ends, so the index array
    of a scatter is the same for all of them; building it once instead of per
    layer removes most of the small operations a ragged write adds to a step
    (on a CPU each costs about as much as moving the data).
    """

    def __init__(self):
        self._ends = None
        self._by_shape: dict = {}

    def get(self, ends: list, shape: tuple) -> mx.array:
        """Indices along axis 2 for a [B, H, T, D] write at each row's end."""
        if ends != self._ends:
            self._ends, self._by_shape = list(ends), {}
        pos = self._by_shape.get(shape)
        if pos is None:
            pos = mx.array(ends)[:, None] + mx.arange(shape[2])[None, :]
            pos = self._by_shape[shape] = mx.broadcast_to(pos[:, None, :, None], shape)
        return pos


def check_drops(num_drop: Sequence[int], ends: Sequence[int]) -> bool:
    """Refuse drop counts that do not fit the rows; whether any is nonzero."""
    if len(num_drop) != len(ends):
        raise ValueError(f"need one count per row ({len(ends)}), got {len(num_drop)}")
    if any(d < 0 or d > e for d, e in zip(num_drop, ends)):
        raise ValueError(f"cannot drop {list(num_drop)} entries from rows ending at {list(ends)}")
    return any(num_drop)


def key_length(n: int) -> int:
    """The key length a multi-token pass attends over: ``n`` rounded up.

    GPU attention kernels are compiled (CUDA: a cuDNN graph) per query and key
    length; an exact length is new at every verification step and costs a
    compilation each time (35-40 ms measured, against a 6 ms forward). Rounded
    to 256 up to 2048 and then to an eighth of the enclosing power of two, a
    server meets a few lengths per octave; the masked tail costs at most an
    eighth more attention.
    """
    block = 256
    while block * 8 < n:
        block *= 2
    return -(-n // block) * block


class RaggedKVCache(BatchKVCache):
    """A ``BatchKVCache`` whose rows may end at different positions.

    ``ends[i]`` (host side) is where row i's next entry goes; upstream's write
    index is the largest end, so its ``keys[..., :index, :]`` covers every
    row. The per-row ``offset`` (RoPE position) stays ``ends - left_padding``.
    Multi-token passes attend over ``key_length(max(ends))`` positions, the
    tail masked, so that their shapes come from a small set.
    """

    @classmethod
    def from_batch(cls, cache: BatchKVCache,
                   positions: "_WritePositions | None" = None) -> "RaggedKVCache":
        """Wrap an aligned ``BatchKVCache`` (sharing its arrays); the layers of
        one model should share ``positions``."""
        if upstream.has_pending_right_padding(cache):
            raise ValueError("cannot wrap a BatchKVCache with pending right padding")
        ragged = cls.__new__(cls)
        ragged.__dict__.update(cache.__dict__)
        ragged.ends = [upstream.write_index(cache)] * int(cache.left_padding.shape[0])
        ragged._positions = positions or _WritePositions()
        return ragged

    @property
    def aligned(self) -> bool:
        return all(e == upstream.write_index(self) for e in self.ends)

    def _grow(self, length: int, keys: mx.array, values: mx.array) -> None:
        """Make the buffers hold at least ``length`` positions."""
        if self.keys is not None and length <= self.keys.shape[2]:
            return
        B, H, _, Dk = keys.shape
        Dv = values.shape[3]
        have = 0 if self.keys is None else self.keys.shape[2]
        extra = ((length - have + self.step - 1) // self.step) * self.step
        new_k = mx.zeros((B, H, extra, Dk), keys.dtype)
        new_v = mx.zeros((B, H, extra, Dv), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def _upstream_path(self, num_new: int) -> bool:
        """A one-token step on aligned rows is upstream's own decode step."""
        return num_new == 1 and self.aligned

    def update_and_fetch(self, keys, values):
        num_new = keys.shape[2]
        if self._upstream_path(num_new):
            out = super().update_and_fetch(keys, values)
            self.ends = [upstream.write_index(self)] * len(self.ends)
            return out
        length = key_length(max(self.ends) + num_new)
        self._grow(length, keys, values)
        if self.aligned:
            start = self.ends[0]
            self.keys[..., start : start + num_new, :] = keys
            self.values[..., start : start + num_new, :] = values
        else:
            self.keys = mx.put_along_axis(
                self.keys, self._positions.get(self.ends, keys.shape), keys, axis=2
            )
            self.values = mx.put_along_axis(
                self.values, self._positions.get(self.ends, values.shape), values, axis=2
            )
        self.offset = self.offset + num_new
        self.ends = [e + num_new for e in self.ends]
        upstream.set_write_index(self, max(self.ends))
        return self.keys[..., :length, :], self.values[..., :length, :]

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if self._upstream_path(N):
            return super().make_mask(N, return_array=return_array, **kwargs)
        if kwargs.get("window_size") is not None:
            raise NotImplementedError("RaggedKVCache does not support sliding windows")
        length = key_length(max(self.ends) + N)
        query_pos = mx.array(self.ends)[:, None] + mx.arange(N)[None, :]  # [B, N]
        key_pos = mx.arange(length)[None, None, :]  # [1, 1, L]
        mask = (key_pos <= query_pos[..., None]) & (
            key_pos >= self.left_padding[:, None, None]
        )
        return mask[:, None]  # [B, 1, N, L]

    def rollback(self, num_drop: Sequence[int]) -> None:
        """Forget the last ``num_drop[i]`` entries of row i."""
        if not check_drops(num_drop, self.ends):
            return
        self.ends = [e - d for e, d in zip(self.ends, num_drop)]
        self.offset = self.offset - mx.array(num_drop)
        upstream.set_write_index(self, max(self.ends))

    def realign(self) -> None:
        """Make every row end where the longest does: each row's entries move
        right by its shortfall and its left padding grows by as much (RoPE
        offsets are unchanged). A ragged batch decodes a one-token step through
        a scatter into the whole buffer and an array mask over a rounded key
        length; an aligned one through upstream's slice write and causal mask
        (134 against 112 ms a plain step at B=16 on a CPU). One gather of the
        buffer."""
        if self.aligned or self.keys is None:
            return
        end = max(self.ends)
        shift = mx.array([end - e for e in self.ends], dtype=mx.int32)  # [B]
        length = self.keys.shape[2]
        source = (mx.arange(length, dtype=mx.int32)[None] - shift[:, None]) % length  # [B, L]
        source = source[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys, source, axis=2)
        self.values = mx.take_along_axis(self.values, source, axis=2)
        self.left_padding = self.left_padding + shift
        self.ends = [end] * len(self.ends)

    def trim(self, n):
        n = min(n, min(self.ends))
        self.rollback([n] * len(self.ends))
        return n

    def filter(self, batch_indices):
        old_idx = upstream.write_index(self)
        super().filter(batch_indices)
        shift = old_idx - upstream.write_index(self)
        self.ends = [self.ends[i] - shift for i in batch_indices]
        if self.ends:
            upstream.set_write_index(self, max(self.ends))

    def extend(self, other):
        if isinstance(other, RaggedKVCache) and not other.aligned:
            raise ValueError("can only extend with an aligned cache")
        old_idx = upstream.write_index(self)
        super().extend(other)
        shift = upstream.write_index(self) - old_idx
        num_other = int(other.left_padding.shape[0])
        self.ends = [e + shift for e in self.ends] + [upstream.write_index(self)] * num_other

    def extract(self, idx):
        cache = KVCache()
        pad = int(self.left_padding[idx].item())
        end = self.ends[idx]
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, pad:end])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, pad:end])
        cache.offset = end - pad
        return cache


def batch_caches(model, left_padding: list) -> list:
    """Empty batched caches of the model's own layer kinds, as upstream's batch
    generator makes them (``merge`` of its per-sequence caches)."""
    from mlx_lm.models.cache import (ArraysCache, BatchRotatingKVCache, RotatingKVCache,
                                     make_prompt_cache)

    out = []
    for c in make_prompt_cache(model):
        if type(c) is KVCache:
            out.append(BatchKVCache(left_padding))
        elif type(c) is RotatingKVCache:
            out.append(BatchRotatingKVCache(c.max_size, left_padding))
        elif type(c) is ArraysCache:
            out.append(ArraysCache(len(c.cache), left_padding=left_padding))
        else:
            raise TypeError(f"cannot batch a {type(c).__name__} layer")
    return out


def make_rollbackable(caches: list) -> list:
    """Give every layer cache (in place in the list) a per-row rollback:
    attention layers become ``RaggedKVCache``, sliding-window layers
    ``RaggedWindowKVCache``; recurrent ``ArraysCache`` layers stay as they are
    (``recurrent.Checkpoint`` rolls them back). Any other kind is refused."""
    from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache

    from .window_cache import RaggedWindowKVCache

    positions = next((c._positions for c in caches if isinstance(c, RaggedKVCache)),
                     _WritePositions())
    for i, c in enumerate(caches):
        if isinstance(c, (RaggedKVCache, RaggedWindowKVCache, ArraysCache)):
            continue
        if type(c) is BatchKVCache:
            caches[i] = RaggedKVCache.from_batch(c, positions)
        elif type(c) is BatchRotatingKVCache:
            caches[i] = RaggedWindowKVCache.from_batch(c)
        else:
            raise TypeError(f"speculative decoding cannot roll back a {type(c).__name__} layer")
    return caches


def longest_row(caches: list) -> int:
    """The largest row end of the attention layers (0 if none); every
    attention layer of a batch holds the same ends."""
    first = next((c for c in caches if isinstance(c, RaggedKVCache)), None)
    return max(first.ends, default=0) if first is not None else 0


def realign(caches: list) -> None:
    """Realign the ragged attention layers (see ``RaggedKVCache.realign``);
    sliding-window and recurrent layers keep per-row state either way. Every
    attention layer of a batch holds the same ends, so an aligned first
    layer settles it (this runs before every plain step)."""
    first = next((c for c in caches if isinstance(c, RaggedKVCache)), None)
    if first is not None and not first.aligned:
        for c in caches:
            if isinstance(c, RaggedKVCache):
                c.realign()


def rollback(caches: list, num_drop: Sequence[int]) -> None:
    """Drop row i's last ``num_drop[i]`` entries in every attention layer
    (recurrent layers roll back through their checkpoint)."""
    for c in caches:
        if hasattr(c, "rollback"):
            c.rollback(num_drop)
