"""``DynamicSpecController``: how many tokens to draft this step, and why.

One module because the decision is one formula whose terms (acceptance,
proposal rate, cost, realisation, the matching override, probing) bend each
other, and the reason for each term stays next to the code that computes it;
what can stand alone already does (``costs.py``, ``estimates.py``,
``shadow.py``, ``timing.py``, ``calibration.py``).

Plain Python, no MLX. The decision is an expected-gain rule, not an
acceptance threshold alone (acceptance can stay flat while the right choice
flips with batch size):

    a_i       per-token acceptance of sequence i: an EMA of accepted drafts
              over (accepted drafts + rejections), per sequence after warm-up,
              the global EMA before
    r_i       how often the proposer has a draft for sequence i when asked (an
              n-gram proposer finds nothing to copy in most steps of a chat; a
              draft model always proposes): an EMA, per sequence after
              warm-up, the global EMA before
    E_i(k)    = 1 + r_i (e(a_i, k) - 1)   tokens sequence i emits per step, where
              e(a, k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023), k + 1
              when a = 1
    c(B, k)   = T_verify(B, k + 1) / T_plain(B)   the measured cost of a
              verification step over k + 1 tokens relative to a plain step,
              at batch size B. T_plain is a plain step's cycle in a run of
              them (start to next start, pipelined), T_verify the
              verification step's cycle plus what the plain steps after it
              pay over T_plain (realigning, an empty pipeline: see
              ``timing.py``); per
              power-of-two bucket of B and per k bucket, the median of the
              last few (``costs.StepCosts``), seeded by the start-up
              calibration; unseen k are priced on the line through the seen
              ones and a plain step at k = 0
    P(B)      = 1 - prod_i (1 - r_i)   how often some row has a draft: a step
              where none has one is a plain step (the engine runs no pass
              without drafts), so it costs 1, not c(B, k). At B = 1 on a chat
              (r = 0.2) this is the difference between paying c and paying
              1 + 0.2 (c - 1); at B = 16 it is 1 within 0.3%.
    rho       realisation: over verification steps, the EMA of the tokens
              emitted by the rows that had drafts over the EMA of the tokens
              e(a_i, k_i) predicted for them when k was chosen, at most 1;
              rows still on the global prior (not warmed up) are left out
    gain(k)   = rho * sum_i E_i(k) / (B * (1 + P(B) (c(B, k) - 1)))

Why rho: the controller speculates exactly when its estimates look good, so
the steps it verifies are the ones where noisy per-sequence estimates run
high, and they then fall back (regression to the mean). Where the gain is
thin (a chat batch whose n-gram drafts pay a few percent on paper), that
optimism is the whole margin. rho scales every k alike, so it never changes
which k is best, only whether speculating pays at all; it is capped at 1 so
a lucky run never makes speculation look better than the model says. It
measures the optimism of acceptance only: proposal rates are in P(B) and
E_i, so rows without drafts are left out of it (at B = 1 every verified row
has one, and 1 + r (e - 1) predicted against e emitted read as a lucky run).
rho is floored at ``realisation_floor`` (0.8). The optimism it corrects is
that of choosing steps by noisy estimates, about 0.9 on chat. Far below
that it measures something else, and feeds on itself: where acceptance
comes in bursts (the suffix index drafting a repeated task: a record's keys
copied, its values not), a per-row EMA peaks as a burst ends, so a
controller that verifies only where its estimates are highest verifies just
after each burst, realises a third to a half of its prediction, and, every
gain scaled by that, verifies rarer and later still. On that task at B=1
(Qwen2.5-Coder-0.5B, CPU) rho sat at 0.30-0.56 and 80% of steps were plain;
replayed over its recorded outputs, the controller reached 1.30x plain
decoding where drafting every step would have reached 1.75x, and 1.65x with
the floor, chat and code edit unchanged.
The floor bounds that lag; matching rows remove most of it. A row whose
shadow draft (``shadow.py``) has copied every token emitted since it was
drafted is in a burst now, known from settled tokens without a sync. On a
step the rule above leaves plain, such rows are priced at the matching
acceptance (what drafts of matching rows kept: their verifications and the
rest of their shadow drafts, prior ``prior_matching_acceptance``; a slow EMA,
``matching_alpha``, since it is a property of the workload and its outcomes
are bimodal: the copy goes on or fails at its first token, and a fast EMA
swung to 1.0 on a few long copies), without rho (it is measured on the very
steps it decides), and the step verifies if that pays for the batch's pass as
real verifications price it: the override is optimistic by design, and a
bare calibration pass priced k=8 at B=16 on a CPU at 1.8 plain steps where
real ones cost 4-7 (chat then lost 5%). The controller stays off: the
override changes one step, not the on/off state, whose hysteresis would
keep verifying after the burst (tried: 1.65x -> 1.55x in the replay, where
the override reaches 1.70x; drafting every step 1.75x). Its estimate
learns while off, so a low one is never stuck for want of verifications.
A new sequence is decided on the global estimates until its own have
``warmup`` observations; its misses then are the previous request's ending
carried over (a code edit's answer opens with prose the n-gram cannot copy
after the last answer closed with copied code), which its own estimate
corrects two steps later, and counting them in rho would hold speculation
back well after (seen on a CPU: two such steps took rho to 0.62 and cost
five plain steps a request).

k* maximises gain over a few k buckets (each one compiled pass shape); the step speculates only when gain(k*) clears 1 by a margin
(hysteresis: a larger margin to switch on than to stay on). While off, probe
steps keep the acceptance estimates fresh: the first after ``probe_interval``
plain steps, then at doubling intervals up to ``max_probe_interval``, so a
short dip in acceptance costs little and text the proposer cannot predict
costs almost nothing. A sequence joining resets the interval: it is new
evidence. The interval is never shorter than what keeps probing within
``probe_budget`` (2%) of throughput at the measured cost of a probe.

Probes that do not pay shrink that budget: after each probe in a row that
emitted fewer tokens per row than the plain steps it cost it halves, down to
an eighth (``fruitless_backoff`` halvings), and the first probe that pays
(or speculation switching on) restores it. A proposer that always has a
draft and is rarely right (a learned head on text unlike what it was trained
on: on a CPU at B=1 SmolLM2's open-chat head kept 0.2-0.3 of its drafts on
stories, at 1.4-1.9 plain steps a probe, and its probes cost 1-1.5% of
throughput) then probes at a quarter of a percent of throughput instead of
2%. A proposer with no
draft (prompt lookup on prose) costs nothing either way: its probes are
plain steps and count for nothing here. The same budget still bounds how
late the controller notices text the proposer can predict: at a probe's
price of a quarter of a step, every 100 steps at most.

A k bucket priced only by the start-up calibration can be priced too high for
good (on a CPU a calibration pass is one sample over a short context) and
would then never run to be measured: while speculating, the next bucket
above k* is tried (at most ``explore_tries`` times per batch bucket) while no
real step has timed it and its predicted gain is within ``explore_margin`` of
k*'s. One real sample replaces a higher calibrated figure; a lower one stays.

Where even a perfect proposer cannot pay (every draft proposed and kept,
(k + 1) / c(B, k) below 1 + margin_on for every k: on a CPU at B=16 a pass
over k + 1 tokens costs k + 1 plain steps), acceptance no longer matters, so
neither probes nor shadow drafts are spent on it (they cost a few percent of
a chat batch's throughput there). That verdict rests on real steps only
(three at the k closest to paying): a calibrated figure is one bare pass,
and one slow pass would otherwise switch speculation off for good. Only the
costs can change the verdict, so a cost probe verifies once every
``cost_probe_interval`` plain steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from ..config import k_buckets
from .costs import StepCosts, batch_bucket
from .estimates import AcceptanceEma, Ema, expected_tokens, tokens_per_step


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


class DynamicSpecController:
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
    ):
        self.max_k = max_k
        self.alpha = alpha
        self.dynamic = dynamic
        self.adaptive_k = adaptive_k
        self.acceptance_threshold = acceptance_threshold
        self.disable_by_batch_size = disable_by_batch_size
        self.warmup = warmup
        self.margin_on = margin_on
        self.margin_off = margin_off
        self.probe_interval = probe_interval
        self.max_probe_interval = max(max_probe_interval, probe_interval)
        self.probe_budget = probe_budget
        self.prior_acceptance = prior_acceptance
        self.explore_margin = explore_margin
        self.explore_tries = explore_tries
        self._explored: dict[tuple[int, int], int] = {}  # (batch bucket, k) -> tries
        self.cost_probe_interval = cost_probe_interval
        self.realisation_floor = realisation_floor
        self._unpaid: dict[int, int] = {}  # batch bucket -> steps since its cost probe
        self.fruitless_backoff = fruitless_backoff
        self._fruitless = 0  # probes in a row whose drafts were all rejected

        self.global_acceptance = AcceptanceEma(alpha)
        self.matching_acceptance = AcceptanceEma(matching_alpha)
        self.prior_matching_acceptance = prior_matching_acceptance
        self._seq: dict[int, AcceptanceEma] = {}
        self.global_proposal_rate = Ema(alpha)
        self._proposal_rate: dict[int, Ema] = {}
        self._emitted = Ema(alpha)
        self._predicted = Ema(alpha)
        self.costs = StepCosts(cost_window)
        self.speculating = True
        self._steps_off = 0
        self._probe_wait = probe_interval
        self._known: set[int] = set()

    # ---- observations ----------------------------------------------------

    def remove_sequence(self, uid: int) -> None:
        self._seq.pop(uid, None)
        self._proposal_rate.pop(uid, None)
        self._known.discard(uid)

    def observe_proposal(self, uid: int, proposed: bool) -> None:
        """Whether the proposer had drafts for a sequence it was asked to draft for."""
        x = 1.0 if proposed else 0.0
        self._proposal_rate.setdefault(uid, Ema(self.alpha)).update(x)
        self.global_proposal_rate.update(x)

    def observe_acceptance(self, uid: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self._seq.setdefault(uid, AcceptanceEma(self.alpha)).update(drafted, accepted)
        self.global_acceptance.update(drafted, accepted)

    def observe_matching(self, drafted: int, accepted: int) -> None:
        """Drafts of a row whose shadow draft was matching: verified, or the
        rest of that shadow draft settled by plain steps."""
        self.matching_acceptance.update(drafted, accepted)

    def observe_realisation(self, predicted_tokens: float, emitted_tokens: int) -> None:
        """A verification step's tokens (pending plus accepted, over the rows
        that had drafts) against the e(a_i, k_i) the controller expected of
        them when it chose k."""
        if predicted_tokens > 0:
            self._emitted.update(emitted_tokens)
            self._predicted.update(predicted_tokens)

    def realised(self, report: StepReport) -> tuple[float, int]:
        """(predicted, emitted) tokens of a verification step's rows that had
        drafts and were decided on their own estimates (see the module docstring)."""
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
                self._fruitless = 0 if self._paid(report) else self._fruitless + 1
            matching = report.decision.matching
            for uid, drafted, n in zip(report.uids, report.proposed, report.accepted):
                if uid in matching:
                    self.observe_matching(drafted, n)

    def _paid(self, report: StepReport) -> bool:
        """Whether a probe emitted, per row, at least the plain steps it cost:
        text worth speculating on shows itself so; drafts kept too rarely to
        pay for the pass (a weak head's one in three) do not."""
        rows = len(report.accepted)
        emitted = sum(1 + n for n in report.accepted) / max(rows, 1)
        return emitted >= self.cost(report.batch_size, report.decision.k)

    def observe_plain_step(self, batch_size: int, seconds: float) -> None:
        self.costs.observe_plain(batch_size, seconds)

    def observe_verify_step(self, batch_size: int, k: int, seconds: float) -> None:
        self.costs.observe_verify(batch_size, k, seconds)

    # ---- estimates -------------------------------------------------------

    def _estimate(self, per_sequence: dict, global_value: Optional[float], uid: int,
                  prior: float) -> float:
        """The sequence's own EMA once warmed up, else the global one, else the prior."""
        own = per_sequence.get(uid)
        if self._warm(own):
            return own.value
        return prior if global_value is None else global_value

    def _warm(self, own) -> bool:
        return own is not None and own.count >= self.warmup

    def acceptance(self, uid: int) -> float:
        return self._estimate(self._seq, self.global_acceptance.value, uid, self.prior_acceptance)

    def matching_estimate(self) -> tuple[float, float]:
        """(acceptance, proposal rate) of a row whose shadow draft is still
        matching: what verifications of such rows kept, and a draft each time
        (a row that just copied its shadow draft has one to continue)."""
        a = self.matching_acceptance.value
        return (self.prior_matching_acceptance if a is None else a), 1.0

    def proposal_rate(self, uid: int) -> float:
        return self._estimate(self._proposal_rate, self.global_proposal_rate.value, uid, 1.0)

    def tokens_per_step(self, uid: int, k: int) -> float:
        """E_i(k): a step without drafts for the sequence still emits one token."""
        return tokens_per_step(self.acceptance(uid), self.proposal_rate(uid), k)

    def cost(self, batch_size: int, k: int) -> float:
        """Verification pass over k + 1 tokens, in plain steps (at least 1)."""
        return self.costs.cost(batch_size, k)

    @property
    def realisation(self) -> float:
        """How much of its predicted tokens speculation has delivered, at most 1."""
        if self._predicted.value is None:
            return 1.0
        return min(1.0, self._emitted.value / self._predicted.value)

    @property
    def realisation_factor(self) -> float:
        """rho: the realisation, floored (see the module docstring)."""
        return max(self.realisation_floor, self.realisation)

    def gain(self, uids: Sequence[int], k: int) -> float:
        if not uids:
            return 0.0
        return self._gain([(self.acceptance(u), self.proposal_rate(u)) for u in uids], k)

    def _gain(self, estimates: Sequence[tuple[float, float]], k: int,
              cost: Optional[float] = None, rho: Optional[float] = None) -> float:
        """Gain from per-sequence (acceptance, proposal rate), looked up once
        per step (and c(B, k), when the caller has priced it already)."""
        tokens = sum(tokens_per_step(a, r, k) for a, r in estimates)
        if cost is None:
            cost = self.cost(len(estimates), k)
        none_drafts = math.prod(1.0 - r for _, r in estimates)
        step_cost = 1.0 + (1.0 - none_drafts) * (cost - 1.0)
        if rho is None:
            rho = self.realisation_factor
        return rho * tokens / (len(estimates) * step_cost)

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
            # one before trusting any estimate (a prior can make verification
            # look cheap for ever, since speculating never times a plain step).
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
        best_k, best_gain = max(((k, self._gain(estimates, k, costs[k])) for k in candidates),
                                key=lambda x: x[1])
        g_accept = self.global_acceptance.value
        detail = (
            f"B={B}, acceptance={'n/a' if g_accept is None else f'{g_accept:.2f}'}, "
            f"k={best_k}: {sum(tokens_per_step(a, r, best_k) for a, r in estimates) / B:.2f} "
            f"tokens/seq/step at {self.cost(B, best_k):.2f}x a plain step, "
            f"realisation {self.realisation_factor:.2f}, gain {best_gain:.2f}"
        )
        if not self.dynamic:
            return Decision(best_k, self._per_sequence(uids, best_k, by_uid), "dynamic off; " + detail)
        if g_accept is not None and g_accept < self.acceptance_threshold:
            return self._off_or_probe(uids, best_k, f"acceptance {g_accept:.2f} below threshold "
                                      f"{self.acceptance_threshold:.2f}; " + detail)
        margin = self.margin_off if self.speculating else self.margin_on
        if best_gain >= 1.0 + margin:
            self.speculating = True
            self._steps_off = 0
            self._fruitless = 0
            self._probe_wait = self.probe_interval
            tried = self._untimed_bucket_above(B, candidates, estimates, best_k, best_gain)
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
        if not above or self.costs.observed(B, above[0]):
            return None
        key = (batch_bucket(B), above[0])
        if self._explored.get(key, 0) >= self.explore_tries:
            return None
        if self._gain(estimates, above[0]) < (1.0 - self.explore_margin) * best_gain:
            return None
        self._explored[key] = self._explored.get(key, 0) + 1
        return above[0]

    def _cost_probe_or_off(self, uids, k) -> Decision:
        """Off at a batch size where no k can pay; a cost probe at the k
        closest to paying once every ``cost_probe_interval`` steps, since only
        a cheaper measured pass can change that."""
        B = len(uids)
        self.speculating = False
        bucket = batch_bucket(B)
        n = self._unpaid[bucket] = self._unpaid.get(bucket, 0) + 1
        reason = (f"B={B}: no k can pay (k={k}: {k + 1} tokens at best for "
                  f"{self.cost(B, k):.2f}x a plain step)")
        if self.cost_probe_interval and n % self.cost_probe_interval == 0:
            return Decision(k, {u: k for u in uids}, "cost probe: " + reason, probe=True)
        return Decision(0, reason="off: " + reason, cannot_pay=True)

    def _probe_floor(self, uids, k) -> int:
        """Fewest plain steps between probes for probing to cost at most
        ``probe_budget`` of throughput: a probe costs c(B, k) - 1 plain steps,
        which at a large batch on a CPU is half a step or more. Only a cost
        line that real steps anchor spaces them: a calibrated figure alone is
        a single bare pass, and one slow pass would otherwise keep the probe
        that corrects it from ever running (a short request then never
        verifies). A real step at any k is enough: probes choose their k
        afresh each time, and waiting for one at each k let a batch of short
        chats at B=16 on a CPU probe at 4, 12, 28 and 60 steps into every
        64-step wave, at 1.8-4 plain steps each: several times the budget."""
        if not self.probe_budget or not self.costs.observed_any(len(uids)):
            return 0
        extra = self.cost(len(uids), k) - 1.0
        backoff = 2 ** min(self._fruitless, self.fruitless_backoff)
        return min(math.ceil(extra * backoff / self.probe_budget),
                   2 * self.max_probe_interval * backoff)

    def _off_or_probe(self, uids, k, reason) -> Decision:
        self.speculating = False
        self._steps_off += 1
        wait = max(self._probe_wait, self._probe_floor(uids, k))
        if self.probe_interval and self._steps_off >= wait:
            self._steps_off = 0
            self._probe_wait = min(2 * self._probe_wait, self.max_probe_interval)
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
                or not self.costs.has_plain(B) or not self.costs.observed_any(B):
            return None
        both = self.matching_estimate()
        by_uid = {**by_uid, **{u: both for u in matching}}
        estimates = [by_uid[u] for u in uids]
        candidates = k_buckets(self.max_k) if self.adaptive_k else [self.max_k]
        # No rho: the matching acceptance is measured on the steps it decides.
        k, gain = max(((k, self._gain(estimates, k, rho=1.0)) for k in candidates),
                      key=lambda x: x[1])
        if gain < 1.0 + self.margin_on:
            return None
        return Decision(k, self._per_sequence(uids, k, by_uid),
                        f"matching: {len(matching)} of {B} rows copying their shadow draft "
                        f"(acceptance {both[0]:.2f}), k={k}, gain {gain:.2f}",
                        estimates=by_uid, matching=matching)

    def choose(self, uids: Sequence[int], matching: frozenset = frozenset()) -> Decision:
        """This step's k. ``matching``: the rows whose shadow draft has
        copied every token emitted since it was drafted (see the module
        docstring)."""
        if not self._known.issuperset(uids):
            self._known.update(uids)
            self._probe_wait = min(self._probe_wait, self.probe_interval)
        by_uid = {u: (self.acceptance(u), self.proposal_rate(u)) for u in uids}
        decision = self._decide(uids, by_uid)
        matching = matching.intersection(uids)
        override = matching and self._matching_override(uids, by_uid, matching, decision)
        if override:
            decision, by_uid = override, override.estimates
        own = frozenset(u for u in uids if u not in decision.matching
                        and self._warm(self._seq.get(u)))
        return replace(decision, speculating=self.speculating,
                       acceptance=self.global_acceptance.value, estimates=by_uid, own=own)
