"""Every server's proposer: per row, one draft source this step.

The sources, in order, any of them absent:

- the row's prediction (OpenAI's ``prediction``, ``prediction.py``), where
  its output stands in it;
- the lookup proposer (prompt lookup or suffix: ``ngram.py``, ``suffix.py``);
- a model drafter (a draft model, an MTP layer, an EAGLE-3 head, a DFlash
  drafter: ``base.ModelDrafter``).

With both a lookup and a model drafter, which of the two a row takes, and
whether the model runs at all, is the policy of ``mixed.py``
(``LookupOrModel``); with one, it drafts for every row without a
prediction's draft.

This module alone runs the sources, merges their rows into one proposal
(``drafts.merge_rows``: a row keeps its source's tokens, q, tree links and
chances; a deterministic source's rows are one-hot among sampled ones, so
rejection sampling stays exact), names each row's source, and remembers
which source each row used: a verdict reaches each source that drafted with
its own rows' counts only (the others' 0), and the choice's records. The
hooks the engine calls (hidden states, tree shape, price, rows) reach the
sources from here, once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ...text.reasoning import Thinking
from ..drafts import ProposalResult, links, merge_rows
from .base import BaseProposer, ModelDrafter
from .mixed import Chosen, LookupOrModel
from .prediction import PREDICTION, Predictions

# Where a row's draft came from (``_Step.source``).
NONE, PREDICTED, LOOKUP, MODEL = -1, 0, 1, 2


@dataclass
class _Step:
    """One proposal, kept for its verdict."""

    uids: list
    source: np.ndarray  # [B] int8: each row's source (NONE: none drafted for it)
    ran: list = field(default_factory=list)  # LOOKUP, MODEL: the drafters asked
    chosen: Optional[Chosen] = None  # the lookup-or-model choice, where it was made


class PerRowProposer(BaseProposer):
    """Per row, the prediction's drafts, the lookup's or the model's (see
    the module). ``lookup_name`` / ``model_name``: the kinds' names (the
    rows' sources, the mix's metrics); ``mode``: the ``--spec-decode``
    mode, the name of a row with a prediction drafting otherwise where its
    source names none."""

    def __init__(self, lookup: Optional[BaseProposer] = None,
                 model: Optional[ModelDrafter] = None, lookup_name: str = "ngram",
                 model_name: str = "draft", mode: Optional[str] = None, alpha: float = 0.3,
                 predictions: Optional[Predictions] = None):
        self.lookup, self.model = lookup, model
        self._drafters = {i: p for i, p in ((LOOKUP, lookup), (MODEL, model)) if p is not None}
        self.choice = (LookupOrModel(lookup_name, model_name, alpha)
                       if len(self._drafters) == 2 else None)
        self.mode = mode or ",".join(n for n, p in ((lookup_name, lookup), (model_name, model))
                                     if p is not None)
        self.predictions = Predictions() if predictions is None else predictions
        self._last: Optional[_Step] = None
        self.rows_drafted = 0  # row steps drafted from a prediction

    # ---- what the engine asks of the sources ---------------------------------

    @property
    def shadow(self) -> Optional[BaseProposer]:
        """The lookup's shadow (a model drafter alone: its own), with the
        rows' predictions first: a row that follows its prediction is found
        while speculation is off."""
        first = self.lookup if self.lookup is not None else self.model
        cheap = first.shadow if first is not None else None
        if not self.predictions:
            return cheap
        return PerRowProposer(cheap, lookup_name=self.mode, mode=self.mode,
                              predictions=self.predictions)

    @property
    def needs_hidden(self) -> bool:
        return self.model is not None and self.model.needs_hidden

    @property
    def hidden_layers(self):
        return self.model.hidden_layers if self.model is not None else None

    @property
    def draft_model(self):
        return self.model.draft_model if self.model is not None else None

    def observe_target(self, uids, hidden, kept) -> None:
        if self.model is not None:
            self.model.observe_target(uids, hidden, kept)

    def price_step(self, seconds: Callable[[], Optional[float]]) -> None:
        if self.choice is not None:
            self.choice.price_step(seconds)

    def set_tree_shape(self, width: int, depth: Optional[int] = None) -> None:
        self.tree_width, self.tree_depth = width, depth  # a prediction's rows draft chains
        for drafter in self._drafters.values():
            drafter.set_tree_shape(width, depth)

    def stats(self) -> dict:
        if self.choice is not None:
            body = self.choice.stats(self.lookup.stats())
        else:
            body = next(iter(self._drafters.values())).stats() if self._drafters else {}
        if self.rows_drafted:
            body = {**body, "rows_drafted_from_prediction": self.rows_drafted}
        return body

    # ---- rows ----------------------------------------------------------------

    def add_sequence(self, uid: int, prompt_len: int, params=None) -> None:
        self.predictions.add(uid, prompt_len)
        if self.choice is not None:
            self.choice.add(uid)
        for drafter in self._drafters.values():
            drafter.add_sequence(uid, prompt_len, params)

    def predict(self, uid: int, tokens: Sequence[int], thinking: Optional[Thinking] = None) -> None:
        self.predictions.predict(uid, tokens, thinking)

    def remove_sequence(self, uid: int) -> None:
        self.predictions.remove(uid)
        if self.choice is not None:
            self.choice.remove(uid)
        for drafter in self._drafters.values():
            drafter.remove_sequence(uid)

    # ---- drafting ------------------------------------------------------------

    def propose(self, uids, contexts, k) -> ProposalResult:
        K = max(k, default=0)
        step = self._last = _Step(list(uids), np.full(len(uids), NONE, np.int8))
        predicted = self.predictions.drafts(uids, contexts, k)
        from_prediction = np.array([len(d) > 0 for d in predicted], dtype=bool)
        step.source[from_prediction] = PREDICTED
        self.rows_drafted += int(from_prediction.sum())
        rest = [0 if p else k_i for p, k_i in zip(from_prediction, k)]
        others = None
        if self._drafters and (any(rest) or not from_prediction.any()):
            others = self._propose_others(uids, contexts, rest, step)
        if not from_prediction.any():
            result = others if others is not None else ProposalResult.from_lists(
                [[] for _ in uids], K)
        else:
            ours = ProposalResult.from_lists(predicted, K)
            result = ours if others is None else merge_rows(from_prediction, ours, others, K)
        return self._named(result, uids, from_prediction)

    def _propose_others(self, uids, contexts, k, step: _Step) -> ProposalResult:
        """The drafts of the rows without a prediction's (``k[i]`` 0 for
        those with one): the one drafter's, or per row the lookup's or the model's."""
        if self.choice is not None:
            return self._lookup_or_model(uids, contexts, k, step)
        [(index, drafter)] = self._drafters.items()
        step.ran.append(index)
        step.source[step.source == NONE] = index
        return drafter.propose(uids, contexts, k)

    def _lookup_or_model(self, uids, contexts, k, step: _Step) -> ProposalResult:
        """The lookup drafts for every row; the model for the rows ``mixed.py``
        chooses, and for those it holds or keeps a shadow record of."""
        choice, K = self.choice, max(k, default=0)
        choice.settle_shadows(uids, contexts)
        others = step.source == NONE
        step.ran.append(LOOKUP)
        lookup = self.lookup.propose(uids, contexts, k)
        lookup.sources = [choice.names[0]] * len(uids)
        cheap_lengths = lookup.num_proposed
        context_lens = [len(c) for c in contexts]
        use_model = choice.choose(uids, k, cheap_lengths, self.model.holds)
        if not use_model.any():
            step.source[others] = LOOKUP
            step.chosen = Chosen(use_model, cheap_lengths, context_lens)
            choice.tally(use_model, cheap_lengths)
            return merge_rows(use_model, lookup, lookup, K)  # lookup's alone, K wide
        self.model.forget_lagging(uids, contexts)
        run = choice.rows_to_run(uids, use_model, self.model.holds)
        step.ran.append(MODEL)
        tic = time.perf_counter()
        model = (self.model.propose(uids, contexts, k) if run.all() else
                 self.model.propose_rows(np.flatnonzero(run).tolist(), uids, contexts, k))
        choice.timed(run, k, time.perf_counter() - tic)  # its drafts are on the host: synced
        # A row the model could not draft for (past its context) keeps its cheap draft.
        use_model &= ~((model.num_proposed == 0) & (cheap_lengths > 0))
        model.sources = [choice.names[1]] * len(uids)
        merged = merge_rows(use_model, model, lookup, K)
        step.source[others] = np.where(use_model, MODEL, LOOKUP)[others]
        step.chosen = Chosen(use_model, merged.num_proposed, context_lens, model.draft_tokens,
                             links(model.parents, len(uids), K))
        choice.tally(use_model, merged.num_proposed)
        return merged

    def _named(self, result: ProposalResult, uids, from_prediction: np.ndarray) -> ProposalResult:
        """Each row's source: ``prediction``, or for a row with a prediction
        drafting otherwise its source's name (the mode's where the source
        names none); other rows as their source names them (or not)."""
        if not self.predictions:
            return result
        named = [PREDICTION if p else
                 (result.sources[i] if result.sources else self.mode) if u in self.predictions else
                 (result.sources[i] if result.sources else None)
                 for i, (u, p) in enumerate(zip(uids, from_prediction))]
        result.sources = named
        return result

    def observe_verification(self, uids: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Each drafter asked this step hears of its own rows (the others
        count 0: none of their drafts was its); the choice, of every row."""
        step, self._last = self._last, None
        if step is None or list(uids) != step.uids:
            return  # no proposal of ours for these rows: nothing drafted to take back
        for index in step.ran:
            self._drafters[index].observe_verification(
                uids, [n if s == index else 0 for s, n in zip(step.source, num_accepted)])
        if step.chosen is not None:
            self.choice.observe(uids, num_accepted, step.chosen)
