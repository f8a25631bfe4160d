"""Tensor and pipeline parallel around the step loop: a follower (a rank
other than 0) executes rank 0's plans, and rank 0 ends them.

Each plan is (ops, step): the joins and leaves rank 0 applied since the last
plan, in order, and whether the batch then takes a step. A follower applies
the same ops to its own ``RunningBatch`` and steps with it; every decision
inside a step (drafts, verdicts, random draws) reaches it through the link,
so it never consults a clock, a random state or a controller of its own.
Rank 0 decides the rest for every rank before a request joins (the seed of
a sampled request), and its stop plan ends every follower's loop.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Callable

import mlx.core as mx

from .distributed import STOP


def follow(batch, link, calibrate: Callable[[], None],
           release_idle_memory: Callable[[], None]) -> None:
    """Run rank 0's plans on ``batch`` until its stop plan; raises on any
    failure (the caller exits). ``release_idle_memory`` runs whenever the
    batch has emptied."""
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


def stop_followers(link) -> None:
    """Rank 0: share the stop plan, then wait until every rank has it (no
    rank leaves while another still needs it)."""
    link.closing = True
    link.share_plan(STOP)
    link.barrier()


def shared_seed(sampling):
    """``sampling`` with a seed for a sampled request that has none: every
    rank samples its plain steps itself, so with one key."""
    if sampling.greedy or sampling.seed is not None:
        return sampling
    return replace(sampling, seed=secrets.randbelow(1 << 31))
