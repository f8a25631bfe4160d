"""A step as the controller sees it: the ``Decision`` taken for it, and the
``StepReport`` of what it did.

Plain values: a tensor-parallel rank 0 broadcasts the decision, telemetry
reads it, and the engine, shadow drafts and step timing report back with
``StepReport``s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Decision:
    """One step's choice, as a plain value: what a tensor-parallel rank 0 will
    broadcast, and all that telemetry reads."""

    k: int
    per_sequence_k: dict = field(default_factory=dict)
    reason: str = ""
    probe: bool = False
    speculating: bool = False  # the controller's on/off state after deciding
    acceptance: Optional[float] = None  # the global acceptance EMA it decided on
    # uid -> (acceptance, proposal rate) the choice was made on: a step's own
    # outcome must be compared with these, not with estimates it has updated.
    estimates: dict = field(default_factory=dict)
    # The uids among them decided on their own acceptance, not the global one.
    own: frozenset = frozenset()
    # No k could pay at this batch size whatever the acceptance: nothing to
    # learn from shadow drafts either.
    cannot_pay: bool = False
    # The uids decided as matching (their shadow draft still copying the
    # output): their estimates are the matching acceptance, not their own.
    matching: frozenset = frozenset()


@dataclass(frozen=True)
class StepReport:
    """What a step did, for the controller to learn from.

    A step's cost is known only after the steps that follow it started
    (``timing.StepTimer``), so it comes in a report of its own: ``k`` > 0
    and ``seconds`` for a verification step, ``k = 0`` for a plain one.
    """

    batch_size: int
    uids: tuple = ()
    asked: tuple = ()  # drafts asked for, per row
    proposed: tuple = ()  # drafts the proposer had, per row
    accepted: Optional[tuple] = None  # drafts kept, per row, when verified
    decision: Optional[Decision] = None  # what a verification step was decided on
    k: int = 0
    seconds: Optional[float] = None
