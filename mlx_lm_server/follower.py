"""A tensor-parallel follower: a rank other than 0 executes rank 0's plans.

Each plan is (ops, step): the joins and leaves rank 0 applied since the last
plan, in order, and whether the batch then takes a step. A follower applies
the same ops to its own ``Generation`` and steps with it; every decision
inside a step (drafts, verdicts, random draws) reaches it through the link,
so it never consults a clock, a random state or a controller of its own.
"""

from __future__ import annotations

import mlx.core as mx

from .distributed import STOP
from .memory import release_idle_memory


def follow(generation, link, calibrate) -> None:
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
            generation.apply(op, link.plans)
        if step:
            _step(generation, link)
        if (step or ops) and not generation.live:
            release_idle_memory()
    generation.close()
    mx.synchronize()


def _step(generation, link) -> None:
    responses = generation.step()
    link.fold_tokens([(r.uid, r.token) for r in responses])
    for r in responses:
        if r.finish_reason is not None:  # upstream removed it
            generation.finished(r)
