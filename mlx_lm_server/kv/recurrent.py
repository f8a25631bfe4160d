"""Per-row rollback of recurrent and linear-attention layers: a checkpoint
before the pass and a replay of each row's kept inputs after it.

Layers such as Qwen3.5's gated delta net, Mamba-2 (Nemotron-H, Granite
hybrid) or LFM2's short convolutions keep a fixed-size state per sequence in
an ``ArraysCache`` (convolution window, SSM / delta-rule state). A pass over
``[pending, d_1..d_k]`` leaves the state after all k+1 tokens; a row that kept
only a prefix needs the state after that prefix, which the pass never
materialised (upstream's kernels return the last state only).

So the states are saved before the pass (references: MLX arrays are
immutable, saving costs nothing) and, after it, the kept inputs are replayed
through the recurrent mixers only, with upstream's own right-padding support
(``ArraysCache.lengths``): every family that batches right-padded prompts
upstream replays correctly, and only the work the state depends on runs (the
mixers' outputs are never evaluated, so MLX never computes them). Emitting
per-position states from the pass itself would need every family's
recurrence and GPU kernel re-implemented (BENCHMARKS.md weighs the two).

The mixers' inputs are recorded while a ``Checkpoint`` is open (a context
variable: the pass's thread only). A step whose rows all kept everything
needs no replay. Drafting models, which feed one token per pass, instead
keep the state after each pass and take each row's from the one it kept
(``snapshot`` / ``select``).
"""

from __future__ import annotations

import inspect
from contextvars import ContextVar
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..runtime import mlx_lm_adapter

# id(cache) -> (mixer, bound arguments) of the pass a Checkpoint has open
_open_pass: ContextVar[Optional[dict]] = ContextVar("open_pass", default=None)


def _record(mixer, args: tuple, kwargs: dict) -> None:
    calls = _open_pass.get()
    if calls is None:
        return
    bound = mlx_lm_adapter.bind_call(mixer, args, kwargs)
    cache = bound.arguments.get("cache")
    if isinstance(cache, ArraysCache):
        calls[id(cache)] = (mixer, bound)


def install_recorders(model) -> int:
    """Make the model's recurrent mixers recordable: every module a layer
    hands its cache to (attention mixers too: only calls with an
    ``ArraysCache`` are recorded). The number of mixers made so."""
    mixers = mlx_lm_adapter.cache_mixers(model)
    for mixer in mixers:
        mlx_lm_adapter.record_calls(mixer, _record)
    return len(mixers)


class RecurrentCache(ArraysCache):
    """Upstream's batched ``ArraysCache``, the same state, with the kind's
    verbs (dispatch.py). A state holds no entry per token, so there is
    nothing to drop from it: the pass's ``Checkpoint`` puts each row's state
    back and replays its kept inputs (a drafter takes each row's from the
    ``snapshot`` it kept)."""

    checked_on_model = True  # the start-up check rolls a pass back on the model

    @classmethod
    def empty_batch(cls, cache: ArraysCache, left_padding: list) -> ArraysCache:
        return ArraysCache(len(mlx_lm_adapter.recurrent_states(cache)), left_padding=left_padding)

    @classmethod
    def from_batch(cls, cache: ArraysCache, layers: Sequence = ()) -> "RecurrentCache":
        return mlx_lm_adapter.batch_cache_as(cls, cache)

    @classmethod
    def cannot_roll_back(cls, model, caches: list) -> str:
        """A replay needs every recurrent layer's mixer recorded."""
        if install_recorders(model) < len(caches):
            return "ArraysCache of a layer without a (x, mask, cache) mixer"
        return ""

    def rollback(self, num_drop: Sequence[int]) -> None:
        """Nothing here: the ``Checkpoint`` rolls the rows back (see the class)."""


def recurrent_caches(caches: Sequence) -> list:
    return [c for c in caches if isinstance(c, ArraysCache)]


class Checkpoint:
    """The recurrent states before one pass and the mixer calls the pass made."""

    def __init__(self, caches: Sequence):
        # Copies of the padding arrays: ``advance`` decrements them in place.
        self._saved = [(c, mlx_lm_adapter.recurrent_states(c), _copy(c.left_padding))
                       for c in recurrent_caches(caches)]
        self._calls: dict = {}
        self._token = None

    def __enter__(self):
        if self._saved:
            self._token = _open_pass.set(self._calls)
        return self

    def __exit__(self, *exc):
        if self._token is not None:
            _open_pass.reset(self._token)
            self._token = None
        return False

    def restore(self) -> None:
        """Every row's states as before the pass (the pass is abandoned)."""
        for cache, states, left_padding in self._saved:
            _put_back(cache, states, left_padding, None)

    def rollback(self, keep: Sequence[int], num_tokens: int) -> None:
        """Leave row i's states after its first ``keep[i]`` of the pass's
        ``num_tokens`` tokens."""
        if all(k == num_tokens for k in keep):
            return
        for cache, states, left_padding in self._saved:
            call = self._calls.get(id(cache))
            if call is None:
                raise RuntimeError("a recurrent layer's pass was not recorded: "
                                   "its mixer cannot be rolled back")
            mixer, bound = call
            _put_back(cache, states, left_padding, mx.array(list(keep)))
            arguments = dict(bound.arguments, cache=cache, mask=cache.make_mask(num_tokens))
            # The output is dropped: only the state's part of the graph is ever evaluated.
            mixer(**_as_call(bound, arguments))
            mlx_lm_adapter.set_pass_lengths(cache, None)


def _put_back(cache, states: list, left_padding, lengths: Optional[mx.array]) -> None:
    """A cache's saved states and left padding, with ``lengths`` for the next pass."""
    mlx_lm_adapter.set_recurrent_states(cache, states)
    cache.left_padding = _copy(left_padding)
    mlx_lm_adapter.set_pass_lengths(cache, lengths)


def _copy(a: Optional[mx.array]) -> Optional[mx.array]:
    return None if a is None else mx.array(a)


def _as_call(bound: inspect.BoundArguments, arguments: dict) -> dict:
    """Keyword arguments for a call, from bound arguments (no *args in mixers)."""
    out = {}
    for name, param in bound.signature.parameters.items():
        if name == "self" or name not in arguments:
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(arguments[name])
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError("mixers with *args cannot be replayed")
        else:
            out[name] = arguments[name]
    return out


def set_lengths(caches: Sequence, lengths: Optional[Sequence[int]]) -> None:
    """Right padding for the next pass: row i's state takes only its first
    ``lengths[i]`` tokens (None: all)."""
    for c in recurrent_caches(caches):  # one array each: ``advance`` works in place
        mlx_lm_adapter.set_pass_lengths(c, None if lengths is None else mx.array(list(lengths)))


def snapshot(caches: Sequence) -> list:
    """The recurrent states as they are now (references, no copy)."""
    return [mlx_lm_adapter.recurrent_states(c) for c in recurrent_caches(caches)]


def select(caches: Sequence, snapshots: Sequence[list], index: Sequence[int]) -> None:
    """Row i's states from ``snapshots[index[i]]``."""
    if len(set(index)) == 1:
        for c, states in zip(recurrent_caches(caches), snapshots[index[0]]):
            mlx_lm_adapter.set_recurrent_states(c, states)
        return
    rows = mx.arange(len(index))
    which = mx.array(list(index))
    for n, c in enumerate(recurrent_caches(caches)):
        num_states = len(snapshots[0][n])
        mlx_lm_adapter.set_recurrent_states(c, [
            None if snapshots[0][n][e] is None
            else mx.stack([snap[n][e] for snap in snapshots])[which, rows]
            for e in range(num_states)
        ])
