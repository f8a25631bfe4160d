"""``DynamicSpecController``: how many tokens to draft this step, and why.

Plain Python, no MLX. The decision is an expected-gain rule, not an acceptance
threshold alone (acceptance can stay flat while the right choice flips with
batch size):

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
              at batch size B. T_verify is the step's whole period, from its
              start to the next step's start (it waits for the pipelined plain
              pass before it and emits with no pass running behind it); per
              power-of-two bucket of B, an EMA-weighted least-squares line
              T_verify = t0 + t1 k through the steps seen, so one noisy step
              moves no single k and unseen k are interpolated (with one k
              seen, along the line from a plain step at k = 0)
    rho       realisation: over verification steps, the EMA of the tokens they
              emitted over the EMA of the tokens sum_i E_i(k_i) predicted for
              them when k was chosen, at most 1
    gain(k)   = rho * sum_i E_i(k) / (B * c(B, k))

Why rho: the controller speculates exactly when its estimates look good, so
the steps it verifies are the ones where noisy per-sequence estimates run
high, and they then fall back (regression to the mean). Where the gain is
thin (a chat batch whose n-gram drafts pay a few percent on paper), that
optimism is the whole margin. rho scales every k alike, so it never changes
which k is best, only whether speculating pays at all; it is capped at 1 so
a lucky run never makes speculation look better than the model says.

k* maximises gain; the step speculates only when gain(k*) clears 1 by a margin
(hysteresis: a larger margin to switch on than to stay on). While off, probe
steps keep the acceptance estimates fresh: the first after ``probe_interval``
plain steps, then at doubling intervals up to ``max_probe_interval``, so a
short dip in acceptance costs little and text the proposer cannot predict
costs almost nothing. A sequence joining resets the interval: it is new
evidence. The interval is never shorter than what keeps probing within
``probe_budget`` (2%) of throughput at the measured cost of a probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

# Cost prior for a (bucket, k) never measured: cheap enough to be tried once.
PRIOR_COST_PER_TOKEN = 0.08


def expected_tokens(a: float, k: int) -> float:
    """Tokens emitted per step with k drafts and per-token acceptance a."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def _tokens_per_step(acceptance: float, proposal_rate: float, k: int) -> float:
    """E(k) = 1 + r (e(a, k) - 1): only steps with drafts add to the one token."""
    return 1.0 + proposal_rate * (expected_tokens(acceptance, k) - 1.0)


def batch_bucket(batch_size: int) -> int:
    """Power-of-two bucket: costs measured at 5 and 7 sequences are shared."""
    b = 1
    while b < batch_size:
        b *= 2
    return b


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


class LinearCost:
    """EMA-weighted least-squares fit of verify time as t0 + t1 * k."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self._sums = [0.0] * 5  # weights of 1, k, k^2, t, k*t

    def update(self, k: int, seconds: float) -> None:
        a = self.alpha
        point = (1.0, k, k * k, seconds, k * seconds)
        self._sums = [(1 - a) * s + a * x for s, x in zip(self._sums, point)]

    def predict(self, k: int, plain_seconds: float) -> Optional[float]:
        """With one k seen, the line through it and a plain step at k = 0 (a
        pass over one token is a plain step): a fixed prior slope made one
        slow k=10 probe at a long context price k=1 at three plain steps."""
        s0, sk, skk, st, skt = self._sums
        if s0 <= 0:
            return None
        mean_k, mean_t = sk / s0, st / s0
        var_k = skk / s0 - mean_k**2  # ~1e-13 when only one k was ever seen
        if var_k <= 1e-9:
            slope = max(0.0, (mean_t - plain_seconds) / mean_k) if mean_k > 0 else 0.0
        else:
            slope = max(0.0, (skt / s0 - mean_k * mean_t) / var_k)
        return mean_t + slope * (k - mean_k)


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


@dataclass
class Decision:
    k: int
    per_sequence_k: dict = field(default_factory=dict)
    reason: str = ""
    probe: bool = False


class DynamicSpecController:
    def __init__(
        self,
        max_k: int,
        *,
        alpha: float = 0.3,
        cost_alpha: float = 0.2,
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
    ):
        self.max_k = max_k
        self.alpha = alpha
        self.cost_alpha = cost_alpha
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

        self.global_acceptance = AcceptanceEma(alpha)
        self._seq: dict[int, AcceptanceEma] = {}
        self.global_proposal_rate = Ema(alpha)
        self._proposal_rate: dict[int, Ema] = {}
        self._emitted = Ema(alpha)
        self._predicted = Ema(alpha)
        self._decided_on: dict[int, tuple[float, float]] = {}  # uid -> (a, r) of the last decision
        self._plain_time: dict[int, Ema] = {}
        self._verify_time: dict[int, LinearCost] = {}
        self.speculating = True
        self._steps_off = 0
        self._probe_wait = probe_interval
        self._known: set[int] = set()
        self.last: Optional[Decision] = None
        self.k_counts: dict[int, int] = {}

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

    def observe_realisation(self, predicted_tokens: float, emitted_tokens: int) -> None:
        """A verification step's tokens (pending plus accepted, over the batch)
        against the sum of E_i(k_i) the controller expected when it chose k."""
        if predicted_tokens > 0:
            self._emitted.update(emitted_tokens)
            self._predicted.update(predicted_tokens)

    def predicted_tokens(self, uids: Sequence[int], ks: Sequence[int]) -> float:
        """sum_i E_i(k_i) on the estimates the step's decision was made on, not
        on the ones its own outcome has since updated."""
        est = self._decided_on
        return sum(_tokens_per_step(*(est.get(u) or (self.acceptance(u), self.proposal_rate(u))), k)
                   for u, k in zip(uids, ks))

    def observe_plain_step(self, batch_size: int, seconds: float) -> None:
        self._plain_time.setdefault(batch_bucket(batch_size), Ema(self.cost_alpha)).update(seconds)

    def observe_verify_step(self, batch_size: int, k: int, seconds: float) -> None:
        bucket = batch_bucket(batch_size)
        self._verify_time.setdefault(bucket, LinearCost(self.cost_alpha)).update(k, seconds)

    # ---- estimates -------------------------------------------------------

    def _estimate(self, per_sequence: dict, global_value: Optional[float], uid: int,
                  prior: float) -> float:
        """The sequence's own EMA once warmed up, else the global one, else the prior."""
        own = per_sequence.get(uid)
        if own is not None and own.count >= self.warmup:
            return own.value
        return prior if global_value is None else global_value

    def acceptance(self, uid: int) -> float:
        return self._estimate(self._seq, self.global_acceptance.value, uid, self.prior_acceptance)

    def proposal_rate(self, uid: int) -> float:
        return self._estimate(self._proposal_rate, self.global_proposal_rate.value, uid, 1.0)

    def tokens_per_step(self, uid: int, k: int) -> float:
        """E_i(k): a step without drafts for the sequence still emits one token."""
        return _tokens_per_step(self.acceptance(uid), self.proposal_rate(uid), k)

    def cost(self, batch_size: int, k: int) -> float:
        """Verification pass over k + 1 tokens, in plain steps (at least 1)."""
        bucket = batch_bucket(batch_size)
        plain = self._plain_time.get(bucket)
        verify = self._verify_time.get(bucket)
        if plain is None or verify is None or plain.value <= 0:
            return 1.0 + PRIOR_COST_PER_TOKEN * k
        t = verify.predict(k, plain.value)
        return max(1.0, t / plain.value)

    @property
    def realisation_factor(self) -> float:
        """rho: how much of its predicted tokens speculation has delivered, at most 1."""
        if self._predicted.value is None:
            return 1.0
        return min(1.0, self._emitted.value / self._predicted.value)

    def gain(self, uids: Sequence[int], k: int) -> float:
        if not uids:
            return 0.0
        return self._gain([(self.acceptance(u), self.proposal_rate(u)) for u in uids], k)

    def _gain(self, estimates: Sequence[tuple[float, float]], k: int) -> float:
        """Gain from per-sequence (acceptance, proposal rate), looked up once per step."""
        tokens = sum(_tokens_per_step(a, r, k) for a, r in estimates)
        return self.realisation_factor * tokens / (len(estimates) * self.cost(len(estimates), k))

    # ---- the decision ------------------------------------------------------

    def _decide(self, uids: Sequence[int]) -> Decision:
        B = len(uids)
        if self.disable_by_batch_size is not None and B >= self.disable_by_batch_size:
            return Decision(0, reason=f"batch size {B} >= disable cap {self.disable_by_batch_size}")
        if not self.dynamic and not self.adaptive_k:
            return Decision(self.max_k, {u: self.max_k for u in uids}, "fixed k (dynamic and adaptive k off)")

        bucket = batch_bucket(B)
        if self.dynamic and bucket not in self._plain_time:
            # c(B, k) is relative to a plain step at this batch size: measure
            # one before trusting any estimate (a prior can make verification
            # look cheap for ever, since speculating never times a plain step).
            return Decision(0, reason=f"calibrate: timing a plain step at batch bucket {bucket}")
        candidates = range(1, self.max_k + 1) if self.adaptive_k else [self.max_k]
        estimates = [(self.acceptance(u), self.proposal_rate(u)) for u in uids]
        self._decided_on = dict(zip(uids, estimates))
        best_k, best_gain = max(((k, self._gain(estimates, k)) for k in candidates),
                                key=lambda x: x[1])
        g_accept = self.global_acceptance.value
        detail = (
            f"B={B}, acceptance={'n/a' if g_accept is None else f'{g_accept:.2f}'}, "
            f"k={best_k}: {sum(_tokens_per_step(a, r, best_k) for a, r in estimates) / B:.2f} "
            f"tokens/seq/step at {self.cost(B, best_k):.2f}x a plain step, "
            f"realisation {self.realisation_factor:.2f}, gain {best_gain:.2f}"
        )
        if not self.dynamic:
            return Decision(best_k, self._per_sequence(uids, best_k), "dynamic off; " + detail)
        if g_accept is not None and g_accept < self.acceptance_threshold:
            return self._off_or_probe(uids, best_k, f"acceptance {g_accept:.2f} below threshold "
                                      f"{self.acceptance_threshold:.2f}; " + detail)
        margin = self.margin_off if self.speculating else self.margin_on
        if best_gain >= 1.0 + margin:
            self.speculating = True
            self._steps_off = 0
            self._probe_wait = self.probe_interval
            return Decision(best_k, self._per_sequence(uids, best_k), "speculate: " + detail)
        return self._off_or_probe(uids, best_k, f"gain below 1 + {margin:.2f}; " + detail)

    def _probe_floor(self, uids, k) -> int:
        """Fewest plain steps between probes for probing to cost at most
        ``probe_budget`` of throughput: a probe costs c(B, k) - 1 plain steps,
        which at a large batch on a CPU is half a step or more."""
        if not self.probe_budget:
            return 0
        extra = self.cost(len(uids), k) - 1.0
        return min(math.ceil(extra / self.probe_budget), 2 * self.max_probe_interval)

    def _off_or_probe(self, uids, k, reason) -> Decision:
        self.speculating = False
        self._steps_off += 1
        wait = max(self._probe_wait, self._probe_floor(uids, k))
        if self.probe_interval and self._steps_off >= wait:
            self._steps_off = 0
            self._probe_wait = min(2 * self._probe_wait, self.max_probe_interval)
            return Decision(k, {u: k for u in uids}, "probe: " + reason, probe=True)
        return Decision(0, reason="off: " + reason)

    def _per_sequence(self, uids, k) -> dict:
        """Draft only for sequences whose drafts are expected to pay for their share."""
        out = {}
        for u in uids:
            # Acceptance only: a row whose drafts are rare costs nothing when it has none.
            out[u] = k if expected_tokens(self.acceptance(u), k) > 1.0 + self.margin_off else 0
        if not any(out.values()):  # the batch is worth it as a whole: let everyone draft
            out = {u: k for u in uids}
        return out

    def choose(self, uids: Sequence[int]) -> Decision:
        if not self._known.issuperset(uids):
            self._known.update(uids)
            self._probe_wait = min(self._probe_wait, self.probe_interval)
        decision = self._decide(uids)
        self.last = decision
        self.k_counts[decision.k] = self.k_counts.get(decision.k, 0) + 1
        return decision
