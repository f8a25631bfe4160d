"""What real steps cost, measured for the controller's cost table.

Every step is timed from its start to the next step's start (its cycle),
without synchronising anything: that is what the step costs the batch's
throughput, host work (proposing, judging, emitting, the scheduler's work
between steps) and device work alike.

- A plain step's cost is its cycle in a run of plain steps. On an
  asynchronous device a plain step launches its pass and waits for the one
  before: its cycle is the pipelined one, shorter than a pass timed alone
  (which drains the pipeline and priced plain steps a fifth too high on an
  H200).
- A verification step costs its cycle **plus what the plain steps after it
  pay for it**: the first plain step after a verification realigns the
  ragged cache and starts an empty pipeline (on an H200 at B=4: 7.0-7.7 ms
  against a 4.5 ms cycle, the second 0.3-0.5 ms over, the third nothing).
  Left out, a verification step looked 1.45 plain steps where it cost 2.5,
  and n-gram speculation at B >= 4 verified where it lost. So the first
  ``RECOVERY_STEPS`` plain cycles after a verification are not plain
  samples; their excess over the plain median is charged to it.

A cycle in which prompts were prefilled or sequences joined is no step's
cost and is dropped, as is a verification whose pass had a shape never run
before (compiling, on a GPU) and a verification whose recovery was
interrupted so.
Every figure reaches the controller as a ``StepReport`` from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .step import StepReport

# Plain steps after a verification that are charged to it, not sampled.
RECOVERY_STEPS = 2


@dataclass
class _Step:
    """The step in progress: a plain step unless ``verifying`` says otherwise."""

    start: float
    batch_size: int
    uids: frozenset
    prompt_tokens: int
    k: int = 0
    charge: bool = True


@dataclass
class _Owed:
    """A verification step's cost while the plain steps after it are counted;
    ``seconds`` None: nothing to charge (it compiled, or a prefill came
    between), but the plain steps after it are still no plain samples."""

    batch_size: int
    k: int
    seconds: Optional[float]
    recovery_left: int = RECOVERY_STEPS


class StepTimer:
    def __init__(self, controller, compiles: bool = True):
        self.controller = controller
        # Whether a pass shape's first run compiles (a GPU). On a CPU it does
        # not, and a first verification left uncharged left its batch bucket
        # with no real step: the probe floor fell to nothing and the next
        # probe came 6 steps later instead of 32 (chat at 16 clients).
        self.compiles = compiles
        self._step: Optional[_Step] = None
        self._owed: Optional[_Owed] = None
        self._shapes_seen: set = set()

    def first_of_shape(self, shape: tuple) -> bool:
        """Whether a pass of this shape runs for the first time and compiles
        (its time says nothing about the next one)."""
        if not self.compiles:
            return False
        new = shape not in self._shapes_seen
        self._shapes_seen.add(shape)
        return new

    @property
    def shapes_run(self) -> int:
        """How many pass shapes have compiled."""
        return len(self._shapes_seen)

    def step(self, now: float, uids, prompt_tokens: int) -> None:
        """A step starts at ``now``: the one before it ends. ``prompt_tokens``
        is the generator's count of prefilled tokens (it moves when a prompt
        is prefilled between steps)."""
        last, self._step = self._step, _Step(now, len(uids), frozenset(uids), prompt_tokens)
        if last is None:
            return
        clean = prompt_tokens == last.prompt_tokens and last.uids.issuperset(uids)
        if last.k:
            self._settle()
            charged = clean and last.charge
            self._owed = _Owed(last.batch_size, last.k, now - last.start if charged else None)
        elif self._owed is not None:
            self._recover(now - last.start, clean and last.batch_size == self._owed.batch_size)
        elif clean and last.batch_size:
            self.controller.observe(StepReport(last.batch_size, k=0, seconds=now - last.start))

    def verifying(self, k: int, charge: bool = True) -> None:
        """The step in progress runs a pass over ``k`` + 1 tokens per row (the
        pass shape's); ``charge`` False: not to be charged (its shape ran for
        the first time and compiled), though the plain steps after it are no
        plain samples either."""
        if self._step is not None:
            self._step.k, self._step.charge = k, charge

    def forget(self) -> None:
        """Charge nothing for the step in progress nor owe anything before it
        (a fault, a new generator)."""
        self._step = self._owed = None

    def _recover(self, cycle: float, clean: bool) -> None:
        """One plain step after a verification: its excess over a plain cycle
        is the verification's."""
        owed = self._owed
        plain = self.controller.costs.plain_seconds(owed.batch_size)
        if owed.seconds is not None:
            owed.seconds = owed.seconds + cycle - plain if clean and plain else None
        owed.recovery_left -= 1
        if not owed.recovery_left:
            self._settle()

    def _settle(self) -> None:
        owed, self._owed = self._owed, None
        if owed is not None and owed.seconds is not None:
            self.controller.observe(StepReport(owed.batch_size, k=owed.k,
                                               seconds=max(owed.seconds, 0.0)))
