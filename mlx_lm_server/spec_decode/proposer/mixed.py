"""A per-row choice between a cheap proposer and a draft model: the policy
(``LookupOrModel``); the per-row proposer (``per_row.py``) runs the sources
it chooses, merges their rows and hands each its verdicts.

Prompt lookup and suffix drafts cost nothing and win big where the output
copies something (code edits, repeated records); a draft model costs a small
forward per drafted token and wins where nothing can be copied (open prose).
A batch holds both kinds of request at once, and one request changes kind
as it goes (prose around a copied function). So every step, for every row:

- the cheap proposer drafts first;
- a row without a cheap draft, or one whose cheap drafts keep fewer tokens
  than the draft model's would, takes the draft model's draft;
- the draft model runs only when some row takes its draft: a step where
  every row is served by cheap drafts skips its forward entirely;
- and only when those rows are expected to keep enough of its drafts to pay
  for its forwards, against the price of the step without it (see
  ``_model_pays``): where a draft forward is dear (a 0.5B draft for a 1.5B
  target on a CPU costs a third of a target step) chat rows that keep a
  token a step are left without drafts rather than slowing the rows that
  copy;
- when it runs, it also drafts for the rows it already holds, and for rows
  whose cheap drafts keep little, so that their records compare both
  sources; a row whose cheap drafts are kept is never prefilled on the draft
  model (a long prompt's prefill inside a decode step costs more than the
  step: code edits mixed with chat ran at 0.47x plain decoding at B=4 when
  every row was).

The choice rests on each row's own record per proposer: an exponential
average of the tokens kept per step, fed by the verifier for the draft a row
used, and, for the draft model's drafts a row did not use, by comparing them
with what the row emitted (its shadow record). A row's draft model state
that falls far behind (it took cheap drafts for many steps) is prefilled
again when needed rather than caught up in a padded batch forward.

Drafts from both sources are verified in one pass. At temperature > 0 a
cheap draft enters the rejection sampler as a one-hot q, exactly as when the
cheap proposer runs alone, so the output distribution is unchanged.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from ..control.costs import RobustTime, batch_bucket
from ..control.estimates import Ema
from ..drafts import PLACEHOLDER_TOKEN
from ..tree import kept_path

# A row whose cheap drafts keep fewer tokens per step than this (its average)
# is worth a shadow draft from the model, prefill included.
SHADOW_BELOW = 1.0

# While priced out, the draft model still runs in one of this many steps that
# want it, so that its records follow a request whose text changes kind.
MODEL_PROBE_INTERVAL = 16


class _Record:
    """One row's tokens kept per step, per source (None until seen)."""

    __slots__ = ("cheap", "model", "shadow")

    def __init__(self, alpha: float):
        self.cheap = Ema(alpha)
        self.model = Ema(alpha)
        # The draft model's unused draft of the last step, settled against the
        # row's context at the next proposal: (context length then, draft).
        self.shadow: Optional[tuple] = None


class Chosen(NamedTuple):
    """One step's choice, kept for its verdict: the rows that took the
    model's drafts [B], every row's draft length [B], the rows' context
    lengths, and the model's drafts [B, K] with their links [B, K] (None:
    it did not run), those a row did not use becoming its shadow."""

    use_model: np.ndarray
    lengths: np.ndarray
    context_lens: list
    model_drafts: Optional[np.ndarray] = None
    model_parents: Optional[np.ndarray] = None


class LookupOrModel:
    """``--spec-decode ngram,draft`` / ``suffix,draft``: which rows take the
    model's drafts, and whether it runs (see the module). It proposes
    nothing; it is told what the sources drafted and what the rows kept."""

    def __init__(self, lookup_name: str = "ngram", model_name: str = "draft",
                 alpha: float = 0.3):
        self.names = (lookup_name, model_name)
        self.alpha = alpha
        self._rows: dict[int, _Record] = {}
        self.model_steps = 0  # steps the draft model ran
        self.skipped_steps = 0  # steps with drafts where it did not
        self.priced_out_steps = 0  # steps where it was wanted but would not pay
        self._wanted_steps = 0
        self._step_seconds: Callable[[], Optional[float]] = lambda: None  # the engine's price
        self._forward_seconds: dict[int, RobustTime] = {}  # one draft forward, per rows bucket
        self.model_keeps = Ema(alpha)  # tokens kept per step from its drafts, over every row
        self.rows_by_source = {lookup_name: 0, model_name: 0}

    def add(self, uid: int) -> None:
        self._rows[uid] = _Record(self.alpha)

    def remove(self, uid: int) -> None:
        self._rows.pop(uid, None)

    def prefers_model(self, uid: int) -> bool:
        """The row keeps more of the draft model's drafts than of cheap ones
        (a row starts on cheap drafts: they cost nothing to try)."""
        r = self._rows.get(uid)
        return (r is not None and r.cheap.value is not None and r.model.value is not None
                and r.model.value > r.cheap.value)

    def price_step(self, seconds: Callable[[], Optional[float]]) -> None:
        self._step_seconds = seconds

    def _keeps_little(self, uid: int) -> bool:
        r = self._rows.get(uid)
        return r is not None and r.cheap.value is not None and r.cheap.value < SHADOW_BELOW

    def choose(self, uids, k, cheap_lengths: np.ndarray,
               holds: Callable[[int], bool]) -> np.ndarray:
        """[B] the rows that take the model's drafts this step (none: it does
        not run): those without a cheap draft or preferring the model's,
        where the model pays. ``holds``: whether the model holds a row."""
        use_model = np.array([k_i > 0 and (n == 0 or self.prefers_model(u))
                              for u, k_i, n in zip(uids, k, cheap_lengths)], dtype=bool)
        if use_model.any() and not self._model_pays(uids, k, use_model, cheap_lengths, holds):
            self.priced_out_steps += 1
            use_model[:] = False
        if not use_model.any():
            self.skipped_steps += bool(cheap_lengths.any())
        else:
            self.model_steps += 1
        return use_model

    def rows_to_run(self, uids, use_model: np.ndarray, holds: Callable[[int], bool]) -> np.ndarray:
        """The rows the model drafts for when it runs: those taking its drafts,
        those it holds, and those whose cheap drafts keep little (shadows)."""
        return use_model | np.array([holds(u) or self._keeps_little(u) for u in uids], dtype=bool)

    def timed(self, run: np.ndarray, k, seconds: float) -> None:
        """The model drafted for ``run`` [B] in ``seconds`` (synced)."""
        forwards = max((k_i for k_i, r in zip(k, run) if r), default=0)
        if forwards:
            bucket = batch_bucket(int(run.sum()))
            timed = self._forward_seconds.setdefault(bucket, RobustTime(9))
            timed.observe(seconds / forwards)

    def _model_pays(self, uids, k, use_model: np.ndarray, cheap_lengths: np.ndarray,
                    holds: Callable[[int], bool]) -> bool:
        """Whether the rows that want the model's drafts are expected to keep
        enough of them to pay for its forwards this step:

            extra / base > T_model / T_step

        ``base``: the tokens the step emits without the model (one per row,
        plus what each row with a cheap draft keeps of it); ``extra``: what
        the model's drafts keep beyond that; ``T_model``: as many draft
        forwards as the longest draft, at the rows it would run (the median
        of the last few, prefills included); ``T_step``: the step without it
        (the controller's price). Whatever is not known yet (no price, no
        forward timed, no record of the model's drafts) runs the model: it
        is how they become known.
        """
        self._wanted_steps += 1
        rows_run = int(self.rows_to_run(uids, use_model, holds).sum())
        timed = self._forward_seconds.get(batch_bucket(rows_run))
        forward = None if timed is None else timed.value
        step = None if forward is None else self._step_seconds()
        if step is None:
            return True
        if self._wanted_steps % MODEL_PROBE_INTERVAL == 0:
            return True
        base = extra = 0.0
        for uid, wants, n in zip(uids, use_model, cheap_lengths):
            r = self._rows.get(uid)
            cheap = (r.cheap.value or 0.0) if r is not None and n > 0 else 0.0
            base += 1.0 + cheap
            if wants:
                keeps = r.model.value if r is not None and r.model.value is not None \
                    else self.model_keeps.value
                if keeps is None:
                    return True
                extra += max(0.0, keeps - cheap)
        forwards = max(k_i for k_i, wants in zip(k, use_model) if wants)
        return extra * step > base * forwards * forward

    def observe(self, uids: Sequence[int], num_accepted: Sequence[int], chosen: Chosen) -> None:
        """The rows' records, from what each kept of the drafts it used; the
        model's drafts a row did not use wait as its shadow."""
        for i, (uid, n) in enumerate(zip(uids, num_accepted)):
            r = self._rows.get(uid)
            if r is None or not chosen.lengths[i]:
                continue
            if chosen.use_model[i]:
                r.model.update(n)
                self.model_keeps.update(n)
                continue
            r.cheap.update(n)
            if chosen.model_drafts is not None:
                draft = [int(t) for t in chosen.model_drafts[i] if t != PLACEHOLDER_TOKEN]
                if draft:  # the model drafted for this row (``rows_to_run``)
                    r.shadow = (chosen.context_lens[i], draft,
                                chosen.model_parents[i, :len(draft)].tolist())

    def settle_shadows(self, uids, contexts) -> None:
        """The draft model's unused drafts of the last step, against what
        the rows emitted since (the accepted tokens and the new pending)."""
        for uid, context in zip(uids, contexts):
            r = self._rows.get(uid)
            if r is None or r.shadow is None:
                continue
            start, draft, parents = r.shadow
            r.shadow = None
            if len(context) > start:
                kept = len(kept_path(draft, parents, context[start:]))
                r.model.update(kept)
                self.model_keeps.update(kept)

    def tally(self, use_model: np.ndarray, lengths: np.ndarray) -> None:
        drafted = lengths > 0
        self.rows_by_source[self.names[1]] += int((use_model & drafted).sum())
        self.rows_by_source[self.names[0]] += int((~use_model & drafted).sum())

    def stats(self, lookup: dict) -> dict:
        """The mix's report, with the cheap proposer's own (``lookup``)."""
        return {
            "rows_drafted_by": dict(self.rows_by_source),
            "draft_model_steps": self.model_steps,
            "draft_model_skipped_steps": self.skipped_steps,
            "draft_model_priced_out_steps": self.priced_out_steps,
            self.names[0]: lookup,
        }
