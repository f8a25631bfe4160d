"""A batch's layer caches as one: the cache kinds, registered once, and what
speculation does with every layer through each kind's verbs.

A model's layers each make a one-sequence cache (``make_prompt_cache``);
upstream's batch generator merges those into a batch cache; speculation needs
each row of every layer rolled back on its own. ``KINDS`` maps each one-sequence
kind to its batch kind and to the class of ours that rolls it back; that class
carries the verbs (``RowCache``). Before a pass, ``make_rollbackable`` turns
every layer's batch cache into ours; after it, ``rollback`` drops each row's
refused entries in every layer (recurrent layers: their ``recurrent.Checkpoint``
replays the kept inputs). ``realign`` and ``longest_row`` read or restore the
ragged attention rows' ends, which every such layer of a batch shares. A kind
no entry names is refused: by ``batch_caches``, ``make_rollbackable`` and the
start-up check (``support.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .quantized import BatchQuantizedKVCache, QuantizedRowCache
from .ragged import RaggedKVCache
from .recurrent import RecurrentCache
from .window import RaggedWindowKVCache


class RowCache(Protocol):
    """The verbs a batched layer cache of ours has for speculation, besides
    upstream's (``update_and_fetch``, ``make_mask``, ``filter``, ``extend``,
    ``extract``, ...), which the batch generator keeps calling on it.

    Ragged attention, whose rows every such layer ends alike, also has
    ``ends``, ``aligned`` and ``realign()``. A kind that holds a tree of
    drafts in one pass names the arrays it gathers in ``path_buffers`` and
    has ``tree`` (the pass's ancestor mask, read by its ``make_mask``) and
    ``keep_path(path, pass_length)`` (the accepted root path moved into
    contiguous positions, ``rows.RowEnds``); sliding-window rings and
    recurrent states do not: chains there.
    """

    checked_on_model: bool
    """Whether the start-up check rolls a pass back on the model itself
    (the suite covers plain attention: no need)."""

    @classmethod
    def empty_batch(cls, cache, left_padding: list):
        """An empty batch cache for rows left-padded so, of the one-sequence
        ``cache``'s kind: what upstream's batch generator makes for it."""

    @classmethod
    def from_batch(cls, cache, layers: Sequence = ()) -> "RowCache":
        """Upstream's batch cache (its batch generator's) as ours, sharing its
        arrays where it can; ``layers``: the batch's other layer caches, for
        what a kind shares between layers. Not needed where the batch class
        is ours."""

    @classmethod
    def cannot_roll_back(cls, model, caches: list) -> str:
        """Why ``model``'s layers of this kind (``caches``: their one-sequence
        caches) cannot be rolled back ("" if they can)."""

    def rollback(self, num_drop: Sequence[int]) -> None:
        """Forget row i's last ``num_drop[i]`` entries (a chain: a prefix of
        the pass kept per row)."""


@dataclass(frozen=True)
class Kind:
    """One layer cache kind: the one-sequence class a model makes, the batch
    class upstream's batch generator merges it into, and ours (the verbs)."""

    sequence: type
    batch: type
    rows: type[RowCache]


# The one place a cache kind is registered. Exact classes: a subclass of a
# known kind may lay its state out otherwise.
KINDS = (
    Kind(KVCache, BatchKVCache, RaggedKVCache),
    Kind(QuantizedRowCache, BatchQuantizedKVCache, BatchQuantizedKVCache),
    Kind(RotatingKVCache, BatchRotatingKVCache, RaggedWindowKVCache),
    Kind(ArraysCache, ArraysCache, RecurrentCache),
)
_BY_SEQUENCE = {k.sequence: k for k in KINDS}
_BY_BATCH = {k.batch: k for k in KINDS}
_OURS = tuple(k.rows for k in KINDS)


def layer_kind(cache) -> Optional[Kind]:
    """The registered kind of a one-sequence layer cache (None: unknown)."""
    return _BY_SEQUENCE.get(type(cache))


def batch_caches(model, left_padding: list) -> list:
    """Empty batched caches of the model's own layer kinds, as upstream's batch
    generator makes them (``merge`` of its per-sequence caches)."""
    out = []
    for c in make_prompt_cache(model):
        kind = layer_kind(c)
        if kind is None:
            raise TypeError(f"cannot batch a {type(c).__name__} layer")
        out.append(kind.rows.empty_batch(c, left_padding))
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
    """Give every layer cache (in place in the list) a per-row rollback: each
    batch cache becomes its kind's cache of ours (caches already ours stay).
    Any other kind is refused."""
    for i, c in enumerate(caches):
        if isinstance(c, _OURS):
            continue
        kind = _BY_BATCH.get(type(c))
        if kind is None:
            raise TypeError(f"speculative decoding cannot roll back a {type(c).__name__} layer")
        caches[i] = kind.rows.from_batch(c, caches)
    return caches


def rollback(caches: list, num_drop: Sequence[int]) -> None:
    """Drop row i's last ``num_drop[i]`` entries in every layer (recurrent
    layers roll back through their checkpoint)."""
    for c in caches:
        if not isinstance(c, _OURS):
            raise TypeError(f"cannot roll back a {type(c).__name__} layer: "
                            "make_rollbackable prepares the caches before a pass")
        c.rollback(num_drop)


def hold_trees(caches: list) -> bool:
    """Whether every layer can take a tree of drafts in one pass (ragged
    attention can; a sliding-window ring or a recurrent state cannot: chains)."""
    return all(isinstance(c, _OURS) and getattr(c, "path_buffers", ()) for c in caches)


def set_tree(caches: list, ancestors) -> None:
    """The coming pass is a tree: its ``[B, N, M]`` ancestor mask (None: a
    chain; ``kv/rows.tree_row_mask`` says what M > N means)."""
    for c in caches:
        c.tree = ancestors


def keep_paths(caches: list, path, pass_length: int) -> None:
    """After a tree pass: each row's accepted root path moved into place in
    every layer (``RowEnds.keep_path``); the tree is over."""
    for c in caches:
        c.keep_path(path, pass_length)
        c.tree = None


def commit(caches: list, checkpoint, accepted: Sequence[int], pass_length: int,
           path=None) -> None:
    """After a verification pass of ``pass_length`` entries a row: row i
    keeps its pending token and its first ``accepted[i]`` drafts in every
    layer, chains and trees alike. A tree's kept root path (``path [B, D+1]``,
    the verdict's input positions; None: a chain, kept in place) is moved
    into place first (``RowEnds.keep_path``), the rest is dropped
    (``rollback``), and recurrent layers replay the kept inputs from their
    ``checkpoint`` (``recurrent.Checkpoint``)."""
    if path is not None:
        keep_paths(caches, path, pass_length)
    rollback(caches, [pass_length - 1 - n for n in accepted])
    checkpoint.rollback([n + 1 for n in accepted], pass_length)


def _realigns(cache) -> bool:
    """A layer that realigns: ragged attention, every one of a batch at the
    same row ends."""
    return isinstance(cache, _OURS) and hasattr(cache, "realign")


def realign(caches: list) -> None:
    """Realign the ragged attention layers (see ``RaggedKVCache.realign``);
    sliding-window and recurrent layers keep per-row state either way. Every
    ragged layer of a batch holds the same ends, so an aligned first layer
    settles it (this runs before every plain step)."""
    first = next((c for c in caches if _realigns(c)), None)
    if first is not None and not first.aligned:
        for c in caches:
            if _realigns(c):
                c.realign()


def longest_row(caches: list) -> int:
    """The largest row end of the ragged attention layers (0 if none); every
    such layer of a batch holds the same ends."""
    first = next((c for c in caches if _realigns(c)), None)
    return max(first.ends, default=0) if first is not None else 0
