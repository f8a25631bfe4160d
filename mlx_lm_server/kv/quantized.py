"""Quantized KV caches that stay batched: ``BatchQuantizedKVCache``.

mlx-lm quantizes a sequence's ``KVCache`` into a ``QuantizedKVCache`` (keys
and values as (packed, scales, biases), ``mx.quantize`` along the head
dimension) and turns batching off for it. Each token's entries are quantized
on their own, so a batch of rows can hold them exactly as one sequence does:
``BatchQuantizedKVCache`` is that batch, left-padded like ``BatchKVCache``,
with per-row ends like ``RaggedKVCache``: a speculative rollback only lowers
a row's end, as exact as for full-precision caches. (What is exact is the
cache. A pass of several tokens computes keys that differ from one-token
steps' in the last float bits, as it does in full precision; an entry near a
rounding step of its group may then round the other way, which moves logits
more than float rounding does: tests/model/test_quantized_kv.py measures it.)

It carries ``bits`` and ``group_size``, which is what sends mlx-lm's
``scaled_dot_product_attention`` down its quantized path.

``quantize_kv_caches(model, bits, group_size)`` makes every plain attention
layer of the model's caches quantized through the model's ``make_cache``
(the hook mlx-lm's ``make_prompt_cache`` honours), so the batch generator,
the prompt cache, the memory budget and the start-up check of speculation
all see the same kind. Entries are quantized from the first token (mlx-lm
switches a sequence over at ``--quantized-kv-start``; a batch cannot switch
one row's layers alone).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .rows import RowEnds, realignment, row_mask


class QuantizedRowCache(QuantizedKVCache):
    """One sequence's quantized cache (mlx-lm's ``QuantizedKVCache``) that
    batches: ``merge`` makes a ``BatchQuantizedKVCache``."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        super().__init__(group_size=group_size, bits=bits)

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedKVCache.merge(caches)

    def size(self):
        return self.offset


def _zeros_like_parts(parts: tuple, batch: int, length: int) -> tuple:
    """Zero (packed, scales, biases) for ``batch`` rows of ``length`` tokens,
    shaped and typed as ``parts``."""
    return tuple(mx.zeros((batch, p.shape[1], length, p.shape[3]), p.dtype) for p in parts)


def _rows(parts: tuple, index) -> tuple:
    return tuple(p[index] for p in parts)


class BatchQuantizedKVCache(RowEnds):
    """A left-padded batch of quantized rows that may end at different positions.

    ``keys``/``values``: (packed [B, H, S, D*bits/32], scales [B, H, S, D/g],
    biases [B, H, S, D/g]). ``ends[i]`` (host side) is where row i's next
    entry goes, ``left_padding[i]`` where its first is; ``offset`` (its RoPE
    position) is ``ends - left_padding``.
    """

    step = 256
    checked_on_model = False  # the suite covers plain attention, quantized or not
    own_attention = None  # upstream's quantized attention: matmuls already

    # ---- the kind's verbs (dispatch.py; upstream's batch is this class) --------

    @classmethod
    def empty_batch(cls, cache: QuantizedRowCache, left_padding: list) -> "BatchQuantizedKVCache":
        return cls(left_padding, cache.group_size, cache.bits)

    @classmethod
    def cannot_roll_back(cls, model, caches: list) -> str:
        return ""

    def __init__(self, left_padding: list, group_size: int = 64, bits: int = 8):
        self.group_size, self.bits = group_size, bits
        self.keys = self.values = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self.ends = [0] * len(left_padding)
        self._right_padding: Optional[list] = None

    # ---- writing and attending ------------------------------------------------

    @property
    def aligned(self) -> bool:
        return len(set(self.ends)) <= 1

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def _grow(self, length: int, keys: tuple, values: tuple) -> None:
        if length <= self.capacity:
            return
        extra = -(-(length - self.capacity) // self.step) * self.step
        B = keys[0].shape[0]
        new_k, new_v = _zeros_like_parts(keys, B, extra), _zeros_like_parts(values, B, extra)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, new_k))
            self.values = tuple(mx.concatenate([a, b], axis=2)
                                for a, b in zip(self.values, new_v))

    def _write(self, parts: tuple, new: tuple) -> tuple:
        """``new`` (quantized, [B, H, N, *]) written at each row's end."""
        N = new[0].shape[2]
        if self.aligned:
            start = self.ends[0]
            for p, n in zip(parts, new):
                p[..., start : start + N, :] = n
            return parts
        pos = (mx.array(self.ends)[:, None] + mx.arange(N)[None, :])[:, None, :, None]
        return tuple(mx.put_along_axis(p, mx.broadcast_to(pos, n.shape), n, axis=2)
                     for p, n in zip(parts, new))

    def update_and_fetch(self, keys, values):
        N = keys.shape[2]
        q_keys = tuple(mx.quantize(keys, group_size=self.group_size, bits=self.bits))
        q_values = tuple(mx.quantize(values, group_size=self.group_size, bits=self.bits))
        self._grow(max(self.ends) + N, q_keys, q_values)
        self.keys = self._write(self.keys, q_keys)
        self.values = self._write(self.values, q_values)
        self.advance_ends(N)
        length = max(self.ends)
        return (tuple(p[..., :length, :] for p in self.keys),
                tuple(p[..., :length, :] for p in self.values))

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """[B, 1, N, L]: query n of row b (at ends[b] + n) sees its own
        entries up to itself. Called before the pass writes."""
        if window_size is not None:
            raise NotImplementedError("BatchQuantizedKVCache does not support sliding windows")
        return row_mask(self.ends, self.left_padding, N, max(self.ends) + N)

    def realign(self) -> None:
        """Make every row end where the longest does: each row's entries move
        right by its shortfall, its left padding grows by as much (RoPE
        offsets unchanged). One gather of the buffer."""
        if self.aligned or self.keys is None:
            return
        source, shift = realignment(self.ends, self.capacity)
        self.keys = tuple(mx.take_along_axis(p, source, axis=2) for p in self.keys)
        self.values = tuple(mx.take_along_axis(p, source, axis=2) for p in self.values)
        self.left_padding = self.left_padding + shift
        self.ends = [max(self.ends)] * len(self.ends)

    # ---- what upstream's batch code calls ---------------------------------------

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            self.left_padding = self.left_padding + mx.array(left_padding)
            self.offset = self.offset - mx.array(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)

    def finalize(self):
        """After a right-padded prefill: drop each row's padding, then align."""
        if self._right_padding is not None:
            self.rollback(self._right_padding)
            self._right_padding = None
            self.realign()

    def filter(self, batch_indices):
        batch_indices = list(batch_indices)
        idx = mx.array(batch_indices)
        if self.keys is not None:
            self.keys, self.values = _rows(self.keys, idx), _rows(self.values, idx)
        self.offset, self.left_padding = self.offset[idx], self.left_padding[idx]
        self.ends = [self.ends[i] for i in batch_indices]
        # Shift left to drop padding no row needs any more.
        cut = min(self.left_padding.tolist(), default=0)
        if cut > 0:
            if self.keys is not None:
                self.keys = tuple(p[..., cut:, :] for p in self.keys)
                self.values = tuple(p[..., cut:, :] for p in self.values)
            self.left_padding = self.left_padding - cut
            self.ends = [e - cut for e in self.ends]

    def extend(self, other: "BatchQuantizedKVCache"):
        if not isinstance(other, BatchQuantizedKVCache):
            raise TypeError(f"cannot extend a quantized batch with a {type(other).__name__}")
        self.realign()
        other.realign()
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            self.ends = self.ends + other.ends
            return
        end = max(self.ends + other.ends)
        size = max(self.capacity, other.capacity)
        template = self.keys if self.keys is not None else other.keys
        v_template = self.values if self.values is not None else other.values

        def pad(c):
            B = len(c.ends)
            keys = c.keys if c.keys is not None else _zeros_like_parts(template, B, 0)
            values = c.values if c.values is not None else _zeros_like_parts(v_template, B, 0)
            left = end - (c.ends[0] if c.ends else 0)
            right = size - keys[0].shape[2] - left
            if right < 0:
                keys = tuple(p[..., :right, :] for p in keys)
                values = tuple(p[..., :right, :] for p in values)
                right = 0
            widths = [(0, 0), (0, 0), (left, right), (0, 0)]
            keys = tuple(mx.pad(p, widths) for p in keys)
            values = tuple(mx.pad(p, widths) for p in values)
            return keys, values, c.left_padding + left

        k1, v1, lp1 = pad(self)
        k2, v2, lp2 = pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.left_padding = mx.concatenate([lp1, lp2])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.ends = [end] * (len(self.ends) + len(other.ends))

    def extract(self, idx: int) -> QuantizedRowCache:
        cache = QuantizedRowCache(self.group_size, self.bits)
        pad, end = int(self.left_padding[idx].item()), self.ends[idx]
        if self.keys is not None and end > pad:
            cache.keys = tuple(mx.contiguous(p[idx : idx + 1, :, pad:end]) for p in self.keys)
            cache.values = tuple(mx.contiguous(p[idx : idx + 1, :, pad:end])
                                 for p in self.values)
        cache.offset = max(end - pad, 0)
        return cache

    @classmethod
    def merge(cls, caches: list) -> "BatchQuantizedKVCache":
        """One batch from one-sequence quantized caches, right-aligned."""
        first = caches[0]
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        out = cls(padding, first.group_size, first.bits)
        if longest == 0:
            return out
        template = next(c for c in caches if c.keys is not None)
        keys = _zeros_like_parts(template.keys, len(caches), longest)
        values = _zeros_like_parts(template.values, len(caches), longest)
        for i, (p, n, c) in enumerate(zip(padding, lengths, caches)):
            if n == 0:
                continue
            for dst, src in zip(keys + values, c.keys + c.values):
                dst[i : i + 1, :, p : p + n] = src[..., :n, :]
        out.keys, out.values = keys, values
        out.ends = [longest] * len(caches)
        out.offset = out.offset + longest
        return out

    def size(self):
        return max(self.ends, default=0)

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return True

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(p.nbytes for p in self.keys + self.values)


def quantize_kv_caches(model, bits: Optional[int], group_size: int = 64,
                       check: bool = True) -> None:
    """Make the model's plain attention caches quantized (``bits``, ``group_size``)
    wherever its caches are made (``make_prompt_cache``); ``bits=None`` puts
    full precision back. Sliding-window and recurrent layers keep their own
    caches (mlx-lm quantizes neither). ``check``: refuse a group size the
    model's head size does not divide now (a forward pass is built, not run:
    skip it where a forward is collective)."""
    current = getattr(model, "make_cache", None)
    make = getattr(current, "unquantized", current)  # a second call replaces the first
    if make is None:
        num_layers = len(model.layers)

        def make():
            return [KVCache() for _ in range(num_layers)]

    if bits is None:
        if current is not make:
            model.make_cache = make
        return

    def make_cache():
        return [QuantizedRowCache(group_size, bits) if type(c) is KVCache else c for c in make()]

    make_cache.unquantized = make
    model.make_cache = make_cache
    if check:
        try:
            check_quantizable(model, bits, group_size)
        except ValueError:
            model.make_cache = current
            raise


def check_quantizable(model, bits: int, group_size: int) -> None:
    """One token through quantized caches, so that a head size the group size
    does not divide is refused at start-up with the flag to change (MLX
    checks shapes as it builds the graph: nothing is evaluated)."""
    from mlx_lm.models.cache import make_prompt_cache

    try:
        model(mx.array([[0]]), cache=make_prompt_cache(model))
    except ValueError as e:
        raise ValueError(f"--kv-bits {bits} --kv-group-size {group_size}: this model's "
                         f"attention heads cannot be quantized so ({e}); try another "
                         "--kv-group-size") from e
