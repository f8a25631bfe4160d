"""A tensor-parallel follower: a rank other than 0 executes rank 0's plans.

Each plan is (ops, step): the joins and leaves rank 0 applied since the last
plan, in order, and whether the batch then takes a step. A follower applies
the same ops to its own ``RunningBatch`` and steps with it; every decision
inside a step (drafts, verdicts, random draws) reaches it through the link,
so it never consults a clock, a random state or a controller of its own.
"""

from __future__ import annotations

import mlx.core as mx

from ..parallel.distributed import STOP
from .memory import release_idle_memory


def follow(batch, link, calibrate) -> None:
    """Run rank 0's plans until its stop plan; raises on any failure (the
    caller exits)."""
    calibrate()
    while True:
        plan = link.share_plan()
        if plan == STOP:
            link.closing = True
            link.barrier()
            break
        ops, step = plan
        for op in ops:
            batch.apply(op, link.plans)
        if step:
            _step(batch, link)
        if (step or ops) and not batch.live:
            release_idle_memory()
    batch.close()
    mx.synchronize()


def _step(batch, link) -> None:
    responses = batch.step()
    link.fold_tokens([(r.uid, r.token) for r in responses])
    for r in responses:
        if r.finish_reason is not None:  # upstream removed it
            batch.finished(r)
