"""What one speculative step decided, as plain values: the ``StepPlan``
every rank executes (shared in tensor parallel), rank 0's own side of it
(``Decided``), and the tokens it emits (``SpecResponse``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..runtime import mlx_lm_adapter


@dataclass
class SpecResponse(mlx_lm_adapter.GenerationResponse):
    """One emitted token, with where it came from.

    ``draft_position`` is None for the first token of a sequence's run in a
    step (the pending token) and j for its j-th accepted draft (0-based);
    ``num_drafted`` (on the first token only) is how many drafts were verified
    for the sequence in that step; ``proposer`` names where they came from
    when several proposers take part.
    """

    draft_position: Optional[int] = None
    num_drafted: int = 0
    proposer: Optional[str] = None


@dataclass
class StepPlan:
    """What every rank needs for one verification step (shared in tensor parallel)."""

    pending: list  # [B] tokens sampled, not yet fed
    drafts: np.ndarray  # [B, K] drafts, padded with placeholders to a k bucket
    num_drafts: list  # [B] real drafts per row
    forced_only: bool  # only grammar-forced drafts (speculation itself off)


@dataclass
class Decided:
    """Rank 0's side of a plan: what only the deciding rank needs."""

    decision: object
    ks: list
    draft_probs: Optional[mx.array]
    completes: list
    constrained: list
    contexts: list
    sources: Optional[list] = None  # [B] the proposer of each row's drafts
