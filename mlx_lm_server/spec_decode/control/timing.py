"""What real steps cost, measured for the controller's cost table.

A verification step is timed from the moment its input is on the host to
the next step's start (its period: see ``close_period``); a plain step is
timed alone, once in a few.
Every figure reaches the controller as a ``StepReport`` from here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from .controller import StepReport, batch_bucket

# A plain step is timed (synchronously) once in this many per batch bucket
# until the bucket's cost window is full, then once in SETTLED_...: each timing
# drains the pipeline (on a GPU the device idles while the host emits), and a
# settled median needs only to follow slow drift (a growing context).
PLAIN_TIMING_INTERVAL = 8
SETTLED_PLAIN_TIMING_INTERVAL = 64


@dataclass
class _VerifyPeriod:
    """A verification step whose cost is known once the next step starts."""

    start: float
    batch_size: int
    k: int
    uids: set
    prompt_tokens: int
    first_of_shape: bool = False


class StepTimer:
    def __init__(self, controller):
        self.controller = controller
        self._plain_steps: dict[int, int] = {}  # per batch bucket
        self._open: Optional[_VerifyPeriod] = None
        self._shapes_seen: set = set()

    def first_of_shape(self, shape: tuple) -> bool:
        """Whether a pass of this shape runs for the first time (compiling:
        its time says nothing about the next one)."""
        new = shape not in self._shapes_seen
        self._shapes_seen.add(shape)
        return new

    @property
    def shapes_run(self) -> int:
        """How many pass shapes have run (each compiled once on a GPU)."""
        return len(self._shapes_seen)

    def open_period(self, start: float, batch_size: int, k: int, uids, prompt_tokens: int,
                    first_of_shape: bool) -> None:
        self._open = _VerifyPeriod(start, batch_size, k, set(uids), prompt_tokens,
                                   first_of_shape)

    def drop_period(self) -> None:
        self._open = None

    def close_period(self, uids, now: float, prompt_tokens: int) -> None:
        """Time the last verification step from ``start`` to this step's start.

        ``start`` is when the step's pending tokens reached the host, after
        the wait for the plain pass before it. That period, not the pass
        alone, is what replacing a plain step with a verification step costs:
        it holds the proposing, the judging and the emitting after the pass,
        which a run of plain steps hides behind the next pass (the pass alone
        made one-token verification look as cheap as a plain step). The wait
        before it is left out: on an asynchronous device it is the previous
        plain pass, which a run of plain steps pays as well (as the next
        step's wait) and the plain step after a verification step does not
        (nothing of its own is running): counted, it priced every
        verification step one plain step too high on a GPU, where a plain
        step returns as soon as its pass is queued. A period that also
        prefilled (``prompt_tokens``, the generator's count, moved) or let
        sequences join is not a step's cost and is dropped.
        """
        period, self._open = self._open, None
        if period is None or period.first_of_shape:
            return
        if prompt_tokens != period.prompt_tokens:
            return
        if not period.uids.issuperset(uids):
            return
        self.controller.observe(StepReport(period.batch_size, k=period.k,
                                           seconds=now - period.start))

    def plain_step(self, batch_size: int, step: Callable[[], list],
                   wait: Callable[[], None]) -> list:
        """Run ``step`` (upstream's plain step), timed alone once in a few.

        Timed alone: ``wait`` for the previous step's pass before, and for
        this step's own pass after. Where evaluation is asynchronous, a plain
        step returns before its pass is done and the next step pays for it;
        on MLX's CPU backend it returns only when the pass is nearly done.
        Either way the time below is this step's. Only every few plain steps
        are timed, so pipelining is kept for the others.
        """
        bucket = batch_bucket(batch_size)
        n = self._plain_steps[bucket] = self._plain_steps.get(bucket, -1) + 1
        costs = self.controller.costs
        settled = costs.plain_count(batch_size) >= costs.window
        if n % (SETTLED_PLAIN_TIMING_INTERVAL if settled else PLAIN_TIMING_INTERVAL):
            return step()
        wait()
        tic = time.perf_counter()
        out = step()
        wait()
        self.controller.observe(StepReport(batch_size, k=0, seconds=time.perf_counter() - tic))
        return out
