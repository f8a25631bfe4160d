"""``StepClock``: what a generation step really costs, in a pipelined loop.

Upstream's plain step dispatches its forward pass asynchronously and returns
at once, after waiting only for the *previous* step's tokens; the pass it
dispatched finishes while the next step is being prepared. So timing a plain
step from call to return measures the wrong thing: right after a
(synchronous) verify step it measures nothing but the dispatch, and the
verify step that follows a plain step pays for that plain step's forward pass
when it first reads the pending tokens. A controller fed those numbers thinks
plain steps are nearly free and verification dear.

The clock charges each step the time between two *completions*: the moment
the host holds its results, minus the moment it held the previous step's. A
plain step's completion is seen when the next step reads its tokens (the next
plain step returning, or a verify step reading the pending tokens); a verify
step's completion is its own end. In steady state this is the step's period,
loop overhead included, for both kinds alike. An interval that may contain a
prefill (a sequence joined between the two completions) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class _Step:
    kind: str  # "plain" or "verify"
    batch_size: int
    k: int
    uids: frozenset


class StepClock:
    def __init__(self, on_plain: Callable[[int, float], None],
                 on_verify: Callable[[int, int, float], None]):
        self._on_plain = on_plain
        self._on_verify = on_verify
        self._in_flight: Optional[_Step] = None  # dispatched, completion not yet seen
        self._last: Optional[tuple[float, frozenset]] = None  # last completion and its batch

    def dispatched(self, kind: str, uids: Sequence[int], k: int = 0) -> None:
        """A step's pass was started (a plain step) or run (a verify step)."""
        self._in_flight = _Step(kind, len(uids), k, frozenset(uids))

    def completed(self, now: float, uids: Sequence[int]) -> None:
        """The host now holds the in-flight step's results; ``uids`` is the batch seen now."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        last, self._last = self._last, (now, step.uids)
        if last is None:
            return
        last_time, last_uids = last
        # A sequence new since the previous completion means a prefill ran in between.
        if not step.uids <= last_uids or not frozenset(uids) <= step.uids:
            return
        seconds = now - last_time
        if step.kind == "plain":
            self._on_plain(step.batch_size, seconds)
        else:
            self._on_verify(step.batch_size, step.k, seconds)
