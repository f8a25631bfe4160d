"""What one speculative step decided, as plain values: the ``StepPlan``
every rank executes (shared in tensor parallel) and rank 0's own side of it
(``LeaderPlan``); and what it emits: ``emit`` turns each row's pending token
and kept drafts (up to its first stop) into ``SpecResponse`` values and
writes them into upstream's generation batch (its tokens and finished rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..runtime import mlx_lm_adapter
from .control.step import Decision
from .target_probs import log_softmax


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
    # [B, K] a tree of drafts' parent links (``tree.py``); None: chains.
    parents: Optional[np.ndarray] = None


@dataclass
class LeaderPlan:
    """Rank 0's side of a plan: what only the deciding rank needs."""

    decision: Decision  # the controller's, for its step report
    ks: list
    draft_probs: Optional[mx.array]
    completes: list
    constrained: list
    contexts: list
    sources: Optional[list] = None  # [B] the proposer of each row's drafts
    started: float = 0.0  # when drafting began (``perf_counter``)


def emit(batch, pending: list, out_rows: list, accepted: list, old_logprobs, logits: mx.array,
         num_proposed: list, logprobs: list, sources: Optional[list] = None) -> list:
    """``SpecResponse`` per emitted token: each row's pending token and its
    ``accepted[i]`` kept drafts, cut at the first stop or length limit. The
    tokens enter the row's history; finished rows leave the batch.
    ``logits``: [B, K+1, V] the pass's, processed; ``logprobs``: [B] whether
    the row asked for per-token logprobs."""
    responses, keep = [], []
    for i, uid in enumerate(list(batch.uids)):
        tokens = [pending[i]] + out_rows[i][: accepted[i]]
        finish = None
        # Normalising and slicing [V] rows per token: only when asked for.
        row_logprobs = log_softmax(logits[i]) if logprobs[i] else None
        for j, token in enumerate(tokens):
            lp = old_logprobs[i] if j == 0 else (
                None if row_logprobs is None else row_logprobs[j - 1])
            finish = mlx_lm_adapter.count_and_match(batch, i, token)
            responses.append(SpecResponse(
                uid=uid, token=token, logprobs=lp, finish_reason=finish,
                prompt_cache=None, all_tokens=None,
                draft_position=None if j == 0 else j - 1,
                num_drafted=num_proposed[i] if j == 0 else 0,
                proposer=sources[i] if sources and num_proposed[i] else None,
            ))
            if finish is not None:
                break
        mlx_lm_adapter.record_fed_tokens(batch, i, tokens)
        if finish is None:
            keep.append(i)
        else:  # for the prompt cache; holds exactly the tokens fed
            responses[-1].prompt_cache = [c.extract(i) for c in batch.prompt_cache]
            responses[-1].all_tokens = list(batch.tokens[i])
    if len(keep) < len(batch.uids):
        batch.filter(keep)
    return responses
