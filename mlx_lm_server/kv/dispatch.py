"""A batch's layer caches as one: each layer kind to the cache that rolls it back.

Before a pass, ``make_rollbackable`` gives every layer a per-row rollback
(plain attention: ``RaggedKVCache``, or ``BatchQuantizedKVCache`` as it is;
sliding window: ``RaggedWindowKVCache``;
recurrent ``ArraysCache`` layers stay as they are, a ``recurrent.Checkpoint``
rolls them back). After it, ``rollback`` drops each row's refused entries in
every attention layer. ``realign`` and ``longest_row`` read or restore the
attention rows' ends, which every attention layer of a batch shares.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..runtime import mlx_lm_adapter
from .quantized import BatchQuantizedKVCache, QuantizedRowCache
from .ragged import RaggedKVCache, WritePositions
from .window import RaggedWindowKVCache

# Attention layers whose rows end apart: rolled back and realigned alike.
RAGGED = (RaggedKVCache, BatchQuantizedKVCache)


def batch_caches(model, left_padding: list) -> list:
    """Empty batched caches of the model's own layer kinds, as upstream's batch
    generator makes them (``merge`` of its per-sequence caches)."""
    out = []
    for c in make_prompt_cache(model):
        if type(c) is KVCache:
            out.append(BatchKVCache(left_padding))
        elif type(c) is QuantizedRowCache:
            out.append(BatchQuantizedKVCache(left_padding, c.group_size, c.bits))
        elif type(c) is RotatingKVCache:
            out.append(BatchRotatingKVCache(c.max_size, left_padding))
        elif type(c) is ArraysCache:
            out.append(ArraysCache(len(mlx_lm_adapter.recurrent_states(c)), left_padding=left_padding))
        else:
            raise TypeError(f"cannot batch a {type(c).__name__} layer")
    return out


def keep_rows(caches: Optional[list], keep: list, num_rows: int) -> Optional[list]:
    """A batch's layer caches with only the rows ``keep``, in that order
    (filtered in place; None when no row is left)."""
    if caches is None or keep == list(range(num_rows)):
        return caches
    if not keep:
        return None
    for c in caches:
        c.filter(keep)
    return caches


def make_rollbackable(caches: list) -> list:
    """Give every layer cache (in place in the list) a per-row rollback:
    attention layers become ``RaggedKVCache``, sliding-window layers
    ``RaggedWindowKVCache``; recurrent ``ArraysCache`` layers stay as they are
    (``recurrent.Checkpoint`` rolls them back). Any other kind is refused."""
    positions = next((c.positions for c in caches if isinstance(c, RaggedKVCache)),
                     WritePositions())
    for i, c in enumerate(caches):
        if isinstance(c, RAGGED + (RaggedWindowKVCache, ArraysCache)):
            continue
        if type(c) is BatchKVCache:
            caches[i] = RaggedKVCache.from_batch(c, positions)
        elif type(c) is BatchRotatingKVCache:
            caches[i] = RaggedWindowKVCache.from_batch(c)
        else:
            raise TypeError(f"speculative decoding cannot roll back a {type(c).__name__} layer")
    return caches


def rollback(caches: list, num_drop: Sequence[int]) -> None:
    """Drop row i's last ``num_drop[i]`` entries in every attention layer
    (recurrent layers roll back through their checkpoint)."""
    for c in caches:
        if isinstance(c, RAGGED + (RaggedWindowKVCache,)):
            c.rollback(num_drop)
        elif not isinstance(c, ArraysCache):
            raise TypeError(f"cannot roll back a {type(c).__name__} layer: "
                            "make_rollbackable prepares the caches before a pass")


def realign(caches: list) -> None:
    """Realign the ragged attention layers (see ``RaggedKVCache.realign``);
    sliding-window and recurrent layers keep per-row state either way. Every
    attention layer of a batch holds the same ends, so an aligned first
    layer settles it (this runs before every plain step)."""
    first = next((c for c in caches if isinstance(c, RAGGED)), None)
    if first is not None and not first.aligned:
        for c in caches:
            if isinstance(c, RAGGED):
                c.realign()


def longest_row(caches: list) -> int:
    """The largest row end of the attention layers (0 if none); every
    attention layer of a batch holds the same ends."""
    first = next((c for c in caches if isinstance(c, RAGGED)), None)
    return max(first.ends, default=0) if first is not None else 0
