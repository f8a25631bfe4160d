"""Per-row ends: the bookkeeping both ragged attention caches share.

A ragged cache keeps, host side, where each row's next entry goes
(``ends[i]``) and, device side, each row's RoPE position (``offset``). A
rollback lowers both by each row's count of dropped entries; nothing is
copied, because what a row attends to is decided by its end.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from .unfused import MOST_UNFUSED_QUERIES, fused_attention_built_per_shape, unfused_attention


def check_drops(num_drop: Sequence[int], ends: Sequence[int]) -> bool:
    """Refuse drop counts that do not fit the rows; whether any is nonzero."""
    if len(num_drop) != len(ends):
        raise ValueError(f"need one count per row ({len(ends)}), got {len(num_drop)}")
    if any(d < 0 or d > e for d, e in zip(num_drop, ends)):
        raise ValueError(f"cannot drop {list(num_drop)} entries from rows ending at {list(ends)}")
    return any(num_drop)


def row_mask(ends: Sequence[int], left_padding: mx.array, num_new: int,
             length: int) -> mx.array:
    """[B, 1, N, L]: query n of row b (at ``ends[b] + n``) sees its row's
    entries from its left padding up to itself, over ``length`` keys."""
    query = mx.array(ends)[:, None] + mx.arange(num_new)[None, :]  # [B, N]
    key = mx.arange(length)[None, None, :]  # [1, 1, L]
    mask = (key <= query[..., None]) & (key >= left_padding[:, None, None])
    return mask[:, None]


def tree_row_mask(ends: Sequence[int], left_padding: mx.array, ancestors: mx.array,
                  length: int) -> mx.array:
    """[B, 1, N, L]: the pass's input n of row b (written at ``ends[b] + n``)
    sees its row's cache from its left padding up to where its tree starts
    and, among the tree's entries, those ``ancestors [B, N, M]`` marks for
    it (its ancestors and itself, never a sibling). ``M == N``: the tree is
    the pass's own inputs (a verification); ``M > N``: its first ``M - N``
    entries are already in the cache, ending at ``ends[b]`` (a head growing
    its tree of drafts a depth at a time)."""
    B, N, M = ancestors.shape
    start = mx.array(ends)[:, None, None] - (M - N)
    key = mx.arange(length)[None, None, :]  # [1, 1, L]
    cached = (key < start) & (key >= left_padding[:, None, None])
    rel = key - start  # where key k falls among the tree's entries
    seen = mx.take_along_axis(ancestors, mx.broadcast_to(mx.clip(rel, 0, M - 1), (B, N, length)),
                              axis=2)
    return (cached | ((rel >= 0) & (rel < M) & seen))[:, None]


def gather_path(buffer: mx.array, starts: mx.array, path: mx.array) -> mx.array:
    """``buffer [B, H, L, D]`` with row b's entries at ``starts[b] + path[b, d]``
    moved to ``starts[b] + d``: a tree pass's accepted root path made
    contiguous (a gather of D + 1 entries a row, nothing else copied)."""
    B, H, _, Dh = buffer.shape
    width = path.shape[1]

    def index(positions):  # [B, width] -> [B, H, width, Dh]
        return mx.broadcast_to(positions[:, None, :, None], (B, H, width, Dh))

    kept = mx.take_along_axis(buffer, index(starts[:, None] + path), axis=2)
    return mx.put_along_axis(buffer, index(starts[:, None] + mx.arange(width)[None]), kept,
                             axis=2)


def rotated_rows(buffer: mx.array, shifts: Sequence[int],
                 by_slices: Optional[bool] = None) -> mx.array:
    """``buffer [B, H, L, D]`` with row b rotated right by ``shifts[b]``
    along L: what ``realignment``'s gather does. ``by_slices`` (None: on a
    CPU) copies each shifted row as two slices instead: a CPU's gather
    computes every element's source, and it took a plain step's time to
    realign B=8 rows of 400 entries over SmolLM2's 30 layers, 147 ms
    against 111 as slices (``scripts/bench/bench_ragged_cache.py``). On a
    GPU the gather is one kernel a buffer, where slices would be B ops."""
    if by_slices is None:
        by_slices = mx.default_device() == mx.cpu
    L = buffer.shape[2]
    if not by_slices:
        return mx.take_along_axis(buffer, _rotation(mx.array(shifts, dtype=mx.int32), L),
                                  axis=2)
    rows = [buffer[b:b + 1] if not s else
            mx.concatenate([buffer[b:b + 1, :, L - s:], buffer[b:b + 1, :, :L - s]], axis=2)
            for b, s in enumerate(shifts)]
    return mx.concatenate(rows, axis=0)


def realignment(ends: Sequence[int], length: int) -> tuple[mx.array, mx.array]:
    """What makes every row end where the longest does: the gather source
    ``[B, 1, L, 1]`` (along the sequence axis of a ``[B, H, L, D]`` buffer)
    that moves each row right by its shortfall, and the shortfalls ``[B]``,
    by which each row's left padding grows (RoPE offsets are unchanged)."""
    end = max(ends)
    shift = mx.array([end - e for e in ends], dtype=mx.int32)  # [B]
    return _rotation(shift, length), shift


def _rotation(shift: mx.array, length: int) -> mx.array:
    """The gather source ``[B, 1, L, 1]`` that rotates row b right by ``shift[b]``."""
    source = (mx.arange(length, dtype=mx.int32)[None] - shift[:, None]) % length  # [B, L]
    return source[:, None, :, None]


class RowEnds:
    """Rollback and trim for a cache whose rows end at ``ends`` (host list)
    with RoPE positions ``offset`` (array); a subclass hears of every change
    of the ends through ``ends_moved``."""

    ends: list
    offset: mx.array
    # A tree pass's ancestor mask [B, N, M] while one runs (None: a chain).
    tree = None
    # The [B, H, L, D] arrays ``keep_path`` gathers (empty: trees not held).
    path_buffers: tuple = ()

    # Short multi-token passes attend without the fused kernel where it is
    # built per shape (``unfused.py``); a class attribute, so a test sets it.
    unfused_passes = fused_attention_built_per_shape()

    def own_attention(self, queries, keys, values, scale: float, mask):
        """The layer's attention over this cache, or None for upstream's (see
        ``mlx_lm_adapter.attend_through_caches``)."""
        if self.unfused_passes and 1 < queries.shape[2] <= MOST_UNFUSED_QUERIES:
            return unfused_attention(queries, keys, values, scale, mask)
        return None

    def ends_moved(self) -> None:
        """The row ends changed (a write or a rollback)."""

    def advance_ends(self, num_new: int) -> None:
        """Every row took ``num_new`` new entries."""
        self.offset = self.offset + num_new
        self.ends = [e + num_new for e in self.ends]
        self.ends_moved()

    def rollback(self, num_drop: Sequence[int]) -> None:
        """Forget the last ``num_drop[i]`` entries of row i."""
        if not check_drops(num_drop, self.ends):
            return
        self.ends = [e - d for e, d in zip(self.ends, num_drop)]
        self.offset = self.offset - mx.array(num_drop)
        self.ends_moved()

    def keep_path(self, path: mx.array, pass_length: int) -> None:
        """After a tree pass of ``pass_length`` entries a row: move each row's
        accepted root path (``path [B, D+1]``, its input positions) to the
        pass's first positions; a ``rollback`` then drops the rest."""
        starts = mx.array(self.ends) - pass_length
        for name in self.path_buffers:
            setattr(self, name, gather_path(getattr(self, name), starts, path))

    def trim(self, n):
        n = min(n, min(self.ends))
        self.rollback([n] * len(self.ends))
        return n
