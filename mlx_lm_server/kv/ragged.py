"""Per-row rollback of plain attention layers: ``RaggedKVCache``.

After a verification pass every row holds k+1 new entries but keeps only as
many as it accepted. ``BatchKVCache`` cannot express that: its mask comes from
one global write index, so lowering a row's ``offset`` leaves stale keys
visible (``tests/model/test_kv.py`` shows the logits go wrong), and trimming the
batch minimum throws away tokens other rows accepted.

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

from ..runtime import mlx_lm_adapter
from .rows import RowEnds, rotated_rows, row_mask, tree_row_mask


class WritePositions:
    """Where each row's new entries go, built once per step for every layer.

    Every layer's cache of a batch holds the same row ends, so the index array
    of a scatter is the same for all of them; building it once instead of per
    layer removes most of the small operations a ragged write adds to a step.
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


def key_length(n: int) -> int:
    """The key length a multi-token pass attends over: ``n`` rounded up.

    GPU attention kernels are compiled (CUDA: a cuDNN graph) per query and key
    length; an exact length is new at every verification step and costs a
    compilation each time, several forwards' worth. Rounded to 256 up to 2048
    and then to an eighth of the enclosing power of two, a server meets a few
    lengths per octave; the masked tail costs at most an eighth more attention.
    """
    block = 256
    while block * 8 < n:
        block *= 2
    return -(-n // block) * block


def _fit_length(buffer: mx.array, length: int) -> mx.array:
    """``buffer`` cut or zero-padded to ``length`` positions (axis 2), contiguous."""
    have = buffer.shape[2]
    if have >= length:
        return mx.contiguous(buffer[..., :length, :])
    return mx.pad(buffer, [(0, 0), (0, 0), (0, length - have), (0, 0)])


class RaggedKVCache(RowEnds, BatchKVCache):
    """A ``BatchKVCache`` whose rows may end at different positions.

    ``ends[i]`` (host side) is where row i's next entry goes; upstream's write
    index is the largest end, so its ``keys[..., :index, :]`` covers every
    row. The per-row ``offset`` (RoPE position) stays ``ends - left_padding``.
    Multi-token passes attend over ``key_length(max(ends))`` positions, the
    tail masked, so that their shapes come from a small set.
    """

    _fitted = None  # the keys buffer ``_fit`` last made (see there)
    checked_on_model = False  # the suite covers plain attention
    path_buffers = ("keys", "values")  # holds trees of drafts (``RowEnds.keep_path``)

    # ---- the kind's verbs (dispatch.py) ---------------------------------------

    @classmethod
    def empty_batch(cls, cache: KVCache, left_padding: list) -> BatchKVCache:
        return BatchKVCache(left_padding)

    @classmethod
    def from_batch(cls, cache: BatchKVCache, layers: Sequence = ()) -> "RaggedKVCache":
        """Wrap an aligned ``BatchKVCache`` (sharing its arrays). It shares
        its write positions with the first ragged layer among ``layers``."""
        if mlx_lm_adapter.has_pending_right_padding(cache):
            raise ValueError("cannot wrap a BatchKVCache with pending right padding")
        ragged = mlx_lm_adapter.batch_cache_as(cls, cache)
        ragged.ends = [mlx_lm_adapter.write_index(cache)] * int(cache.left_padding.shape[0])
        ragged.positions = next((c.positions for c in layers if isinstance(c, RaggedKVCache)),
                                None) or WritePositions()
        return ragged

    @classmethod
    def cannot_roll_back(cls, model, caches: list) -> str:
        return ""

    @property
    def aligned(self) -> bool:
        return all(e == mlx_lm_adapter.write_index(self) for e in self.ends)

    def ends_moved(self) -> None:
        mlx_lm_adapter.set_write_index(self, max(self.ends))

    def _fit(self, length: int, keys: mx.array, values: mx.array) -> None:
        """Make the buffers exactly ``length`` positions long and contiguous.

        A multi-token pass then attends over whole buffers, whose strides
        follow from the rounded length alone. GPU attention is built per shape
        and per stride (CUDA: a cuDNN graph keyed on both, 40-100 ms to
        build); upstream's growth (by 256 from wherever the write index was),
        ``filter`` and ``extend`` leave buffers of almost any length, and a
        slice of one is a new graph at nearly every verification step after
        plain steps: on an H200 the first such step cost 50-100 ms against
        8 ms, and the controller priced every verification by it. Refitting
        costs one copy of the buffers when their length or owner changed
        (a join, a leave, upstream's growth), none while passes follow
        passes. Positions from ``max(ends)`` on hold nothing: cutting them
        loses nothing.
        """
        if self.keys is not None and self.keys is self._fitted \
                and self.keys.shape[2] == length:
            return
        if self.keys is None:
            B, H, _, Dk = keys.shape
            self.keys = mx.zeros((B, H, length, Dk), keys.dtype)
            self.values = mx.zeros((B, H, length, values.shape[3]), values.dtype)
        else:
            self.keys = _fit_length(self.keys, length)
            self.values = _fit_length(self.values, length)
        self._fitted = self.keys

    def _upstream_path(self, num_new: int) -> bool:
        """A one-token step on aligned rows is upstream's own decode step."""
        return num_new == 1 and self.aligned

    def update_and_fetch(self, keys, values):
        num_new = keys.shape[2]
        if self._upstream_path(num_new):
            out = super().update_and_fetch(keys, values)
            self.ends = [mlx_lm_adapter.write_index(self)] * len(self.ends)
            return out
        length = key_length(max(self.ends) + num_new)
        self._fit(length, keys, values)
        if self.aligned:
            start = self.ends[0]
            self.keys[..., start : start + num_new, :] = keys
            self.values[..., start : start + num_new, :] = values
        else:
            self.keys = mx.put_along_axis(
                self.keys, self.positions.get(self.ends, keys.shape), keys, axis=2
            )
            self.values = mx.put_along_axis(
                self.values, self.positions.get(self.ends, values.shape), values, axis=2
            )
            self._fitted = self.keys
        self.advance_ends(num_new)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        if self.tree is not None:
            return tree_row_mask(self.ends, self.left_padding, self.tree,
                                 key_length(max(self.ends) + N))
        if self._upstream_path(N):
            return super().make_mask(N, return_array=return_array, **kwargs)
        if kwargs.get("window_size") is not None:
            raise NotImplementedError("RaggedKVCache does not support sliding windows")
        return row_mask(self.ends, self.left_padding, N, key_length(max(self.ends) + N))

    def realign(self) -> None:
        """Make every row end where the longest does: each row's entries move
        right by its shortfall and its left padding grows by as much (RoPE
        offsets are unchanged). A ragged batch decodes a one-token step through
        a scatter into the whole buffer and an array mask over a rounded key
        length; an aligned one through upstream's slice write and causal mask,
        which is faster. One copy of the buffer (``rotated_rows``)."""
        if self.aligned or self.keys is None:
            return
        end = max(self.ends)
        shifts = [end - e for e in self.ends]
        fitted = self.keys is self._fitted
        self.keys = rotated_rows(self.keys, shifts)
        self.values = rotated_rows(self.values, shifts)
        if fitted:  # the same length, contiguous: still fitted
            self._fitted = self.keys
        self.left_padding = self.left_padding + mx.array(shifts, dtype=mx.int32)
        self.ends = [max(self.ends)] * len(self.ends)

    def filter(self, batch_indices):
        old_idx = mlx_lm_adapter.write_index(self)
        super().filter(batch_indices)
        shift = old_idx - mlx_lm_adapter.write_index(self)
        self.ends = [self.ends[i] - shift for i in batch_indices]
        if self.ends:
            mlx_lm_adapter.set_write_index(self, max(self.ends))

    def extend(self, other):
        if isinstance(other, RaggedKVCache) and not other.aligned:
            raise ValueError("can only extend with an aligned cache")
        old_idx = mlx_lm_adapter.write_index(self)
        super().extend(other)
        shift = mlx_lm_adapter.write_index(self) - old_idx
        num_other = int(other.left_padding.shape[0])
        self.ends = [e + shift for e in self.ends] + [mlx_lm_adapter.write_index(self)] * num_other

    def extract(self, idx):
        cache = KVCache()
        pad = int(self.left_padding[idx].item())
        end = self.ends[idx]
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, pad:end])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, pad:end])
        cache.offset = end - pad
        return cache
