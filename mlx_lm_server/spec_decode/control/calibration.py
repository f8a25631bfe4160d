"""Start-up timing of the pass shapes speculation will use, before anything is served.

The controller prices a verification step relative to a plain step at the same
batch size. Measured only online, its first figures include compiling each new
shape (on a GPU tens of milliseconds against a forward of a few), and a
controller that sees those never speculates again. Here every (batch bucket,
k bucket) pass is run once to compile it and then timed, on a scratch cache
with a short context, within a time budget; the figures seed the cost table
until real steps replace them.

The budget is spent in two rounds: first k = 1 and the largest k at every
batch bucket (the ends of the cost line, which prices the k between), then
the other k. On a CPU the whole table takes longer than the budget at large
batches, and a bucket left uncalibrated borrows the line of the largest
smaller bucket that has one (see ``StepCosts``) rather than a flat prior that
can make a long pass look cheap: it would be tried, and paid for, before
being measured.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ...kv import batch_caches, make_rollbackable, rollback
from .costs import batch_bucket, k_buckets

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

    Passes run in the order of the module docstring until the budget runs
    out; a batch size keeps the k it got to (the cost line extrapolates the
    rest), one whose plain pass was not reached is left out. In tensor
    parallel every rank runs the same passes: ``share`` (``Link.decide``)
    gives every rank rank 0's reading of its own clock.
    """
    if repeats is None:  # a CPU compiles nothing: its first run is a fair sample
        repeats = 1 if mx.default_device() == mx.cpu else 2
    deadline = time.perf_counter() + budget_s

    def over() -> bool:
        return share(lambda: time.perf_counter() > deadline)

    ends = sorted({min(ks), max(ks)})
    rounds = (ends, [k for k in sorted(ks) if k not in ends])
    out, caches = {}, {}
    for round_ks in rounds:
        for B in batch_sizes:
            if over():
                return out
            if B not in caches:
                c = batch_caches(model, [0] * B)
                mx.eval(model(mx.zeros((B, context), mx.int32), cache=c))
                caches[B] = make_rollbackable(c)
                out[B] = (_pass_seconds(model, caches[B], B, 1, repeats), {})
            plain, verify = out[B]
            for k in round_ks:
                if over():
                    return out
                verify[k] = _pass_seconds(model, caches[B], B, k + 1, repeats)
                if k == max(ks):
                    log.info("calibrated speculation at batch size %d: plain %.1f ms, "
                             "k=%d %.1f ms", B, 1e3 * plain, k, 1e3 * verify[k])
    return out


def calibrate_controller(controller, model, max_batch_size: int, max_k: int, budget_s: float,
                         share: Callable = lambda fn: fn()) -> None:
    """``calibrate`` every batch bucket up to ``max_batch_size`` and every k
    bucket up to ``max_k`` within ``budget_s``, into the controller's costs
    (nothing when the budget is 0 or the controller is not dynamic)."""
    if budget_s <= 0 or not controller.dynamic:
        return
    sizes = sorted({batch_bucket(b) for b in range(1, max_batch_size + 1)})
    ks = k_buckets(max_k)
    tic = time.perf_counter()
    table = calibrate(model, sizes, ks, budget_s, share=share)
    for B, (plain, verify) in table.items():
        controller.costs.calibrate(B, verify, plain)
    shapes = sum(1 + len(verify) for _, verify in table.values())
    log.info("speculation warmed up before serving: %d of %d pass shapes compiled and timed "
             "in %.1f s (--spec-calibration-seconds %g)", shapes, len(sizes) * (1 + len(ks)),
             time.perf_counter() - tic, budget_s)
