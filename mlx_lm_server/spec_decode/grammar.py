"""A request's grammar inside a speculative step: drafts cut (or replaced)
by what the grammar allows, and one mask per draft position for the
verifier, so verification sees the constrained distribution everywhere.

The grammar itself (``Constraint``) and the plain step's processor live in
``decoding/structured.py``; this is the part only speculation needs.
"""

from __future__ import annotations

import time
from typing import Optional

import mlx.core as mx
import numpy as np

from ..decoding.structured import Constraint, allowed_counts, apply_masks
from .drafts import PLACEHOLDER_TOKEN, pad_columns


def constrain_drafts(constraint: Constraint, drafts: list[int], k: int,
                     one_hot: bool) -> tuple[list[int], bool]:
    """A row's drafts as the grammar lets them be verified, and whether they
    complete the grammar (its masks are then filled one by one: see
    ``draft_masks``).

    Where the grammar forces the next tokens, one-hot drafts that disagree
    with them are replaced by them (they are certain to be kept). Drafts are
    cut at the first token the grammar forbids. Drafts sampled from a
    distribution q keep that first forbidden token as their last: the
    verifier rejects it (the constrained p gives it 0) and draws the next
    token from the residual max(0, p - q) exactly as if it had been sampled
    and rejected; dropping it would draw from p there instead, which is not
    the target distribution. A one-hot draft's residual at a token p rules
    out is p itself, so for those the cut is before it.
    """
    drafts = list(drafts[:k])
    if one_hot and k > 0:
        forced = constraint.forced_tokens()[:k]
        if forced and drafts[: len(forced)] != forced:
            drafts = forced
    valid, completes = 0, False
    if drafts:
        # Walked by consuming (then rolled back): a completed grammar stops
        # consuming, which is how completion shows.
        valid = constraint.matcher.try_consume_tokens(drafts)
        completes = constraint.matcher.is_stopped()
        if valid and not constraint.matcher.rollback(valid):
            raise RuntimeError(f"grammar rollback failed: {constraint.matcher.get_error()}")
    if valid < len(drafts) and not one_hot:
        valid += 1
    return drafts[:valid], completes


def grammar_drafts(tokens: list, constrained: list, pending_list: list, draft_np,
                   num_proposed: list, ks: list, one_hot: bool):
    """Each constrained row's drafts walked through its grammar (see
    ``constrain_drafts``), its grammar first brought to the
    tokens fed so far and the pending token."""
    rows, completes = {}, []
    for i, c in constrained:
        c.sync(tokens[i][c.prompt_len:] + [pending_list[i]])
        drafts = draft_np[i, :num_proposed[i]].tolist()
        rows[i], done = constrain_drafts(c, drafts, ks[i], one_hot)
        completes.append(done)
    width = max([draft_np.shape[1]] + [len(d) for d in rows.values()])
    out = pad_columns(draft_np, width).copy()
    num_proposed = list(num_proposed)
    for i, d in rows.items():
        out[i] = PLACEHOLDER_TOKEN
        out[i, : len(d)] = d
        num_proposed[i] = len(d)
    return out, num_proposed, completes


def draft_masks(constraints: list[Constraint], drafts: list[list[int]], K: int,
                completes: Optional[list[bool]] = None) -> np.ndarray:
    """[R, K+1, words]: for each row, the mask after its consumed tokens and
    after each of its allowed drafts; positions past those allow everything
    (they are never sampled from).

    Rows go through llguidance's thread pool, which stops at a grammar's
    completion without writing the mask after it (only the end of sequence);
    rows whose drafts complete their grammar are filled one position at a
    time instead.
    """
    tic = time.perf_counter()
    R = len(constraints)
    words = constraints[0].words
    masks = np.full((R * (K + 1), words), -1, np.int32)
    completes = completes or [False] * R
    pool = [r for r in range(R) if not completes[r]]
    for r in range(R):
        if completes[r]:
            _fill_along(constraints[r], drafts[r], masks[r * (K + 1):(r + 1) * (K + 1)])
    executor = _executor()
    with_drafts = [(constraints[r].matcher, r * (K + 1), list(drafts[r]))
                   for r in pool if len(drafts[r])]
    without = [(constraints[r].matcher, r * (K + 1)) for r in pool if not len(drafts[r])]
    if with_drafts:
        executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, masks.ctypes.data,
                                                          words * 4, R * (K + 1))
    if without:
        executor.unsafe_compute_mask_ptr(without, masks.ctypes.data, words * 4, R * (K + 1))
    constraints[0].source.mask_seconds += time.perf_counter() - tic
    return masks.reshape(R, K + 1, words)


def _fill_along(constraint: Constraint, drafts: list[int], out: np.ndarray) -> None:
    """``out[j]``: the mask after ``drafts[:j]``, for every allowed prefix."""
    m = constraint.matcher
    taken = 0
    for j in range(len(drafts) + 1):
        constraint.fill(out[j])
        if j == len(drafts) or not m.validate_tokens(drafts[j:j + 1]):
            break
        m.consume_token(drafts[j])
        taken += 1
    if taken and not m.rollback(taken):
        raise RuntimeError(f"grammar rollback failed: {m.get_error()}")


_EXECUTOR = None


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


def apply_row_masks(logits: mx.array, rows: list, masks) -> mx.array:
    """``logits`` [B, K+1, V] with rows' grammar masks [R, K+1, words] applied."""
    masked = apply_masks(logits[mx.array(rows)], masks)
    if len(rows) == logits.shape[0]:
        return masked
    out = list(logits)
    for r, i in enumerate(rows):
        out[i] = masked[r]
    return mx.stack(out)


def settle(constrained: list, masks: np.ndarray, out_rows: list, accepted: list) -> None:
    """Each constrained row's grammar takes its kept drafts; the emitted
    positions whose mask allowed one token count as forced (counting costs a
    pass over those masks only)."""
    for r, (i, c) in enumerate(constrained):
        c.consume(out_rows[i][: accepted[i]])
        c.forced += int((allowed_counts(masks[r, : accepted[i] + 1]) == 1).sum())
