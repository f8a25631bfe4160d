"""What the controller knows of each sequence: EMAs of acceptance and of how
often the proposer has a draft.

Plain Python, no MLX.

    a_i   per-token acceptance of sequence i: an EMA of accepted drafts over
          (accepted drafts + rejections), per sequence after warm-up, the
          global EMA before
    r_i   how often the proposer has a draft for sequence i when asked (an
          n-gram proposer finds nothing to copy in most steps of a chat; a
          draft model always proposes): an EMA, per sequence after warm-up,
          the global EMA before

A new sequence is decided on the global estimates until its own have
``warmup`` observations; its misses then are the previous request's ending
carried over (a code edit's answer opens with prose the n-gram cannot copy
after the last answer closed with copied code), which its own estimate
corrects two steps later.

The matching acceptance is what drafts of matching rows kept (a row whose
shadow draft has copied every token emitted since it was drafted: see
``shadow.py`` and the controller): their verifications and the rest of their
shadow drafts, prior ``prior_matching_acceptance``. Its EMA is slow
(``matching_alpha``): it is a property of the workload, and its outcomes are
bimodal (the copy goes on or fails at its first token), so a fast EMA swung
to 1.0 on a few long copies. A row is priced at it until its own matching
drafts have ``warmup`` observations, then at those: the workload is the
request's, and one server serves many. Code edits took the shared estimate
to 0.9, and the chat that followed verified at k=16 each time one token of
its shadow draft matched, four times a request, for little.
"""

from __future__ import annotations

from typing import Optional


class Ema:
    """Exponential moving average that reports None until its first update."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value: Optional[float] = None
        self.count = 0

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.count += 1
        return self.value


class AcceptanceEma:
    """Per-token acceptance from (drafted, accepted) observations.

    A step that drafted d and kept n < d saw n successes and one failure; one
    that kept all d saw d successes and no failure. The estimate is the ratio
    of the EMAs of successes and trials.
    """

    def __init__(self, alpha: float):
        self.successes = Ema(alpha)
        self.trials = Ema(alpha)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.successes.update(accepted)
        self.trials.update(accepted + (1 if accepted < drafted else 0))

    @property
    def count(self) -> int:
        return self.successes.count

    @property
    def value(self) -> Optional[float]:
        if self.trials.value is None:
            return None
        if self.trials.value <= 0:
            return 0.0
        return min(1.0, self.successes.value / self.trials.value)


class RowEstimates:
    """a_i and r_i of every sequence added, the global EMAs behind them, and
    the matching acceptance (see the module docstring)."""

    def __init__(self, alpha: float, *, warmup: int = 2, prior_acceptance: float = 0.5,
                 matching_alpha: float = 0.05, prior_matching_acceptance: float = 0.7):
        self.alpha = alpha
        self.warmup = warmup
        self.prior_acceptance = prior_acceptance
        self.prior_matching_acceptance = prior_matching_acceptance
        self.global_acceptance = AcceptanceEma(alpha)
        self.global_proposal_rate = Ema(alpha)
        self.matching_acceptance = AcceptanceEma(matching_alpha)
        self.acceptance_of: dict[int, AcceptanceEma] = {}
        self.proposal_rate_of: dict[int, Ema] = {}
        self.matching_of: dict[int, AcceptanceEma] = {}

    def remove(self, uid: int) -> None:
        self.acceptance_of.pop(uid, None)
        self.proposal_rate_of.pop(uid, None)
        self.matching_of.pop(uid, None)

    def observe_proposal(self, uid: int, proposed: bool) -> None:
        """Whether the proposer had drafts for a sequence it was asked to draft for."""
        x = 1.0 if proposed else 0.0
        self.proposal_rate_of.setdefault(uid, Ema(self.alpha)).update(x)
        self.global_proposal_rate.update(x)

    def observe_acceptance(self, uid: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.acceptance_of.setdefault(uid, AcceptanceEma(self.alpha)).update(drafted, accepted)
        self.global_acceptance.update(drafted, accepted)

    def observe_matching(self, uid: int, drafted: int, accepted: int) -> None:
        """Drafts of a row whose shadow draft was matching: verified, or the
        rest of that shadow draft settled by plain steps."""
        if drafted > 0:
            self.matching_of.setdefault(uid, AcceptanceEma(self.alpha)).update(drafted, accepted)
        self.matching_acceptance.update(drafted, accepted)

    def warm(self, uid: int) -> bool:
        """Whether the sequence is decided on its own acceptance."""
        return self._warm(self.acceptance_of.get(uid))

    def _warm(self, own) -> bool:
        return own is not None and own.count >= self.warmup

    def _estimate(self, per_sequence: dict, global_value: Optional[float], uid: int,
                  prior: float) -> float:
        """The sequence's own EMA once warmed up, else the global one, else the prior."""
        own = per_sequence.get(uid)
        if self._warm(own):
            return own.value
        return prior if global_value is None else global_value

    def acceptance(self, uid: int) -> float:
        return self._estimate(self.acceptance_of, self.global_acceptance.value, uid,
                              self.prior_acceptance)

    def proposal_rate(self, uid: int) -> float:
        return self._estimate(self.proposal_rate_of, self.global_proposal_rate.value, uid, 1.0)

    def matching(self, uid: int) -> tuple[float, float]:
        """(acceptance, proposal rate) of a row whose shadow draft is still
        matching: what verifications of such rows kept (its own, once warmed
        up), and a draft each time (a row that just copied its shadow draft
        has one to continue)."""
        a = self._estimate(self.matching_of, self.matching_acceptance.value, uid,
                           self.prior_matching_acceptance)
        return a, 1.0
