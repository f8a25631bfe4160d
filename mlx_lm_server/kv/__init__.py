"""Per-row rollback of a batch's layer caches, for every layer kind.

The engine's one door: ``make_rollbackable`` and a ``Checkpoint`` (recurrent
layers) before a pass, ``set_tree`` before a tree of drafts (``hold_trees``:
whether every layer can hold one), ``commit`` after the pass, chains and
trees alike (a tree's kept path moved into place: ``keep_paths``; the rest
dropped: ``rollback``; recurrent layers replayed), ``realign`` before a plain
step, ``cannot_speculate`` once at start-up.
Inside: ``rows`` (per-row ends, shared), ``ragged`` (plain attention),
``window`` (sliding windows), ``recurrent`` (checkpoint and replay),
``quantized`` (plain attention quantized by ``--kv-bits``, batched: made at
load, before any cache, by ``quantize_kv_caches``), ``dispatch`` (the kinds,
registered once, and every layer through its kind's verbs), ``support`` (the
start-up check).
"""

from .dispatch import (
    batch_caches,
    commit,
    hold_trees,
    keep_paths,
    keep_rows,
    longest_row,
    make_rollbackable,
    realign,
    rollback,
    set_tree,
)
from .ragged import RaggedKVCache, key_length
from .recurrent import Checkpoint, install_recorders
from .support import cannot_speculate
from .window import RaggedWindowKVCache

__all__ = ["Checkpoint", "RaggedKVCache", "RaggedWindowKVCache", "batch_caches",
           "cannot_speculate", "commit", "hold_trees", "install_recorders", "keep_paths",
           "keep_rows", "key_length", "longest_row", "make_rollbackable", "realign", "rollback",
           "set_tree"]
