"""When a switched-off controller verifies anyway: probes.

Plain Python, no MLX. While off, probe steps keep the acceptance estimates
fresh: the first after ``interval`` plain steps, then at doubling intervals
up to ``max_interval``, so a short dip in acceptance costs little and text
the proposer cannot predict costs almost nothing. A sequence joining resets
the interval: it is new evidence. The interval is never shorter than what
keeps probing within ``budget`` (2%) of throughput at the measured cost of
a probe.

Probes that do not pay shrink that budget: after each probe in a row that
emitted fewer tokens per row than the plain steps it cost it halves, down to
an eighth (``fruitless_backoff`` halvings), and the first probe that pays
(or speculation switching on) restores it. A proposer that always has a
draft and is rarely right (a learned head on text unlike what it was trained
on: on a CPU at B=1 SmolLM2's open-chat head kept 0.2-0.3 of its drafts on
stories, at 1.4-1.9 plain steps a probe, and its probes cost 1-1.5% of
throughput) then probes at a quarter of a percent of throughput instead of
2%. A proposer with no draft (prompt lookup on prose) costs nothing either
way: its probes are plain steps and count for nothing here. The same budget
still bounds how late the controller notices text the proposer can predict:
at a probe's price of a quarter of a step, every 100 steps at most.

Where no k can pay at a batch size (see the controller), only a cheaper
measured pass can change that: a cost probe verifies once every
``cost_probe_interval`` plain steps there.
"""

from __future__ import annotations

import math
from typing import Sequence

from .costs import StepCosts, batch_bucket
from .step import StepReport


class Probes:
    """The probe schedule: steps off since the last probe, the current
    interval, fruitless probes in a row, and each batch bucket's steps
    towards its cost probe."""

    def __init__(self, costs: StepCosts, *, interval: int = 4, max_interval: int = 64,
                 budget: float = 0.02, fruitless_backoff: int = 3,
                 cost_probe_interval: int = 256):
        self.costs = costs
        self.interval = interval
        self.max_interval = max(max_interval, interval)
        self.budget = budget
        self.fruitless_backoff = fruitless_backoff
        self.cost_probe_interval = cost_probe_interval
        self._steps_off = 0
        self._wait = interval
        self._fruitless = 0  # probes in a row that did not pay
        self._unpaid: dict[int, int] = {}  # batch bucket -> steps since its cost probe
        self._known: set[int] = set()

    def switched_on(self) -> None:
        """Speculation pays again: the schedule starts afresh."""
        self._steps_off = 0
        self._fruitless = 0
        self._wait = self.interval

    def seen(self, uids: Sequence[int]) -> None:
        """A sequence joining is new evidence: the interval is reset."""
        if not self._known.issuperset(uids):
            self._known.update(uids)
            self._wait = min(self._wait, self.interval)

    def forget(self, uid: int) -> None:
        self._known.discard(uid)

    def observe(self, report: StepReport) -> None:
        """A probe's outcome: whether it emitted, per row, at least the plain
        steps it cost. Text worth speculating on shows itself so; drafts kept
        too rarely to pay for the pass (a weak head's one in three) do not."""
        rows = len(report.accepted)
        emitted = sum(1 + n for n in report.accepted) / max(rows, 1)
        paid = emitted >= self.costs.spent(report.batch_size, report.decision.k)
        self._fruitless = 0 if paid else self._fruitless + 1

    def due(self, batch_size: int, k: int) -> bool:
        """One more step off; whether it is to probe at ``k`` instead."""
        self._steps_off += 1
        wait = max(self._wait, self._floor(batch_size, k))
        if self.interval and self._steps_off >= wait:
            self._steps_off = 0
            self._wait = min(2 * self._wait, self.max_interval)
            return True
        return False

    def _floor(self, batch_size: int, k: int) -> int:
        """Fewest plain steps between probes for probing to cost at most
        ``budget`` of throughput: a probe costs c(B, k) - 1 plain steps,
        which at a large batch on a CPU is half a step or more. Only a cost
        line that real steps anchor spaces them: a calibrated figure alone is
        a single bare pass, and one slow pass would otherwise keep the probe
        that corrects it from ever running (a short request then never
        verifies). A real step at any k is enough: probes choose their k
        afresh each time, and waiting for one at each k let a batch of short
        chats at B=16 on a CPU probe at 4, 12, 28 and 60 steps into every
        64-step wave, at 1.8-4 plain steps each: several times the budget."""
        if not self.budget or not self.costs.observed_any(batch_size):
            return 0
        extra = self.costs.spent(batch_size, k) - 1.0
        backoff = 2 ** min(self._fruitless, self.fruitless_backoff)
        return min(math.ceil(extra * backoff / self.budget), 2 * self.max_interval * backoff)

    def cost_probe_due(self, batch_size: int) -> bool:
        """One more step where no k can pay; whether it is the bucket's cost probe."""
        bucket = batch_bucket(batch_size)
        n = self._unpaid[bucket] = self._unpaid.get(bucket, 0) + 1
        return bool(self.cost_probe_interval) and n % self.cost_probe_interval == 0
