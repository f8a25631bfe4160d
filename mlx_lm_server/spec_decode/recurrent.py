"""Per-sequence rollback of recurrent and linear-attention layer states.

Layers such as Qwen3.5's gated delta net, Mamba-2 (Nemotron-H, Granite
hybrid) or LFM2's short convolutions keep a fixed-size state per sequence in
an ``ArraysCache`` (convolution window, SSM / delta-rule state). A pass over
``[pending, d_1..d_k]`` leaves the state after all k+1 tokens; a row that kept
only a prefix needs the state after that prefix, which the pass never
materialised (upstream's kernels return the last state only).

Two ways were weighed (figures in BENCHMARKS.md):

- per-position states out of the verify pass: no extra work, but it means
  re-implementing every family's recurrence (and its GPU kernel) to emit
  k+1 states;
- a checkpoint before the pass and a replay of the kept inputs through the
  recurrent mixers only, with upstream's own right-padding support
  (``ArraysCache.lengths``): every family that batches right-padded prompts
  upstream replays correctly, and only the work the state depends on runs
  (the mixers' outputs are never evaluated, so MLX never computes them).

This module does the second. The checkpoint holds references (MLX arrays are
immutable: saving costs nothing); the mixers' inputs are recorded during the
pass by swapping each recurrent mixer's class for a subclass that records its
call when a recording is open. A step whose rows all kept everything needs no
replay. Drafting models, which feed one token per pass, instead keep the
state after each pass and take each row's from the one it kept
(``snapshot`` / ``select``).
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

_recording: Optional[dict] = None  # id(cache) -> (mixer, bound arguments) of the open pass
_recording_classes: dict = {}


def _recording_class(cls):
    """A subclass of a mixer class whose calls are recorded while a pass is open."""
    sub = _recording_classes.get(cls)
    if sub is not None:
        return sub
    signature = inspect.signature(cls.__call__)

    def __call__(self, *args, **kwargs):
        if _recording is not None:
            bound = signature.bind(self, *args, **kwargs)
            cache = bound.arguments.get("cache")
            if isinstance(cache, ArraysCache):
                _recording[id(cache)] = (self, bound)
        return cls.__call__(self, *args, **kwargs)

    sub = type(cls.__name__, (cls,), {"__call__": __call__, "_records_for_rollback": True})
    _recording_classes[cls] = sub
    return sub


def _takes_cache_and_mask(module) -> bool:
    if getattr(module, "_records_for_rollback", False):
        return True
    try:
        params = inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False
    return "cache" in params and "mask" in params


def install_recorders(model) -> int:
    """Make the model's recurrent mixers recordable: every direct child of a
    layer that takes ``mask`` and ``cache`` (attention mixers too: only calls
    with an ``ArraysCache`` are recorded). The number of mixers made so."""
    count = 0
    for layer in getattr(model, "layers", []):
        if not isinstance(layer, nn.Module):
            continue
        for child in layer.children().values():
            if not isinstance(child, nn.Module) or not _takes_cache_and_mask(child):
                continue
            if not getattr(child, "_records_for_rollback", False):
                child.__class__ = _recording_class(type(child))
            count += 1
    return count


def recurrent_caches(caches: Sequence) -> list:
    return [c for c in caches if isinstance(c, ArraysCache)]


class Checkpoint:
    """The recurrent states before one pass and the mixer calls the pass made."""

    def __init__(self, caches: Sequence):
        # Copies of the padding arrays: ``advance`` decrements them in place.
        self._saved = [(c, list(c.cache), _copy(c.left_padding))
                       for c in recurrent_caches(caches)]
        self._calls: dict = {}

    def __enter__(self):
        global _recording
        if self._saved:
            _recording = self._calls
        return self

    def __exit__(self, *exc):
        global _recording
        _recording = None
        return False

    def restore(self) -> None:
        """Every row's states as before the pass (the pass is abandoned)."""
        for cache, states, left_padding in self._saved:
            cache.cache, cache.left_padding = list(states), _copy(left_padding)
            cache.lengths = None

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
            cache.cache, cache.left_padding = list(states), _copy(left_padding)
            cache.lengths = mx.array(list(keep))  # one array per cache, as above
            arguments = dict(bound.arguments, cache=cache, mask=cache.make_mask(num_tokens))
            # The output is dropped: only the state's part of the graph is ever evaluated.
            type(mixer).__call__(mixer, **_as_call(bound, arguments))
            cache.lengths = None


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
        c.lengths = None if lengths is None else mx.array(list(lengths))


def snapshot(caches: Sequence) -> list:
    """The recurrent states as they are now (references, no copy)."""
    return [list(c.cache) for c in recurrent_caches(caches)]


def select(caches: Sequence, snapshots: Sequence[list], index: Sequence[int]) -> None:
    """Row i's states from ``snapshots[index[i]]``."""
    if len(set(index)) == 1:
        for c, states in zip(recurrent_caches(caches), snapshots[index[0]]):
            c.cache = list(states)
        return
    rows = mx.arange(len(index))
    which = mx.array(list(index))
    for n, c in enumerate(recurrent_caches(caches)):
        c.cache = [
            None if snapshots[0][n][e] is None
            else mx.stack([snap[n][e] for snap in snapshots])[which, rows]
            for e in range(len(c.cache))
        ]
