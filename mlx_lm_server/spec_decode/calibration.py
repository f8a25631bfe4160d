"""Start-up timing of the pass shapes speculation will use, before anything is served.

The controller prices a verification step relative to a plain step at the same
batch size. Measured only online, its first figures include compiling each new
shape (on a GPU tens of milliseconds against a forward of a few), and a
controller that sees those never speculates again. Here every (batch bucket,
k bucket) pass is run once to compile it and then timed, on a scratch cache
with a short context, within a time budget; the figures seed the cost table
until real steps replace them.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Optional, Sequence

import mlx.core as mx

from .cache_utils import batch_caches, make_rollbackable, rollback

log = logging.getLogger("mlx_lm_server.spec_decode")


def _pass_seconds(model, caches, batch_size: int, num_tokens: int, repeats: int) -> float:
    """Median time of a forward over ``num_tokens`` per row; the first run (compiling) is dropped."""
    times = []
    x = mx.zeros((batch_size, num_tokens), mx.int32)
    for r in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval(model(x, cache=caches))
        if r:
            times.append(time.perf_counter() - tic)
        rollback(caches, [num_tokens] * batch_size)
    return statistics.median(times)


def calibrate(model, batch_sizes: Sequence[int], ks: Sequence[int], budget_s: float,
              context: int = 128, repeats: Optional[int] = None,
              share: Callable = lambda fn: fn(),
              ) -> dict[int, tuple[float, dict[int, float]]]:
    """``{B: (plain pass seconds, {k: seconds of a pass over k + 1 tokens})}``.

    Batch sizes are calibrated in the given order until the budget runs out; a
    batch size the budget does not cover is left out whole. In tensor
    parallel every rank runs the same passes: ``share`` (``Link.decide``)
    gives every rank rank 0's reading of its own clock.
    """
    if repeats is None:  # a CPU compiles nothing: its first run is a fair sample
        repeats = 1 if mx.default_device() == mx.cpu else 2
    deadline = time.perf_counter() + budget_s

    def over() -> bool:
        return share(lambda: time.perf_counter() > deadline)

    out = {}
    for B in batch_sizes:
        caches = batch_caches(model, [0] * B)
        mx.eval(model(mx.zeros((B, context), mx.int32), cache=caches))
        caches = make_rollbackable(caches)
        plain = _pass_seconds(model, caches, B, 1, repeats)
        verify = {}
        for k in ks:
            if over():
                return out
            verify[k] = _pass_seconds(model, caches, B, k + 1, repeats)
        out[B] = (plain, verify)
        log.info("calibrated speculation at batch size %d: plain %.1f ms, k=%d %.1f ms",
                 B, 1e3 * plain, max(ks), 1e3 * verify[max(ks)])
        if over():
            break
    return out
