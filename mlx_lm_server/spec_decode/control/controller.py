"""``DynamicSpecController``: how many tokens to draft this step, and why.

Plain Python, no MLX. The decision is an expected-gain rule, not an
acceptance threshold alone (acceptance can stay flat while the right choice
flips with batch size): gain(k) is the tokens a row emits per step at k over
what the step costs in plain steps, from each row's acceptance a_i and
proposal rate r_i (``estimates.py``), the measured price of a pass c(B, k)
(``costs.py``) and the realisation rho; the formula, and why each of its
terms is there, are in ``gain.py``. This module is the policy around it.

k* maximises gain over a few k buckets (each one compiled pass shape) among
those that do not slow the rows without drafts more than they speed the
others up (``gain.fair_gain``); the
step speculates only when gain(k*) clears 1 by a margin (hysteresis: a
larger margin to switch on than to stay on). While off, probes verify now
and then to keep the estimates fresh, at a price bounded by a share of
throughput (``probes.py``).

A k bucket priced only by the start-up calibration can be priced too high for
good (on a CPU a calibration pass is one sample over a short context) and
would then never run to be measured: while speculating, the next bucket
above k* is tried (at most ``explore_tries`` times per batch bucket) while no
real step has timed it and its predicted gain is within ``explore_margin`` of
k*'s. One real sample replaces a higher calibrated figure; a lower one stays.
Where untimed k are priced at a floor known to be low instead, nothing is
tried (``StepCosts.priced_low`` says why).

Where even a perfect proposer cannot pay (every draft proposed and kept,
(k + 1) / c(B, k) below 1 + margin_on for every k: on a CPU at B=16 a pass
over k + 1 tokens costs k + 1 plain steps), acceptance no longer matters, so
neither probes nor shadow drafts are spent on it (they cost a few percent of
a chat batch's throughput there). That verdict rests on real steps only
(three at the k closest to paying): a calibrated figure is one bare pass,
and one slow pass would otherwise switch speculation off for good. Only the
costs can change the verdict, so only cost probes verify there
(``probes.py``).

A row's first token (sampled from its prompt) is emitted by the first step
the row takes part in, after that step's pass: a verification pass over
k + 1 tokens would hold it back by what the pass costs over a plain step
(on a CPU at k = 10 over a 1.5k-token file, half a second of a 7 s time
to first token). Such a step is plain where the pass costs at least
``first_token_delay`` plain steps more; on a GPU, where a pass costs about
a plain step, new rows wait for nothing and the step verifies. The same
holds for prompts still being prefilled: upstream runs each prefill chunk
after the decode step of the same call, so a verification delays every
prompt in prefill by what it costs over a plain step (on a CPU, JSON to a
schema and an agent's turns at 4 clients reached their first token 8-20%
later than with speculation off).

Where acceptance comes in bursts, rho's floor bounds how late a controller
that verifies where its estimates are highest catches a burst (see
``gain.py``); matching rows remove most of that lag. A row whose shadow
draft (``shadow.py``) has copied every token emitted since it was drafted is
in a burst now, known from settled tokens without a sync. On a step the rule
above leaves plain, such rows are priced at the matching acceptance (see
``estimates.py``), without rho (it is measured on the very steps it
decides), and the step verifies if that pays for the batch's pass as three
real verifications at its bucket price it: the override is optimistic by
design, a bare calibration pass priced k=8 at B=16 on a CPU at 1.8 plain
steps where real ones cost 4-7 (chat then lost 5%), and one real step left
k=4 and 6 at B=4 priced 20-25% under what they cost. The controller stays
off: the override changes one step, not the on/off state, whose hysteresis
would keep verifying after the burst (tried on the replay of a repeated
task: 1.65x -> 1.55x, where the override reaches 1.70x; drafting every step
1.75x). Its estimate learns while off, so a low one is never stuck for want
of verifications.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from .costs import StepCosts, batch_bucket, k_buckets
from .estimates import RowEstimates
from .gain import Realisation, expected_gain, expected_tokens, fair_ks, tokens_per_step
from .probes import Probes
from .step import Decision, StepReport


class DynamicSpecController:
    """The policy (see the module docstring) over what it keeps: each row's
    estimates (``estimates``), rho (``rho``), the step prices (``costs``) and
    the probe schedule (``probes``). It learns from ``observe(StepReport)``
    and answers ``choose(uids)`` with a ``Decision``."""

    def __init__(
        self,
        max_k: int,
        *,
        alpha: float = 0.3,
        cost_window: int = 9,
        dynamic: bool = True,
        adaptive_k: bool = True,
        acceptance_threshold: float = 0.0,
        disable_by_batch_size: Optional[int] = None,
        warmup: int = 2,
        margin_on: float = 0.10,
        margin_off: float = 0.02,
        probe_interval: int = 4,
        max_probe_interval: int = 64,
        probe_budget: float = 0.02,
        prior_acceptance: float = 0.5,
        explore_margin: float = 0.10,
        explore_tries: int = 3,
        cost_probe_interval: int = 256,
        realisation_floor: float = 0.8,
        prior_matching_acceptance: float = 0.7,
        matching_alpha: float = 0.05,
        fruitless_backoff: int = 3,
        first_token_delay: float = 0.5,
    ):
        self.max_k = max_k
        self.dynamic = dynamic
        self.adaptive_k = adaptive_k
        self.acceptance_threshold = acceptance_threshold
        self.disable_by_batch_size = disable_by_batch_size
        self.margin_on = margin_on
        self.margin_off = margin_off
        self.explore_margin = explore_margin
        self.explore_tries = explore_tries
        self._explored: dict[tuple[int, int], int] = {}  # (batch bucket, k) -> tries
        self.estimates = RowEstimates(alpha, warmup=warmup, prior_acceptance=prior_acceptance,
                                      matching_alpha=matching_alpha,
                                      prior_matching_acceptance=prior_matching_acceptance)
        self.rho = Realisation(alpha, realisation_floor)
        self.costs = StepCosts(cost_window)
        self.probes = Probes(self.costs, interval=probe_interval,
                             max_interval=max_probe_interval, budget=probe_budget,
                             fruitless_backoff=fruitless_backoff,
                             cost_probe_interval=cost_probe_interval)
        self.speculating = True
        # Rows that had a step (see the module docstring on first tokens).
        self.first_token_delay = first_token_delay
        self._stepped: set[int] = set()

    @classmethod
    def from_config(cls, config) -> "DynamicSpecController":
        """The controller a ``SpecDecodeConfig`` asks for."""
        return cls(config.num_speculative_tokens, alpha=config.ema_alpha, dynamic=config.dynamic,
                   adaptive_k=config.adaptive_k, acceptance_threshold=config.acceptance_threshold,
                   disable_by_batch_size=config.disable_by_batch_size)

    # ---- observations ----------------------------------------------------

    def remove_sequence(self, uid: int) -> None:
        self._stepped.discard(uid)
        self.estimates.remove(uid)
        self.probes.forget(uid)

    def observe_proposal(self, uid: int, proposed: bool) -> None:
        self.estimates.observe_proposal(uid, proposed)

    def observe_acceptance(self, uid: int, drafted: int, accepted: int) -> None:
        self.estimates.observe_acceptance(uid, drafted, accepted)

    def observe_matching(self, uid: int, drafted: int, accepted: int) -> None:
        self.estimates.observe_matching(uid, drafted, accepted)

    def observe_realisation(self, predicted_tokens: float, emitted_tokens: int) -> None:
        self.rho.observe(predicted_tokens, emitted_tokens)

    def realised(self, report: StepReport) -> tuple[float, int]:
        """(predicted, emitted) tokens of a verification step's rows that had
        drafts and were decided on their own estimates (see ``gain.py`` on rho)."""
        d = report.decision
        predicted, emitted = 0.0, 0
        for uid, k, drafted, n in zip(report.uids, report.asked, report.proposed,
                                      report.accepted):
            if drafted > 0 and uid in d.own:
                predicted += expected_tokens(d.estimates[uid][0], k)
                emitted += 1 + n
        return predicted, emitted

    def observe(self, report: StepReport) -> None:
        """Learn from one step: its time, its proposals, its acceptances and how
        many of the tokens predicted for it it delivered."""
        if report.seconds is not None:
            if report.k == 0:
                self.observe_plain_step(report.batch_size, report.seconds)
            else:
                self.observe_verify_step(report.batch_size, report.k, report.seconds)
        for uid, asked, got in zip(report.uids, report.asked, report.proposed):
            if asked > 0:
                self.observe_proposal(uid, got > 0)
        if report.accepted is None:
            return
        for uid, drafted, n in zip(report.uids, report.proposed, report.accepted):
            self.observe_acceptance(uid, drafted, n)
        if report.decision is not None:  # a verification step, not shadow drafts
            self.observe_realisation(*self.realised(report))
            if report.decision.probe:
                self.probes.observe(report)
            matching = report.decision.matching
            for uid, drafted, n in zip(report.uids, report.proposed, report.accepted):
                if uid in matching:
                    self.observe_matching(uid, drafted, n)

    def observe_plain_step(self, batch_size: int, seconds: float) -> None:
        self.costs.observe_plain(batch_size, seconds)

    def observe_verify_step(self, batch_size: int, k: int, seconds: float) -> None:
        self.costs.observe_verify(batch_size, k, seconds)

    # ---- estimates (``estimates.py``) and their arithmetic (``gain.py``) ----

    def acceptance(self, uid: int) -> float:
        return self.estimates.acceptance(uid)

    def proposal_rate(self, uid: int) -> float:
        return self.estimates.proposal_rate(uid)

    def cost(self, batch_size: int, k: int) -> float:
        """Verification pass over k + 1 tokens, in plain steps (at least 1)."""
        return self.costs.cost(batch_size, k)

    @property
    def realisation(self) -> float:
        """How much of its predicted tokens speculation has delivered, at most 1."""
        return self.rho.value

    def gain(self, uids: Sequence[int], k: int) -> float:
        if not uids:
            return 0.0
        return self._gain([(self.acceptance(u), self.proposal_rate(u)) for u in uids], k)

    def _gain(self, estimates: Sequence[tuple[float, float]], k: int,
              cost: Optional[float] = None, rho: Optional[float] = None) -> float:
        """Gain from per-sequence (acceptance, proposal rate), looked up once
        per step (and c(B, k), when the caller has priced it already)."""
        if cost is None:
            cost = self.cost(len(estimates), k)
        return expected_gain(estimates, k, cost, self.rho.factor if rho is None else rho)

    # ---- the decision ------------------------------------------------------

    def _decide(self, uids: Sequence[int], by_uid: dict) -> Decision:
        """``by_uid``: each sequence's (acceptance, proposal rate), looked up once per step."""
        B = len(uids)
        if self.capped(B):
            return Decision(0, reason=f"batch size {B} >= disable cap {self.disable_by_batch_size}")
        if not self.dynamic and not self.adaptive_k:
            return Decision(self.max_k, {u: self.max_k for u in uids}, "fixed k (dynamic and adaptive k off)")

        bucket = batch_bucket(B)
        if self.dynamic and not self.costs.has_plain(B):
            # c(B, k) is relative to a plain step at this batch size: measure
            # three (``has_plain``) before trusting any estimate (a prior can
            # make verification look cheap for ever, since speculating never
            # times a plain step).
            return Decision(0, reason=f"calibrate: timing a plain step at batch bucket {bucket}")
        # k from a few buckets: each is one compiled pass shape.
        candidates = k_buckets(self.max_k) if self.adaptive_k else [self.max_k]
        costs = {k: self.cost(B, k) for k in candidates}  # priced once per step
        if self.dynamic:
            # The gain were every draft proposed and kept: (k + 1) / c(B, k).
            ceilings = {k: (k + 1) / costs[k] for k in candidates}
            ceiling_k = max(ceilings, key=ceilings.get)  # the smallest k on ties
            # On real steps only (a median of three): a calibrated figure is
            # one bare pass, and a slow one would switch speculation off for good.
            if ceilings[ceiling_k] < 1.0 + self.margin_on \
                    and self.costs.observed(B, ceiling_k) >= 3:
                return self._cost_probe_or_off(uids, ceiling_k)
        estimates = [by_uid[u] for u in uids]
        gains = {k: self._gain(estimates, k, costs[k]) for k in candidates}
        fair = fair_ks(estimates, candidates, costs, self.rho.factor)
        # The highest gain among the fair k (the smallest k on ties), else
        # among all (what a probe would verify at).
        best_k = max(fair or candidates, key=gains.get)
        best_gain = gains[best_k]
        g_accept = self.estimates.global_acceptance.value
        detail = (
            f"B={B}, acceptance={'n/a' if g_accept is None else f'{g_accept:.2f}'}, "
            f"k={best_k}: {sum(tokens_per_step(a, r, best_k) for a, r in estimates) / B:.2f} "
            f"tokens/seq/step at {costs[best_k]:.2f}x a plain step, "
            f"realisation {self.rho.factor:.2f}, gain {best_gain:.2f}"
        )
        if not self.dynamic:
            return Decision(best_k, self._per_sequence(uids, best_k, by_uid), "dynamic off; " + detail)
        if g_accept is not None and g_accept < self.acceptance_threshold:
            return self._off_or_probe(uids, best_k, f"acceptance {g_accept:.2f} below threshold "
                                      f"{self.acceptance_threshold:.2f}; " + detail)
        margin = self.margin_off if self.speculating else self.margin_on
        if best_gain >= 1.0 + margin and not fair:
            return self._off_or_probe(uids, best_k, "no k speeds the rows with drafts up more "
                                      "than it slows the others down; " + detail)
        if best_gain >= 1.0 + margin:
            self.speculating = True
            self.probes.switched_on()
            tried = self._untimed_bucket_above(B, fair, estimates, best_k, best_gain)
            if tried is not None:
                return Decision(tried, self._per_sequence(uids, tried, by_uid),
                                f"try k={tried} (never timed, within "
                                f"{self.explore_margin:.0%} of the best); " + detail)
            return Decision(best_k, self._per_sequence(uids, best_k, by_uid), "speculate: " + detail)
        return self._off_or_probe(uids, best_k, f"gain below 1 + {margin:.2f}; " + detail)

    def _untimed_bucket_above(self, B, candidates, estimates, best_k, best_gain):
        """The next k bucket above ``best_k`` if it is worth a real timing (see
        the module docstring), else None."""
        above = [k for k in candidates if k > best_k]
        if not above or self.costs.observed(B, above[0]) or self.costs.priced_low(B):
            return None
        key = (batch_bucket(B), above[0])
        if self._explored.get(key, 0) >= self.explore_tries:
            return None
        if self._gain(estimates, above[0]) < (1.0 - self.explore_margin) * best_gain:
            return None
        self._explored[key] = self._explored.get(key, 0) + 1
        return above[0]

    def _cost_probe_or_off(self, uids, k) -> Decision:
        """Off at a batch size where no k can pay, but for a cost probe at the
        k closest to paying now and then (see ``probes.py``)."""
        B = len(uids)
        self.speculating = False
        reason = (f"B={B}: no k can pay (k={k}: {k + 1} tokens at best for "
                  f"{self.cost(B, k):.2f}x a plain step)")
        if self.probes.cost_probe_due(B):
            return Decision(k, {u: k for u in uids}, "cost probe: " + reason, probe=True)
        return Decision(0, reason="off: " + reason, cannot_pay=True)

    def _off_or_probe(self, uids, k, reason) -> Decision:
        self.speculating = False
        if self.probes.due(len(uids), k):
            return Decision(k, {u: k for u in uids}, "probe: " + reason, probe=True)
        return Decision(0, reason="off: " + reason)

    def _per_sequence(self, uids, k, by_uid: dict) -> dict:
        """Draft only for sequences whose drafts are expected to pay for their share."""
        out = {}
        for u in uids:
            # Acceptance only: a row whose drafts are rare costs nothing when it has none.
            out[u] = k if expected_tokens(by_uid[u][0], k) > 1.0 + self.margin_off else 0
        if not any(out.values()):  # the batch is worth it as a whole: let everyone draft
            out = {u: k for u in uids}
        return out

    def capped(self, batch_size: int) -> bool:
        """At or above ``disable_by_batch_size`` nothing speculates, whatever the estimates."""
        cap = self.disable_by_batch_size
        return cap is not None and batch_size >= cap

    def _matching_override(self, uids, by_uid: dict, matching: frozenset,
                           decision: Decision) -> Optional[Decision]:
        """A verification this step, the controller's state left off, where
        rows whose shadow draft is still matching pay for it (see the module
        docstring); None where they do not, or the step must stay plain."""
        B = len(uids)
        if decision.k or decision.cannot_pay or not self.dynamic or self.capped(B) \
                or not self.costs.has_plain(B) or not self.costs.priced_by_real_steps(B):
            return None
        by_uid = {**by_uid, **{u: self.estimates.matching(u) for u in matching}}
        estimates = [by_uid[u] for u in uids]
        candidates = k_buckets(self.max_k) if self.adaptive_k else [self.max_k]
        costs = {k: self.cost(B, k) for k in candidates}
        # No rho: the matching acceptance is measured on the steps it decides.
        fair = fair_ks(estimates, candidates, costs, rho=1.0)
        if not fair:
            return None
        k, gain = max(((k, self._gain(estimates, k, costs[k], rho=1.0)) for k in fair),
                      key=lambda x: x[1])
        if gain < 1.0 + self.margin_on:
            return None
        return Decision(k, self._per_sequence(uids, k, by_uid),
                        f"matching: {len(matching)} of {B} rows copying their shadow draft "
                        f"(acceptance {sum(by_uid[u][0] for u in matching) / len(matching):.2f}), "
                        f"k={k}, gain {gain:.2f}",
                        estimates=by_uid, matching=matching)

    def choose(self, uids: Sequence[int], matching: frozenset = frozenset(),
               grammar: bool = False, prefilling: int = 0) -> Decision:
        """This step's k. ``matching``: the rows whose shadow draft has
        copied every token emitted since it was drafted (see the module
        docstring); ``grammar``: a row follows a grammar, so the step is
        priced and timed with those of its kind (``StepCosts.use``; its
        report arrives before the next step is chosen); ``prefilling``:
        prompts whose prefill waits for this step (see the module docstring
        on first tokens)."""
        self.costs.use(grammar)
        self.probes.seen(uids)
        fresh = sum(u not in self._stepped for u in uids)
        self._stepped.update(uids)
        by_uid = {u: (self.acceptance(u), self.proposal_rate(u)) for u in uids}
        decision = self._decide(uids, by_uid)
        matching = matching.intersection(uids)
        override = matching and self._matching_override(uids, by_uid, matching, decision)
        if override:
            decision, by_uid = override, override.estimates
        if (fresh or prefilling) and decision.k and self.dynamic \
                and self.cost(len(uids), decision.k) >= 1.0 + self.first_token_delay:
            waiting = f"{fresh} new row(s)" if fresh else f"{prefilling} prompt(s) in prefill"
            decision = Decision(0, reason=f"{waiting}: their first token is not held "
                                f"behind a pass of {self.cost(len(uids), decision.k):.2f} "
                                "plain steps")
        own = frozenset(u for u in uids if u not in decision.matching and self.estimates.warm(u))
        return replace(decision, speculating=self.speculating,
                       acceptance=self.estimates.global_acceptance.value, estimates=by_uid,
                       own=own)
